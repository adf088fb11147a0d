#!/usr/bin/env bash
# What the vlite probe costs a serving vLLM: W1 through `vlite bench serve` against vLLM's CPU build
# (.venv-vllm, with probe/ installed) started without and with VLITE_PROBE=1, alternating, ROUNDS
# times each (default 2), the same model and flags. Also reads how many probe passes ran while the
# benchmark was running (the probe walks only at idle points: expected 0). Results in probe-cost/.
# Usage: bash benchmarks/probe/probe_cost.sh   (after make interop-probe has built .venv-vllm)
set -uo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
PORT=${PROBE_COST_PORT:-8813}
OUT=${PROBE_COST_OUT:-probe-cost}
ROUNDS=${ROUNDS:-2}
MODEL_DIR=$(.venv/bin/python -c 'from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL).path)')
"$VENV/bin/python" -c 'import vllm, vlite_probe' || { echo "probe-cost: run make interop-probe first (needs $VENV with vLLM and the probe)"; exit 2; }
rm -rf "$OUT" && mkdir -p "$OUT"
PGID=
stop_vllm() { [ -n "${PGID:-}" ] || return; kill -TERM -- "-$PGID" 2>/dev/null
  for _ in $(seq 1 30); do pgrep -g "$PGID" >/dev/null || break; sleep 1; done; kill -KILL -- "-$PGID" 2>/dev/null; PGID=; }
trap stop_vllm EXIT
passes() { curl -s "127.0.0.1:$PORT/metrics" | awk '/^vlite_probe:passes_total/ {s += $2} END {print s + 0}'; }
for round in $(seq 1 "$ROUNDS"); do
  for mode in off on; do
    name="$mode-$round"
    probe=$([ "$mode" = on ] && echo 1 || echo 0)
    VLITE_PROBE=$probe VLITE_PROBE_DIR="$PWD/$OUT/$name-probe" VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 \
      setsid "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --host 127.0.0.1 \
      --port "$PORT" --max-model-len 2048 --dtype float32 > "$OUT/$name-vllm.log" 2>&1 &
    PGID=$(ps -o pgid= "$!" | tr -d ' ')
    until curl -sf "127.0.0.1:$PORT/health" >/dev/null; do sleep 2; done
    sleep 10  # the probe's start-up passes (with VLITE_PROBE=1) happen before the benchmark
    before=$(passes)
    .venv/bin/vlite bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 64 --input-len-range 32:256 \
      --output-len-range 16:256 --seed 0 --no-progress --save-result --result-dir "$OUT" \
      --result-filename "$name.json" > "$OUT/$name-bench.out" 2>&1
    after=$(passes)
    echo "probe-cost: $name: $(grep -E 'Output token throughput|Mean TPOT' "$OUT/$name-bench.out" | tr -s ' ' | tr '\n' ';') probe passes during the benchmark: $((after - before))"
    stop_vllm
  done
done
