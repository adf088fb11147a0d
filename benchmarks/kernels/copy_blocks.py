"""Copy-on-write's block copy over SmolLM2-135M's 30 layers: the old scattered assignment
(``k_cache[dst] = k_cache[src]``, i.e. ``index_put_``) against ``copy_kv_blocks``
(``index_select`` + ``index_copy_``), with a 64 x 576 x 1536 matmul for scale. Prints the median
and max of ``R`` repeats (default 20) per variant. Set the thread count with ``T`` and the OpenMP
wait policy in the environment (it must be set before torch loads):

    GOMP_SPINCOUNT=300000 .venv/bin/python benchmarks/kernels/copy_blocks.py   # libgomp's default
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/kernels/copy_blocks.py
    T=1 .venv/bin/python benchmarks/kernels/copy_blocks.py

Figures: docs/benchmarks.md, "Beside other work".
"""

from __future__ import annotations

import os
import time

import torch

from vlite.engine.worker.model_runner import copy_kv_blocks

torch.set_num_threads(int(os.environ.get("T", torch.get_num_threads())))
SHAPE = (1456, 16, 3, 64)  # the default 1 GiB CPU KV cache of SmolLM2-135M: blocks, block size, KV heads, head dim
CACHES = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(30)]
SRC, DST = torch.tensor([3]), torch.tensor([7])


def scattered() -> None:
    for k, v in CACHES:
        k[DST] = k[SRC]
        v[DST] = v[SRC]


def indexed() -> None:
    copy_kv_blocks(CACHES, SRC, DST)


def matmul() -> None:
    a, b = torch.randn(64, 576), torch.randn(576, 1536)
    for _ in range(30):
        a @ b


def main() -> None:
    repeats = int(os.environ.get("R", 20))
    for fn in (scattered, indexed, matmul):
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        times.sort()
        print(f"{fn.__name__}: median {times[len(times) // 2] * 1e3:.2f} ms, max {times[-1] * 1e3:.2f} ms")
    print(f"torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
