"""One decode step's forward with the decoder layers in one C++ call (``CpuLayerLoop``) and in the
Python loop, alternating, on SmolLM2 (docs/kernels.md, "The decoder layers in one C++ call").

The step: ``--rows`` sequences decoding at ``--context`` tokens each, their blocks a random
permutation of the KV cache (so attention reads from DRAM, as in an engine step). Prints the
minimum, first quartile and median of ``--rounds`` forwards of each, in ms.

    .venv/bin/python benchmarks/throughput/layer_loop.py [--dtype float32] [--rows 64] [--context 210] [--rounds 30]
"""

from __future__ import annotations

import argparse
import time

import torch

from vlite.engine.config import EngineConfig
from vlite.engine.llm_engine import LLMEngine
from vlite.kernels.attention import AttentionMetadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=210)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(dtype=args.dtype))
    model, caches = engine.model, engine.model_runner.kv_caches
    loop = model.cpu_layer_loop
    if loop is None:
        raise SystemExit("no C++ layer loop on this machine (VLITE_CPU_LAYER_LOOP=python, or vlite's packed GEMM "
                         "or the C++ kernels do not run here)")
    n, ctx, bs = args.rows, args.context, engine.model_runner.block_size
    blocks_per_seq = -(-ctx // bs)
    perm = torch.randperm(caches[0][0].shape[0], generator=torch.Generator().manual_seed(0))
    tables = perm[: n * blocks_per_seq].view(n, blocks_per_seq).contiguous()
    layout = dict(slot_mapping=(tables[:, -1] * bs + (ctx - 1) % bs).contiguous(), query_start_loc=torch.arange(n + 1),
                  seq_lens=torch.full((n,), ctx), block_tables=tables, num_decodes=n, query_lens=[1] * n,
                  seq_lens_list=[ctx] * n, block_size=bs)
    input_ids, positions = torch.randint(3, 1000, (n,)), torch.full((n,), ctx - 1)

    def forward(with_loop: bool) -> float:
        model.cpu_layer_loop = loop if with_loop else None
        start = time.perf_counter()
        with torch.inference_mode():
            model(input_ids, positions, caches, AttentionMetadata(**layout))
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {True: [], False: []}
    forward(True), forward(False)  # warm-up
    for _ in range(args.rounds):
        for with_loop in (False, True):
            times[with_loop].append(forward(with_loop) * 1e3)
    model.cpu_layer_loop = loop
    for with_loop in (False, True):
        t = sorted(times[with_loop])
        name = "C++ layer loop" if with_loop else "Python loop   "
        print(f"{args.dtype}, {n} rows at {ctx} tokens, {name}: min {t[0]:.2f} ms, "
              f"p25 {t[len(t) // 4]:.2f}, median {t[len(t) // 2]:.2f}")


if __name__ == "__main__":
    main()
