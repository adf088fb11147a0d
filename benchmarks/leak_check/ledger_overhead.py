"""The allocation ledger's cost: vlite throughput with ``EngineConfig(enable_ledger=True)`` vs ``False``.

Two engines (ledger on, ledger off) are built in one process on the same checkpoint and run the
same workload alternately, ``--repeats`` times each (on, off, on, off, ...), so slow spells of a
shared machine hit both. Reported: the median output tokens/s of each and the overhead
``1 - median(on) / median(off)``.

Because that difference is small next to the noise of a shared 2-core machine, the ledger's
cost is also measured directly: every public ``KVCacheManager`` method of both engines is wrapped
with a ``perf_counter`` accumulator (the ledger is only reached through the block manager, and
the entries are built there), and the ledger's cost is the block manager's time with the ledger
minus without it, as a share of the ledger-on run's wall time.

    .venv/bin/python benchmarks/leak_check/ledger_overhead.py [--num-prompts 64] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch


def _timed(obj, counters: dict[str, float]) -> None:
    """Wrap every public method of ``obj`` so its wall time adds to ``counters['time']``; nested
    calls between wrapped methods are counted once (only the outermost call adds)."""
    for name in dir(type(obj)):
        if name.startswith("_") or not callable(getattr(obj, name)):
            continue
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def wrapper(*a, _fn=fn, **kw):
            if counters["depth"]:
                return _fn(*a, **kw)
            counters["depth"] += 1
            start = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                counters["time"] += time.perf_counter() - start
                counters["depth"] -= 1

        setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len-range", default="32:256")
    ap.add_argument("--output-len-range", default="16:256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from vlite.bench.datasets import random_requests
    from vlite.bench.runners import run_vlite
    from vlite.engine.config import EngineConfig
    from vlite.engine.llm_engine import LLMEngine
    from vlite.engine.worker.loader import DEFAULT_MODEL, load_checkpoint

    ckpt = load_checkpoint(DEFAULT_MODEL)
    in_r = tuple(int(x) for x in args.input_len_range.split(":"))
    out_r = tuple(int(x) for x in args.output_len_range.split(":"))
    reqs = random_requests(ckpt.tokenizer, args.num_prompts, in_r, out_r, seed=0)
    engines = {flag: LLMEngine(EngineConfig(enable_ledger=flag), checkpoint=ckpt) for flag in (True, False)}
    tps: dict[bool, list[float]] = {True: [], False: []}
    bm_share: dict[bool, list[float]] = {True: [], False: []}
    counters = {flag: {"time": 0.0, "depth": 0} for flag in (True, False)}
    for flag, engine in engines.items():
        _timed(engine.kv_cache_manager, counters[flag])
    for i in range(args.repeats):
        for flag in (True, False):
            counters[flag]["time"] = 0.0
            res = run_vlite(engines[flag], reqs, show_progress=False, warmup=(i == 0))
            bm_share[flag].append(counters[flag]["time"] / res.elapsed_s)
            out_tps = res.summary(reqs)["output_tokens_per_second"]
            tps[flag].append(out_tps)
            print(f"repeat {i}: ledger {'on ' if flag else 'off'} {out_tps:7.2f} output tok/s, "
                  f"{bm_share[flag][-1] * 100:.2f}% of the run inside the block manager")
    on, off = statistics.median(tps[True]), statistics.median(tps[False])
    direct = statistics.median(bm_share[True]) - statistics.median(bm_share[False])
    result = {"workload": vars(args), "torch_threads": torch.get_num_threads(), "on_tok_s": tps[True],
              "off_tok_s": tps[False], "median_on": on, "median_off": off, "overhead": 1 - on / off,
              "block_manager_share_on": bm_share[True], "block_manager_share_off": bm_share[False],
              "ledger_time_share": direct}
    print(f"median: ledger on {on:.2f}, off {off:.2f} output tok/s -> throughput overhead "
          f"{result['overhead'] * 100:+.2f}%; block-manager time with - without ledger: {direct * 100:+.2f}% "
          "of the run")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
