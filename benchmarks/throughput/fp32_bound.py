"""The float32 throughput bound of workload W1 on this machine: matmul FLOPs / measured matmul rate.

W1: 64 requests, prompt lengths uniform in [32, 256], output lengths uniform in
[16, 256], seed 0, SmolLM2-135M. The workload is rebuilt with vlite's own random dataset, so the
lengths are exactly the ones `vlite bench throughput` runs.

Matmul work: every token that goes through the decoder (prompt + output - 1 per request; the
last output token is never fed back) costs 2 x (parameters of the decoder's linear layers)
FLOPs, and every output token costs one lm_head product, 2 x vocab x hidden. Attention's own
products (q.k and p.v, which grow with the context) are listed apart; they are not matmuls with
weights and the bound leaves them out, as the issue does.

Matmul rate: the model's own linear layers (all 30 layers' qkv, o, gate_up, down, then lm_head)
timed at the batch shapes the workload allows, with each GEMM library torch offers on CPU
(``torch``: F.linear, which is MKL's sgemm in float32; ``onednn``: vlite's Linear on oneDNN-
prepacked weights, what the engine runs on CPU by default): M = 64 rows (every request decoding
at once) for output tokens, M = 2048 rows (a full prefill step) for prompt tokens. The best of
``--repeats`` timings is kept (a bound is a best case). The bound is then
  time >= prompt_flops / rate(2048) + output_flops / rate(64),   tokens/s <= output tokens / time.
The issue's own bound uses one rate, the 64-row one, for all the work; both are printed.

    .venv/bin/python benchmarks/throughput/fp32_bound.py [--dtype float32] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def w1_lengths(tokenizer, num_prompts=64, input_range=(32, 256), output_range=(16, 256), seed=0):
    from vlite.bench.datasets import random_requests

    reqs = random_requests(tokenizer, num_prompts, input_range, output_range, seed)
    return [(r.prompt_len, r.expected_output_len) for r in reqs]


def linear_rate(shapes: list[tuple[int, int]], m: int, dtype: torch.dtype, repeats: int, gemm: str) -> float:
    """GFLOP/s of running y = x W^T for every (in, out) in ``shapes`` at ``m`` rows, best of
    ``repeats``; ``gemm``: "torch" (F.linear) or "onednn" (prepacked, as the engine runs)."""
    from vlite.engine.worker.models.linear import Linear

    layers = []
    for i, o in shapes:
        layer = Linear(i, o, bias=False, dtype=dtype)
        if gemm == "onednn":
            layer.prepack_onednn()
        layers.append(layer)
    xs = {i: torch.randn(m, i, dtype=dtype) for i, _ in shapes}
    flops = sum(2 * m * i * o for i, o in shapes)
    best = float("inf")
    with torch.inference_mode():
        for layer in layers:  # warm-up
            layer(xs[layer.in_features])
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in layers:
                layer(xs[layer.in_features])
            best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gemm", nargs="+", default=["torch", "onednn"], choices=["torch", "onednn"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    from vlite.engine.worker.loader import DEFAULT_MODEL, load_checkpoint

    ckpt = load_checkpoint(DEFAULT_MODEL)
    c = ckpt.config
    h, inter, layers, vocab = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    hq, hkv = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or h // hq
    layer_shapes = [(h, (hq + 2 * hkv) * d), (hq * d, h), (h, 2 * inter), (inter, h)]
    layer_params = sum(i * o for i, o in layer_shapes)
    lengths = w1_lengths(ckpt.tokenizer)
    prompt_tokens = sum(p for p, _ in lengths)
    output_tokens = sum(o for _, o in lengths)
    # prompt tokens: decoder only; output tokens: decoder for all but the last, lm_head for each
    prompt_flops = prompt_tokens * 2 * layers * layer_params
    output_flops = sum((o - 1) * 2 * layers * layer_params + o * 2 * vocab * h for _, o in lengths)
    attn_flops = sum(4 * layers * hq * d * sum(range(1, p + o)) for p, o in lengths)  # q.k and p.v, causal

    all_shapes = layer_shapes * layers + [(h, vocab)]
    result = {
        "dtype": args.dtype, "torch_threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "matmul_gflop": (prompt_flops + output_flops) / 1e9, "prompt_gflop": prompt_flops / 1e9,
        "output_gflop": output_flops / 1e9, "attention_gflop_not_counted": attn_flops / 1e9, "gemm": {},
    }
    print(f"W1: {len(lengths)} requests, {prompt_tokens} prompt + {output_tokens} output tokens")
    print(f"matmul work: {result['matmul_gflop']:.0f} GFLOP ({result['prompt_gflop']:.0f} prompt, "
          f"{result['output_gflop']:.0f} output); attention products {result['attention_gflop_not_counted']:.0f} "
          "GFLOP, not counted")
    for gemm in args.gemm:
        rate_decode = linear_rate(all_shapes, 64, dtype, args.repeats, gemm)
        rate_prefill = linear_rate(layer_shapes * layers, 2048, dtype, args.repeats, gemm)
        t_two = prompt_flops / (rate_prefill * 1e9) + output_flops / (rate_decode * 1e9)
        t_one = (prompt_flops + output_flops) / (rate_decode * 1e9)
        result["gemm"][gemm] = {
            "rate_gflops_m64": rate_decode, "rate_gflops_m2048": rate_prefill,
            "min_time_s": t_two, "bound_output_tok_s": output_tokens / t_two,
            "min_time_one_rate_s": t_one, "bound_one_rate_output_tok_s": output_tokens / t_one,
        }
        print(f"{gemm}: {args.dtype} linear-layer rate ({torch.get_num_threads()} threads): {rate_decode:.1f} GFLOP/s "
              f"at 64 rows, {rate_prefill:.1f} GFLOP/s at 2048 rows")
        print(f"{gemm}: bound (two rates): >= {t_two:.1f} s, <= {output_tokens / t_two:.0f} output tok/s; "
              f"bound (64-row rate for all, the issue's way): >= {t_one:.1f} s, <= {output_tokens / t_one:.0f} "
              f"output tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
