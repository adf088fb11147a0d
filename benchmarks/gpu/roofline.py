"""The memory roofline of an offline throughput run, from the bytes and FLOPs it counts
(``vlite.bench.roofline``), and the fraction of it a measured ``vlite bench throughput`` reached.

The rates come from this machine when ``--measure`` is given (CUDA: a 1 GiB device-to-device
copy, read + write bytes over its median time, and a 8192^3 bfloat16 matmul's FLOP/s, both
``triton.testing.do_bench`` medians), else from ``--bandwidth-gbs`` and ``--tflops``.

Usage (the GPU check's workload on the 1.07B Llama-3.2-1B shape):
  python benchmarks/gpu/roofline.py --measure --throughput-json vlite.json --json roofline.json
  python benchmarks/gpu/roofline.py --bandwidth-gbs 4251 --tflops 790      # the issue's H200 figures
  python benchmarks/gpu/roofline.py --config path/to/model                 # another model's config.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vlite.bench.roofline import LLAMA_3_2_1B, ModelShape, roofline


def _median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _copy_bandwidth(n: int = 1 << 30) -> float:
    """Bytes/s of an n-byte device-to-device copy (read + write counted)."""
    import torch

    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * n / (_median_ms(lambda: dst.copy_(src)) * 1e-3)


def _matmul_flops(m: int = 8192) -> float:
    """FLOP/s of an m x m x m bfloat16 matmul."""
    import torch

    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * m ** 3 / (_median_ms(lambda: a @ b) * 1e-3)


def measure_rates() -> tuple[float, float]:
    """(copy bandwidth bytes/s, bf16 matmul FLOP/s) measured on the current CUDA device."""
    import torch

    if not torch.cuda.is_available():
        sys.exit("roofline.py --measure needs a CUDA device (or give --bandwidth-gbs and --tflops)")
    bandwidth = _copy_bandwidth()
    torch.cuda.empty_cache()
    return bandwidth, _matmul_flops()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a model directory (config.json); default: the Llama-3.2-1B shape")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--measure", action="store_true", help="measure bandwidth and matmul FLOP/s here (CUDA)")
    parser.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth, GB/s (1e9 bytes)")
    parser.add_argument("--tflops", type=float, help="matrix throughput, TFLOP/s")
    parser.add_argument("--throughput-json", help="`vlite bench throughput --output-json` of the same workload")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    if args.config:
        from transformers import AutoConfig

        shape = ModelShape.from_config(AutoConfig.from_pretrained(args.config), args.dtype)
    elif args.dtype != "bfloat16":
        parser.error("the built-in Llama-3.2-1B shape is bfloat16; give --config for another dtype")
    else:
        shape = LLAMA_3_2_1B
    if args.measure:
        bandwidth, flops = measure_rates()
    elif args.bandwidth_gbs and args.tflops:
        bandwidth, flops = args.bandwidth_gbs * 1e9, args.tflops * 1e12
    else:
        parser.error("give --measure, or both --bandwidth-gbs and --tflops")
    bound = roofline(shape, args.num_prompts, args.input_len, args.output_len, args.max_num_seqs, bandwidth, flops)
    print(f"model: {shape.num_params() / 1e9:.3f}B parameters, {shape.weight_bytes() / 1e9:.3f} GB of weights, "
          f"{shape.kv_bytes_per_token()} bytes of KV per cached token")
    print(f"workload: {args.num_prompts} x ({args.input_len} in, {args.output_len} out), "
          f"max {args.max_num_seqs} sequences at a time")
    print(f"rates: {bandwidth / 1e9:.0f} GB/s memory, {flops / 1e12:.0f} TFLOP/s matrix"
          f"{' (measured here)' if args.measure else ' (given)'}")
    print(f"decode: {bound.decode_bytes / 1e9:.1f} GB read -> {bound.decode_s * 1e3:.1f} ms; "
          f"prefill: {bound.prefill_flops / 1e12:.1f} TFLOP -> {bound.prefill_s * 1e3:.1f} ms")
    print(f"roofline: {bound.output_tokens_per_s:,.0f} output tokens/s")
    result = {"shape": shape.__dict__, "workload": vars(args), "roofline": bound.as_dict()}
    if args.throughput_json:
        measured = json.loads(Path(args.throughput_json).read_text())["output_tokens_per_second"]
        frac = bound.fraction(measured)
        print(f"measured: {measured:,.0f} output tokens/s = {100 * frac:.1f}% of the roofline")
        result.update(measured_output_tokens_per_s=measured, fraction=frac)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
