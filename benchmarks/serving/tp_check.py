"""Tensor parallelism on this host: tokens, start-up time, per-rank weight memory and RSS, per
backend. Reproduces the tables in docs/distributed.md.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serving/tp_check.py                 # mp: N = 1, 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serving/tp_check.py --backends mp ray  # needs vlite[ray]

Runs SmolLM2 on the 8 prompts of tests/engine/test_engine_hf_parity.py in one batch (greedy,
float32, 14 blocks and a 48-token budget: preemption and chunked prefill) and exits 1 if any
configuration's tokens differ from N = 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "engine"))


def main() -> int:
    from conftest import make_engine
    from test_engine_hf_parity import SMOL_PROMPTS

    from vlite.engine.sampling_params import SamplingParams
    from vlite.engine.worker.loader import DEFAULT_MODEL, load_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["mp"], choices=["mp", "ray"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[3])
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    ckpt = load_checkpoint(DEFAULT_MODEL)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows, reference, ok = [], None, True
    configs = [("in-process", 1)] + [(b, n) for b in args.backends for n in args.sizes]
    for backend, n in configs:
        t0 = time.monotonic()
        engine = make_engine(ckpt, num_blocks=14, max_num_batched_tokens=48, tensor_parallel_size=n,
                             distributed_executor_backend="mp" if backend == "in-process" else backend)
        start_s = time.monotonic() - t0
        t1 = time.monotonic()
        tokens = [list(o.outputs[0].token_ids) for o in engine.generate(SMOL_PROMPTS, params)]
        gen_s = time.monotonic() - t1
        pids = engine.executor.worker_pids()
        rss = [psutil.Process(p).memory_info().rss for p in pids] or [psutil.Process().memory_info().rss]
        weights = engine.executor.weight_bytes
        engine.shutdown()
        if reference is None:
            reference = tokens
        same = tokens == reference
        ok &= same
        rows.append((backend, n, start_s, gen_s, weights, rss, same))
    print(f"| backend | N | start s | 8 prompts x {args.max_tokens} tokens, s | weights per rank, MiB "
          "| RSS per rank, MiB | tokens = N=1 |")
    print("|---|---:|---:|---:|---|---|---|")
    for backend, n, start_s, gen_s, weights, rss, same in rows:
        print(f"| {backend} | {n} | {start_s:.1f} | {gen_s:.1f} | {', '.join(f'{w / 2**20:.1f}' for w in weights)} | "
              f"{', '.join(f'{r / 2**20:.0f}' for r in rss)} | {'yes' if same else 'NO'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
