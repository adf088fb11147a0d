"""Where a W1 run's wall time goes, measured with timers around the step's parts.

py-spy (``profile_w1.py``) samples stacks and costs 20-25% of the run; this script instead wraps
the functions a step calls (the GEMMs by row count, the attention kernel, the fused ops, the
lm_head, sampling, the step's packing) with ``time.perf_counter`` and prints the seconds each
took over one W1 run. It runs the layers in the Python loop (``VLITE_CPU_LAYER_LOOP=python``):
the C++ layer loop calls the kernels from C++, where these timers cannot see them, and saves
the Python between them (about 0.1 ms a layer), which here is "model forward" less its parts.
The wrappers cost about 1 us per call (about 0.1 s over W1). Parts nest: "model forward" holds
the layers, a layer holds its GEMMs, attention and fused ops.

    .venv/bin/python benchmarks/throughput/w1_breakdown.py [--dtype float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

from vlite.engine import llm_engine
from vlite.engine.worker import model_runner
from vlite.engine.worker.models import linear, llama
from vlite.engine.worker.models.parallel_layers import ParallelLMHead
from vlite.kernels import cpu_attention, fused_ops, torch_ref

seconds: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def timed(owner, name: str, label=None) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``seconds[label]``
    (``label`` a string or a function of the call's arguments)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = inner(*args, **kwargs)
        key = label(args) if callable(label) else (label or name)
        seconds[key] += time.perf_counter() - start
        calls[key] += 1
        return result

    setattr(owner, name, wrapper)


def gemm_label(args) -> str:
    layer, x = args[0], args[1]
    rows = x.shape[0]
    size = "1-8" if rows <= 8 else "9-32" if rows <= 32 else "33-64" if rows <= 64 else "65+"
    head = "lm_head" if isinstance(layer, ParallelLMHead) else "layers"
    return f"GEMM {head}, {size} rows"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ["VLITE_CPU_LAYER_LOOP"] = "python"  # the timers wrap the Python loop's calls (module docstring)

    timed(linear.Linear, "forward", gemm_label)
    timed(cpu_attention, "paged_decode", "attention: C++ kernel (decode and short prefill rows)")
    timed(torch_ref, "_attend", "attention: SDPA (long prefill chunks)")
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_store"):
        timed(fused_ops.CppOps, op, f"fused op {op}")
    timed(llama.LlamaForCausalLM, "forward", "model forward (all layers)")
    timed(llama.LlamaForCausalLM, "compute_logits", "lm_head + logits")
    timed(model_runner, "prepare_input", "pack the step (prepare_input)")
    timed(model_runner.ModelRunner, "build_metadata", "step tensors (build_metadata)")
    timed(model_runner, "sample_step", "sampling")
    timed(llm_engine.LLMEngine, "step", "engine step (everything)")

    from vlite.bench.datasets import random_requests
    from vlite.bench.runners import run_vlite
    from vlite.engine.config import EngineConfig

    engine = llm_engine.LLMEngine(EngineConfig(dtype=args.dtype))
    reqs = random_requests(engine.tokenizer, args.num_prompts, (32, 256), (16, 256), seed=0)
    seconds.clear()
    calls.clear()
    summary = run_vlite(engine, reqs, show_progress=False).summary(reqs)
    print(f"W1 {args.dtype}: {summary['output_tokens_per_second']:.1f} output tok/s, "
          f"{summary['elapsed_time']:.2f} s (with the timers)")
    print("| part | seconds | calls | share of the steps |\n|---|---:|---:|---:|")
    total = seconds["engine step (everything)"] or 1.0
    for key, value in seconds.most_common():
        print(f"| {key} | {value:.2f} | {calls[key]} | {value / total * 100:.1f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "seconds": dict(seconds), "calls": dict(calls)}, f, indent=2)


if __name__ == "__main__":
    main()
