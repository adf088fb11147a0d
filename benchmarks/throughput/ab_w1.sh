#!/usr/bin/env bash
# W1 throughput of an earlier revision against this checkout, alternating runs in the same .venv
# (the old revision's source goes first on PYTHONPATH). Run from the repository root on a quiet
# machine:  [DTYPE=bfloat16] bash benchmarks/throughput/ab_w1.sh REV [ROUNDS]   (about 45 s per float32 run on
# 2 idle cores; DTYPE defaults to float32)
set -euo pipefail
REV=${1:?usage: bash benchmarks/throughput/ab_w1.sh REV [ROUNDS]}
ROUNDS=${2:-2}
HERE=$(pwd)
OLD=$(mktemp -d)/old
git worktree add -q --detach "$OLD" "$REV"
trap 'git worktree remove --force "$OLD"' EXIT
W1="--num-prompts 64 --input-len-range 32:256 --output-len-range 16:256 --seed 0 --no-progress --dtype ${DTYPE:-float32}"
uptime
for _ in $(seq 1 "$ROUNDS"); do
  for side in "$REV:$OLD" "HEAD:$HERE"; do
    name=${side%%:*}; src=${side#*:}
    echo -n "$name: "
    (cd /tmp && PYTHONPATH="$src" "$HERE/.venv/bin/python" -c "
import sys, vlite
assert vlite.__file__.startswith('$src'), vlite.__file__
from vlite.cli.main import app
sys.argv = ['vlite'] + sys.argv[1:]
app()" bench throughput $W1 | grep Throughput)
  done
done
uptime
