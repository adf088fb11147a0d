#!/usr/bin/env bash
# A/B of `vlite serve` with the engine core in its own process (A, --frontend-multiprocessing) against the
# engine loop in the API process (B, the default), interleaved A B A B in one run, each with
# vLLM's `bench serve` client on the serving workload of benchmarks/vs_vllm/vs_vllm.sh (random 144 in / 72 out,
# range ratio 0.5, 32 prompts at 2 req/s, EOS ignored).
#   bash benchmarks/serving/ab_serve_core.sh [OUT] [ROUNDS]     (default benchmarks/results/ab_serve_core-<stamp>, 2)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/results/ab_serve_core-$(date -u +%Y%m%dT%H%M)}
ROUNDS=${2:-2}
mkdir -p "$OUT"
{ date -u; uptime; } | tee "$OUT/uptime-start.txt"
for i in $(seq 1 "$ROUNDS"); do
  ENGINES=vlite VLITE_SERVE_ARGS=--frontend-multiprocessing bash benchmarks/vs_vllm/vs_vllm.sh --only serving \
    --out "$OUT/A$i-engine-process" > "$OUT/A$i.log" 2>&1
  ENGINES=vlite bash benchmarks/vs_vllm/vs_vllm.sh --only serving --out "$OUT/B$i-in-process" > "$OUT/B$i.log" 2>&1
  uptime | tee -a "$OUT/uptime-rounds.txt"
done
{ date -u; uptime; } | tee "$OUT/uptime-end.txt"
.venv/bin/python - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| run | mean TTFT (ms) | mean TPOT (ms) | median ITL (ms) | output tok/s |\n|---|---:|---:|---:|---:|")
for d in sorted(p for p in out.iterdir() if p.is_dir()):
    f = d / "serve_vlite.json"
    if f.exists():
        r = json.loads(f.read_text())
        print(f"| {d.name} | {r['mean_ttft_ms']:.1f} | {r['mean_tpot_ms']:.1f} | {r['median_itl_ms']:.1f} | {r['output_throughput']:.1f} |")
PY
