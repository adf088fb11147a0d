"""Where the time goes: py-spy samples of a vlite run, grouped into the parts of a step.

Two sub-commands:
  run       run a workload through vlite (W1 by default) -- the process py-spy samples
  classify  turn py-spy's raw (collapsed) stacks into a breakdown table

The whole thing, as docs/benchmarks.md runs it:

    .venv/bin/py-spy record --rate 100 --format raw --output /tmp/w1.spy -- \\
        .venv/bin/python benchmarks/throughput/profile_w1.py run
    .venv/bin/python benchmarks/throughput/profile_w1.py classify /tmp/w1.spy

Each sample is attributed to the innermost frame that lies in vlite's own code, and that
frame's source line decides the category (so a ``F.linear`` reached from ``LlamaForCausalLM``
counts as a matmul and the ``index_select`` line in ``torch_ref`` as the attention gather).
Samples before the timed generation starts (imports, model loading) are dropped by keeping
only stacks that pass through ``LLMEngine.generate``. ``run`` sets ``VLITE_CPU_LAYER_LOOP=python``:
the C++ layer loop would put every layer's kernels behind one Python line.
"""

from __future__ import annotations

import argparse
import linecache
import os
import re
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]+):(?P<line>\d+)\)$")

# (category, test on (function, file, source line)); first match wins, checked innermost frame first
RULES = [
    ("attention: decode (C++ kernel)", lambda f, p, s: "cpu_attention" in p),
    ("elementwise: norm, rotary + KV store, SiLU, residual", lambda f, p, s: "fused_ops" in p),
    ("attention: gather K/V from blocks", lambda f, p, s: "torch_ref" in p and ("index_select" in s or "gather_kv" in s
                                                                               or "cache[" in s)),
    ("attention: SDPA (decode)", lambda f, p, s: "torch_ref" in p and "scaled_dot_product" in s and f.endswith("_decode_group")),
    ("attention: SDPA (prefill)", lambda f, p, s: "torch_ref" in p and f.endswith("_attend")),
    ("attention: KV store", lambda f, p, s: "torch_ref" in p and f.endswith("store_kvcache")),
    ("attention: other (masks, grouping)", lambda f, p, s: "torch_ref" in p or "kernels/attention" in p),
    ("matmul: lm_head", lambda f, p, s: "llama" in p and f.endswith("compute_logits")),
    ("matmul: linear layers", lambda f, p, s: "llama" in p and re.search(r"_proj\(", s) is not None),
    ("elementwise: norm, rotary, SiLU, residual", lambda f, p, s: "llama" in p),
    ("sampling", lambda f, p, s: "sampler" in p),
    ("prepare (pack the step)", lambda f, p, s: "model_runner" in p),
    ("scheduling + block manager", lambda f, p, s: "scheduler" in p or "kv_cache_manager" in p or "block_pool" in p),
    ("engine bookkeeping (detokenize, outputs, stop checks)", lambda f, p, s: "vlite/engine" in p),
]


def classify(path: str) -> list[tuple[str, int]]:
    counts: Counter[str] = Counter()
    for raw in Path(path).read_text().splitlines():
        stack, _, n = raw.rpartition(" ")
        if not stack or "generate (" not in stack or "llm_engine" not in stack:
            continue
        frames = [FRAME.match(fr.strip()) for fr in stack.split(";")]
        category = "other (Python, torch dispatch outside vlite)"
        for m in reversed([m for m in frames if m]):
            func, file, line = m["func"], m["file"], int(m["line"])
            if "vlite/" not in file or "vlite/bench" in file:
                continue
            if "models/linear" in file:  # the GEMM itself; the calling frame says which layer
                outer = [m for m in frames if m and "models/llama" in m["file"]]
                lm_head = any(m["func"].endswith("compute_logits") for m in outer)
                category = "matmul: lm_head" if lm_head else "matmul: linear layers"
                break
            src = linecache.getline(file, line) if Path(file).exists() else ""
            hit = next((name for name, rule in RULES if rule(func, file, src)), None)
            if hit:
                category = hit
                break
        counts[category] += int(n)
    return counts.most_common()


def run(num_prompts: int, dtype: str) -> None:
    from vlite.bench.datasets import random_requests
    from vlite.bench.runners import run_vlite
    from vlite.engine.config import EngineConfig
    from vlite.engine.llm_engine import LLMEngine

    os.environ["VLITE_CPU_LAYER_LOOP"] = "python"  # one Python line per kernel (module docstring)
    engine = LLMEngine(EngineConfig(dtype=dtype))
    reqs = random_requests(engine.tokenizer, num_prompts, (32, 256), (16, 256), seed=0)
    res = run_vlite(engine, reqs, show_progress=False)
    s = res.summary(reqs)
    print(f"{num_prompts} requests, {dtype}: {s['output_tokens_per_second']:.2f} output tok/s "
          f"({s['elapsed_time']:.1f} s, under the profiler)", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--num-prompts", type=int, default=64)
    r.add_argument("--dtype", default="float32")
    c = sub.add_parser("classify")
    c.add_argument("path")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.num_prompts, args.dtype)
        return
    rows = classify(args.path)
    total = sum(n for _, n in rows) or 1
    print("| part of the step | share of samples |\n|---|---:|")
    for name, n in rows:
        print(f"| {name} | {n / total * 100:.1f}% |")
    print(f"\n{total} samples inside LLMEngine.generate")


if __name__ == "__main__":
    main()
