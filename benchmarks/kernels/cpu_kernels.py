"""Micro-benchmarks behind the CPU-path choices in docs/benchmarks.md and docs/kernels.md.

1. Linear layers (SmolLM2's shapes, float32): torch's F.linear (MKL sgemm) against vlite's
   Linear on a oneDNN-prepacked weight, at 64 rows (a decode step); and the largest error of
   each against float64 on a 64 x 576 x 3072 product.
2. Prefill attention (float32, SmolLM2's 9 query / 3 KV heads): SDPA with ``enable_gqa``
   (``torch_ref._attend_gqa_math``, the math path on CPU) against the stride-0 broadcast
   (``torch_ref._attend``, SDPA's flash path) and the C++ decode kernel taking the chunk row
   by row (each token over its causal prefix, read from 16-token blocks; what the engine does
   up to ``torch_ref.KERNEL_PREFILL_MAX_CONTEXT`` tokens), for one chunk of L tokens with
   nothing cached before it.
3. Decode attention (float32, 64 rows, contexts 200-400 tokens, 16-token blocks): the torch
   path (gather + SDPA, ``torch_ref._decode_attention``) against the C++ kernel, which is also
   timed in bfloat16 and on the first 5 rows (a serving-sized batch). Those caches fit in the
   L3 cache; in an engine step each of the 30 layers reads its own, from DRAM, so the kernel is
   also timed over 30 layers' caches (per layer, float32 and bfloat16; with the K/V bytes read
   per second).

4. Greedy sampling's argmax over 64 rows of SmolLM2's 49,152 float32 logits: torch's
   ``argmax(-1)`` against the C++ ``argmax_rows`` (``cpu_sampling``).
5. SiLU-and-mul over 64 rows of SmolLM2's 2 x 1536 (float32 and bfloat16): the torch ops
   (``fused_ops.TorchOps``) against the C++ op (``fused_ops.CppOps``).

Each timing is the best of ``--repeats`` runs of ``--iters`` calls (milliseconds per call).

    .venv/bin/python benchmarks/kernels/cpu_kernels.py [--repeats 5] [--iters 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch
import torch.nn.functional as F


def best_ms(fn, repeats: int, iters: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e3


def linear_layers(repeats: int, iters: int) -> dict:
    from vlite.engine.worker.models.linear import Linear

    shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
              "lm_head": (576, 49152)}
    out = {}
    for name, (k, n) in shapes.items():
        x = torch.randn(64, k)
        plain = Linear(k, n, bias=False)
        packed = Linear(k, n, bias=False)
        packed.load_state_dict(plain.state_dict())
        packed.prepack_onednn()
        out[name] = {"f_linear_ms": best_ms(partial(plain, x), repeats, iters),
                     "onednn_ms": best_ms(partial(packed, x), repeats, iters)}
    x, layer = torch.randn(64, 576), Linear(576, 3072, bias=False)
    exact = F.linear(x.double(), layer.weight.double())
    out["max_abs_error_vs_float64"] = {"f_linear": (layer(x).double() - exact).abs().max().item()}
    layer.prepack_onednn()
    out["max_abs_error_vs_float64"]["onednn"] = (layer(x).double() - exact).abs().max().item()
    return out


def prefill_attention(repeats: int, iters: int) -> dict:
    from vlite.kernels import cpu_attention, torch_ref

    out = {}
    g = torch.Generator().manual_seed(0)
    for length in (144, 256, 1024, 2048):
        q, k, v = torch.randn(length, 9, 64), torch.randn(length, 3, 64), torch.randn(length, 3, 64)
        scale = 64 ** -0.5
        out[length] = {
            "enable_gqa_ms": best_ms(partial(torch_ref._attend_gqa_math, q, k, v, 0, scale), repeats, iters),
            "broadcast_ms": best_ms(partial(torch_ref._attend, q, k, v, 0, scale), repeats, iters),
        }
        if cpu_attention.load() is not None:
            num_blocks = -(-length // 16)
            table = torch.randperm(4 * num_blocks, generator=g)[:num_blocks]  # scattered blocks
            k_cache, v_cache = torch.zeros(4 * num_blocks, 16, 3, 64), torch.zeros(4 * num_blocks, 16, 3, 64)
            k_cache[table] = torch.cat([k, k.new_zeros(num_blocks * 16 - length, 3, 64)]).view(num_blocks, 16, 3, 64)
            v_cache[table] = torch.cat([v, v.new_zeros(num_blocks * 16 - length, 3, 64)]).view(num_blocks, 16, 3, 64)
            tables = table[None].expand(length, num_blocks).contiguous()
            lens = torch.arange(1, length + 1)
            out[length]["kernel_rows_ms"] = best_ms(
                partial(cpu_attention.paged_decode, q, k_cache, v_cache, tables, lens, scale), repeats, iters)
    return out


def decode_attention(repeats: int, iters: int) -> dict:
    from vlite.kernels import cpu_attention, torch_ref
    from vlite.kernels.attention import AttentionMetadata

    g = torch.Generator().manual_seed(0)
    n, block_size, num_blocks = 64, 16, 4096
    lens = torch.randint(200, 400, (n,), generator=g).tolist()
    max_blocks = -(-max(lens) // block_size)
    tables = torch.randperm(num_blocks, generator=g)[:n * max_blocks].view(n, max_blocks)
    k_cache = torch.randn(num_blocks, block_size, 3, 64, generator=g)
    v_cache = torch.randn(num_blocks, block_size, 3, 64, generator=g)
    q = torch.randn(n, 9, 64, generator=g)
    meta = AttentionMetadata(torch.zeros(n, dtype=torch.long), torch.arange(n + 1), torch.tensor(lens), tables, n,
                             [1] * n, lens, block_size)
    scale = 64 ** -0.5
    out = {"torch_gather_sdpa_ms": best_ms(lambda: torch_ref._decode_attention(q, k_cache, v_cache, meta, scale),
                                           repeats, iters)}
    if cpu_attention.load() is not None:
        def kernel(q, k, v, rows=n):
            return best_ms(lambda: cpu_attention.paged_decode(q[:rows], k, v, tables[:rows], meta.seq_lens[:rows],
                                                              scale), repeats, iters)
        out["cpp_kernel_ms"] = kernel(q, k_cache, v_cache)
        out["cpp_kernel_bf16_ms"] = kernel(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())
        out["cpp_kernel_5_rows_ms"] = kernel(q, k_cache, v_cache, rows=5)
        # 30 layers, each with its own caches (about 850 MB in all): read from DRAM, as in a step
        used = n * max_blocks
        layers = [(torch.randn(used, block_size, 3, 64, generator=g), torch.randn(used, block_size, 3, 64, generator=g))
                  for _ in range(30)]
        dense = torch.randperm(used, generator=g).view(n, max_blocks)
        seq_lens = meta.seq_lens

        def dram(query, caches):
            def sweep():
                for k, v in caches:
                    cpu_attention.paged_decode(query, k, v, dense, seq_lens, scale)
            per_layer = best_ms(sweep, repeats, max(1, iters // 10)) / 30
            return per_layer, sum(lens) * 3 * 64 * query.element_size() * 2 / (per_layer / 1e3) / 1e9
        out["cpp_kernel_dram_ms_per_layer"], out["cpp_kernel_dram_gb_per_s"] = dram(q, layers)
        layers = [(k.bfloat16(), v.bfloat16()) for k, v in layers]
        out["cpp_kernel_dram_bf16_ms_per_layer"], out["cpp_kernel_dram_bf16_gb_per_s"] = dram(q.bfloat16(), layers)
    return out


def sampling_and_silu(repeats: int, iters: int) -> dict:
    from vlite.kernels import cpu_extension, fused_ops

    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(0))
    out = {"torch_argmax_ms": best_ms(lambda: logits.argmax(-1), repeats, iters)}
    module = cpu_extension.load()
    if module is not None and hasattr(module, "argmax_rows"):  # an older checkout on PYTHONPATH may lack it
        out["cpp_argmax_ms"] = best_ms(lambda: module.argmax_rows(logits), repeats, iters)
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = torch.randn(64, 2 * 1536).to(dtype)
        name = str(dtype).removeprefix("torch.")
        out[f"torch_silu_and_mul_{name}_ms"] = best_ms(lambda g=gate_up: fused_ops.TorchOps.silu_and_mul(g), repeats,
                                                       iters)
        if module is not None:
            cpp = fused_ops.CppOps(module)
            out[f"cpp_silu_and_mul_{name}_ms"] = best_ms(lambda c=cpp, g=gate_up: c.silu_and_mul(g), repeats, iters)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with torch.inference_mode():
        result = {"torch_threads": torch.get_num_threads(),
                  "linear_64_rows": linear_layers(args.repeats, args.iters),
                  "prefill_attention": prefill_attention(args.repeats, args.iters),
                  "decode_attention_64_rows": decode_attention(args.repeats, args.iters),
                  "sampling_and_silu_64_rows": sampling_and_silu(args.repeats, args.iters)}
    for name, r in result["linear_64_rows"].items():
        if name == "max_abs_error_vs_float64":
            print(f"64 x 576 x 3072 max |error| vs float64: F.linear {r['f_linear']:.2e}, oneDNN {r['onednn']:.2e}")
        else:
            print(f"linear {name:8s} 64 rows: F.linear {r['f_linear_ms']:7.3f} ms, oneDNN {r['onednn_ms']:7.3f} ms "
                  f"({r['f_linear_ms'] / r['onednn_ms']:.1f}x)")
    for length, r in result["prefill_attention"].items():
        print(f"prefill attention, {length} tokens: enable_gqa {r['enable_gqa_ms']:.2f} ms, "
              f"broadcast (flash) {r['broadcast_ms']:.2f} ms, C++ kernel row by row "
              f"{r.get('kernel_rows_ms', float('nan')):.2f} ms")
    r = result["decode_attention_64_rows"]
    print(f"decode attention, 64 rows x 200-400 tokens: torch gather + SDPA {r['torch_gather_sdpa_ms']:.2f} ms, "
          f"C++ kernel {r.get('cpp_kernel_ms', float('nan')):.2f} ms (bfloat16 "
          f"{r.get('cpp_kernel_bf16_ms', float('nan')):.2f} ms; first 5 rows {r.get('cpp_kernel_5_rows_ms', float('nan')):.3f} ms)")
    print(f"decode attention, 64 rows, 30 layers' caches (DRAM): C++ kernel "
          f"{r.get('cpp_kernel_dram_ms_per_layer', float('nan')):.2f} ms per layer, "
          f"{r.get('cpp_kernel_dram_gb_per_s', float('nan')):.1f} GB/s of K/V; bfloat16 "
          f"{r.get('cpp_kernel_dram_bf16_ms_per_layer', float('nan')):.2f} ms, "
          f"{r.get('cpp_kernel_dram_bf16_gb_per_s', float('nan')):.1f} GB/s)")
    r = result["sampling_and_silu_64_rows"]
    nan = float("nan")
    print(f"greedy argmax, 64 x 49152: torch {r['torch_argmax_ms']:.3f} ms, C++ {r.get('cpp_argmax_ms', nan):.3f} ms")
    for name in ("float32", "bfloat16"):
        print(f"SiLU-and-mul {name}, 64 x 1536: torch ops {r[f'torch_silu_and_mul_{name}_ms']:.3f} ms, C++ "
              f"{r.get(f'cpp_silu_and_mul_{name}_ms', nan):.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
