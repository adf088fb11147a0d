"""The C++ decode attention kernel with its KV cache in DRAM or in L2 (docs/kernels.md, the
software prefetch; docs/benchmarks.md, "Runs of 2026-12-02 07:21-10:20, on an AMD Zen 4" and "Runs of 2026-12-02 12:36-15:30, on an AMD Zen 5").

A 64-sequence decode step of SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, block size
16, 210 cached tokens each) over 30 layers' caches (about 620 MB in float32, so every call reads
from DRAM), block tables a random permutation of the blocks (``--blocks shared``: every sequence
on the same 14 blocks, which then sit in L2: the kernel's work without the memory). Prints each
round's best of three 30-layer sweeps in ms per layer, and the median of the rounds.

    .venv/bin/python benchmarks/kernels/attention_dram.py [--dtype float32] [--blocks random|sequential|shared] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlite.kernels import cpu_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--blocks", default="random", choices=["random", "sequential", "shared"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if cpu_attention.load() is None:
        raise SystemExit("the C++ CPU attention kernel could not be built here")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    n, hq, hkv, dim, bs, ctx, layers = 64, 9, 3, 64, 16, 210, 30
    blocks_per_seq = (ctx + bs - 1) // bs
    num_blocks = n * blocks_per_seq
    caches = [(torch.randn(num_blocks, bs, hkv, dim, dtype=dtype), torch.randn(num_blocks, bs, hkv, dim, dtype=dtype))
              for _ in range(layers)]
    if args.blocks == "shared":
        tables = torch.arange(blocks_per_seq).repeat(n, 1)
    else:
        order = torch.randperm(num_blocks) if args.blocks == "random" else torch.arange(num_blocks)
        tables = order.view(n, blocks_per_seq)
    tables = tables.contiguous().long()
    lens = torch.full((n,), ctx, dtype=torch.long)
    q = torch.randn(n, hq, dim, dtype=dtype)

    def sweep() -> None:
        for k, v in caches:
            cpu_attention.paged_decode(q, k, v, tables, lens, dim ** -0.5)

    rounds = []
    for _ in range(args.rounds):
        sweep()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            sweep()
            best = min(best, time.perf_counter() - start)
        rounds.append(best / layers * 1e3)
    print(f"{args.dtype}, {args.blocks} blocks: " + " ".join(f"{r:.2f}" for r in rounds)
          + f" ms/layer; median {statistics.median(rounds):.2f}")


if __name__ == "__main__":
    main()
