#!/usr/bin/env bash
# One serving measurement of `vlite serve` with vLLM's own `bench serve` client (the serving workload
# of benchmarks/vs_vllm/vs_vllm.sh: random 144 in / 72 out, range 0.5, 32 prompts at 2 req/s, EOS ignored,
# float32), printing mean TTFT, mean TPOT and median ITL on one line. For quick A/Bs of environment
# variables or serve flags; vs_vllm.sh is the full comparison.
#   bash benchmarks/serving/serve_once.sh ["ENV=VALUE ..."] [extra vlite serve flags]
# e.g. bash benchmarks/serving/serve_once.sh "OMP_WAIT_POLICY=PASSIVE"; needs .venv-vllm (vs_vllm.sh installs it).
set -uo pipefail
cd "$(dirname "$0")/../.."
ENVS=${1:-X_UNUSED=1}; shift || true
PORT=${PORT:-8871}
MODEL_DIR=$(.venv/bin/python -c 'from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)')
# shellcheck disable=SC2086
env $ENVS setsid .venv/bin/vlite serve --model "$MODEL_DIR" --served-model-name smollm2 --host 127.0.0.1 \
  --port "$PORT" --dtype float32 "$@" > /tmp/vlite_serve_once.log 2>&1 &
SP=$!
trap 'kill -TERM -- -"$(ps -o pgid= $SP | tr -d " ")" 2>/dev/null; sleep 3; kill -KILL -- -"$(ps -o pgid= $SP | tr -d " ")" 2>/dev/null' EXIT
for _ in $(seq 1 120); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
.venv-vllm/bin/python benchmarks/vs_vllm/vllm_bench_serve.py --backend openai --base-url "http://127.0.0.1:$PORT" \
  --endpoint /v1/completions --model "$MODEL_DIR" --served-model-name smollm2 --tokenizer "$MODEL_DIR" \
  --dataset-name random --random-input-len 144 --random-output-len 72 --random-range-ratio 0.5 \
  --num-prompts 32 --request-rate 2 --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl \
  --metric-percentiles 50 2>&1 | grep -E "Mean TTFT|Mean TPOT|Median ITL" | tr -s ' ' | tr '\n' ' '
echo "[$ENVS $*]"
