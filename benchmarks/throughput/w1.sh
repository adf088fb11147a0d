#!/usr/bin/env bash
# Reproduce every number in docs/benchmarks.md (CPU, SmolLM2-135M). Run from the repository root
# on a quiet machine (check `uptime` first); takes about 15 minutes on 2 idle cores.
#   bash benchmarks/throughput/w1.sh [results-dir]
set -euo pipefail
OUT=${1:-benchmarks/results}
mkdir -p "$OUT"
V=.venv/bin/vlite
PY=.venv/bin/python
W1="--num-prompts 64 --input-len-range 32:256 --output-len-range 16:256 --seed 0"

uptime | tee "$OUT/uptime-start.txt"
# 1. vlite float32 vs transformers (static batch, continuous batching), one process
$V bench throughput $W1 --backend hf --no-progress --output-json "$OUT/w1_fp32_hf.json" | tee "$OUT/w1_fp32_hf.txt"
# 1b. vlite float32 with torch's F.linear (MKL sgemm) instead of oneDNN: what the GEMM choice is worth
VLITE_CPU_GEMM=torch $V bench throughput $W1 --no-progress --output-json "$OUT/w1_fp32_torch_gemm.json" \
    | tee "$OUT/w1_fp32_torch_gemm.txt"
# 1c. vlite float32 without the C++ decode kernel (gather + SDPA in torch)
VLITE_ATTENTION_BACKEND=torch $V bench throughput $W1 --no-progress --output-json "$OUT/w1_fp32_torch_attention.json" \
    | tee "$OUT/w1_fp32_torch_attention.txt"
# 2. vlite bfloat16, and without the C++ decode kernel (bf16 decodes through gather + SDPA)
$V bench throughput $W1 --dtype bfloat16 --no-progress --output-json "$OUT/w1_bf16.json" | tee "$OUT/w1_bf16.txt"
VLITE_ATTENTION_BACKEND=torch $V bench throughput $W1 --dtype bfloat16 --no-progress \
    --output-json "$OUT/w1_bf16_torch_attention.json" | tee "$OUT/w1_bf16_torch_attention.txt"
# 3. the float32 bound (FLOPs / measured matmul rate); bf16 rate for reference
$PY benchmarks/throughput/fp32_bound.py --json "$OUT/fp32_bound.json" | tee "$OUT/fp32_bound.txt"
$PY benchmarks/throughput/fp32_bound.py --dtype bfloat16 --json "$OUT/bf16_bound.json" | tee "$OUT/bf16_bound.txt"
# 4. bf16 vs fp32 greedy agreement
$PY benchmarks/quality/bf16_agreement.py --json "$OUT/bf16_agreement.json" | tee "$OUT/bf16_agreement.txt"
# 4b. micro-benchmarks of the CPU path's pieces (GEMM, prefill and decode attention)
$PY benchmarks/kernels/cpu_kernels.py --json "$OUT/cpu_kernels.json" | tee "$OUT/cpu_kernels.txt"
# 5. the allocation ledger's cost
$PY benchmarks/leak_check/ledger_overhead.py --num-prompts 32 --output-len-range 16:128 --repeats 3 \
    --json "$OUT/ledger_overhead.json" | tee "$OUT/ledger_overhead.txt"
# 6. where the time goes
.venv/bin/py-spy record --rate 100 --format raw --output "$OUT/w1.spy" -- $PY benchmarks/throughput/profile_w1.py run
$PY benchmarks/throughput/profile_w1.py classify "$OUT/w1.spy" | tee "$OUT/profile.md"
# 7. serving (starts and stops `vlite serve` itself)
$V bench serve --num-prompts 32 --input-len-range 32:256 --output-len-range 16:128 --request-rate 2 --seed 0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --no-progress | tee "$OUT/serve.txt"
uptime | tee "$OUT/uptime-end.txt"
