"""vlite's packed GEMM (``vlite/kernels/cpu_gemm.cpp``) against oneDNN on SmolLM2's linear layers.

One decode step's 120 layer GEMMs (30 layers x qkv 576->960, o 576->576, gate_up 576->3072,
down 1536->576), each with its own weight, so the weights come from DRAM as in an engine step
(212 MB in bfloat16, 424 MB in float32). For each row count: the best of ``--repeats`` sweeps,
in ``--rounds`` rounds alternating the two kernels, and vlite's time over oneDNN's in each round
(the machine's speed drifts by tens of percent over minutes; the per-round ratio is what to read).

    .venv/bin/python benchmarks/kernels/packed_gemm.py [--dtype float32] [--rows 1,8,32,64,256,2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in) of every layer GEMM


def best_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="1,8,32,64,256,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from vlite.kernels import cpu_gemm

    dtype = getattr(torch, args.dtype)
    if not cpu_gemm.available(dtype):
        raise SystemExit(f"vlite's packed GEMM does not run {args.dtype} on this CPU (float32 needs AVX-512, "
                         "bfloat16 AMX-BF16)")
    torch.manual_seed(0)
    plain = [torch.randn(*shape).to(dtype) for shape in SHAPES]
    packed = [cpu_gemm.pack(w) for w in plain]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in plain]
    weight_bytes = sum(w.numel() * w.element_size() for w in plain)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        x = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}

        def sweep_onednn(x=x):
            for (_, k), w in zip(SHAPES, onednn):
                torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")

        def sweep_vlite(x=x):
            for (n, k), w in zip(SHAPES, packed):
                cpu_gemm.linear(x[k], w, None, n)

        times = {"onednn": [], "vlite": []}
        for _ in range(args.rounds):
            times["onednn"].append(best_s(sweep_onednn, args.repeats))
            times["vlite"].append(best_s(sweep_vlite, args.repeats))
        ratios = [v / o for v, o in zip(times["vlite"], times["onednn"])]
        flops = sum(2 * rows * n * k for n, k in SHAPES)
        row = {"rows": rows, "onednn_ms": min(times["onednn"]) * 1e3, "vlite_ms": min(times["vlite"]) * 1e3,
               "vlite_over_onednn_per_round": ratios, "vlite_gflops": flops / min(times["vlite"]) / 1e9,
               "vlite_weight_gb_per_s": weight_bytes / min(times["vlite"]) / 1e9}
        results.append(row)
        print(f"{args.dtype} {rows:5d} rows: oneDNN {row['onednn_ms']:8.2f} ms | vlite {row['vlite_ms']:8.2f} ms "
              f"({row['vlite_gflops']:.0f} GFLOP/s, weights {row['vlite_weight_gb_per_s']:.1f} GB/s) | vlite/oneDNN "
              f"per round {' '.join(f'{r:.2f}' for r in ratios)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "threads": torch.get_num_threads(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
