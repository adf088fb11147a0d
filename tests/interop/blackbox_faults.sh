#!/usr/bin/env bash
# Every planted fault of `vlite serve`, checked as a black box (no debug endpoints: only /metrics and
# process memory) with `vlite leak-check --url ... --blackbox`, and the unfaulted server. Prints one
# line per case: fault, exit code, verdict, suspects. Uses a tiny random model (tests/conftest.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-/tmp/vlite-tiny-model}
OUT=${OUT:-/tmp/vlite-blackbox-faults}
[ -f "$MODEL/config.json" ] || (cd tests && ../.venv/bin/python -c "
from pathlib import Path; from conftest import build_tiny_model_dir; build_tiny_model_dir(Path('$MODEL'))" >/dev/null 2>&1)
mkdir -p "$OUT"
run_case() {  # name, serve args, leak-check args
  local name=$1 serve=$2 check=$3 port
  port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  OMP_NUM_THREADS=1 .venv/bin/vlite serve --model "$MODEL" --host 127.0.0.1 --port "$port" $serve > "$OUT/$name.serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do curl -sf "127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  local start=$(date +%s)
  OMP_NUM_THREADS=1 .venv/bin/vlite leak-check --url "http://127.0.0.1:$port" --blackbox --seed 3 \
    --drain-timeout 30 --bisect-budget 40 --report "$OUT/$name" $check > "$OUT/$name.txt" 2>&1
  local rc=$?
  kill -TERM "$pid"; wait "$pid" 2>/dev/null
  .venv/bin/python - "$OUT/$name/report.json" "$name" "$rc" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
rep = json.load(open(sys.argv[1]))
sus = "; ".join(f"{s['client_action']} {next(v for k, v in s.items() if k.endswith('per_request'))}/req "
                f"minimal {s['request_ids']}" for s in rep["blackbox"]["suspects"])
print(f"{sys.argv[2]:34s} exit {sys.argv[3]} {rep['verdict']:12s} {sys.argv[4]:>4s} s  residual "
      f"{rep['drain']['residual']}  suspects: {sus or '-'}")
PY
}
COMMON="--num-requests 40 --abort-rate 0.5 --input-len 16:48 --output-len 8:16"
run_case none "--num-blocks 128" "$COMMON"
run_case skip-free-on-abort "--num-blocks 128 --inject-fault skip-free-on-abort" "$COMMON"
run_case leak-on-preempt "--num-blocks 16 --inject-fault leak-on-preempt" "--num-requests 24 --abort-rate 0 --input-len 40:60 --output-len 60:90 --max-concurrency 24 --idle-every 8 --drain-timeout 15"
run_case double-free "--num-blocks 128 --inject-fault double-free" "$COMMON"
run_case refcount-not-decremented-on-fork "--num-blocks 128 --inject-fault refcount-not-decremented-on-fork" "$COMMON --n 2"
run_case orphan-block-table "--num-blocks 128 --inject-fault orphan-block-table" "$COMMON"
