"""Times the Triton kernels on an NVIDIA GPU and compares achieved memory bandwidth with the
device's measured device-to-device copy bandwidth (called by ``benchmarks/gpu/gpu_check.sh``).

Each kernel is timed with ``triton.testing.do_bench`` (median of repeated runs, after warm-up)
at sizes that fill the chip, checked against ``torch_ref`` (float32) at that size, and timed
against ``torch_ref`` on the same GPU for context. Bytes counted are the compulsory traffic:
every K/V element read once (attention) or read and written once (store), plus queries and
outputs; a kernel cannot move less. Prints a Markdown table for docs/kernels.md.

Usage: python benchmarks/gpu/gpu_check.py [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check.py needs a CUDA device")

import triton
from triton.testing import do_bench

from vlite.kernels import torch_ref
from vlite.kernels import triton_paged_attention as tpa
from vlite.kernels import triton_store_kvcache as tsk
from vlite.kernels.attention import AttentionMetadata

DEV = torch.device("cuda")
DTYPE = torch.bfloat16
# (name, Hq, Hkv, D): the default model's attention, and a Llama-3-8B-sized one.
SHAPES = [("SmolLM2-135M 9/3x64", 9, 3, 64), ("Llama-3-8B 32/8x128", 32, 8, 128)]
BLOCK_SIZE = 16
TARGET = 0.60  # decode at SmolLM2's heads should reach 60% of the copy bandwidth (the GPU check's target)


def median_ms(fn, *args, **kwargs) -> float:
    """Median milliseconds of fn(*args, **kwargs) (triton.testing.do_bench: warm-up, L2 flushed)."""
    return do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = median_ms(dst.copy_, src)
    del src, dst
    return 2 * n / (ms * 1e-3)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def paged_batch(num_seqs: int, ctx: int, q_len: int, hq: int, hkv: int, d: int):
    """Random caches; ``num_seqs`` sequences of ``ctx`` tokens (the last ``q_len`` of them this
    step's queries) on shuffled blocks. Decodes when q_len == 1."""
    per_seq = triton.cdiv(ctx, BLOCK_SIZE)
    num_blocks = num_seqs * per_seq + 8
    k_cache = torch.randn((num_blocks, BLOCK_SIZE, hkv, d), device=DEV, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=DEV)[:num_seqs * per_seq].view(num_seqs, per_seq)
    query = torch.randn((num_seqs * q_len, hq, d), device=DEV, dtype=DTYPE)
    pos = torch.arange(ctx - q_len, ctx, device=DEV)
    slots = (tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).flatten()
    key, value = k_cache.view(-1, hkv, d)[slots], v_cache.view(-1, hkv, d)[slots]  # this step's K/V
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(num_seqs + 1, device=DEV) * q_len,
        seq_lens=torch.full((num_seqs,), ctx, dtype=torch.long, device=DEV),
        block_tables=tables, num_decodes=num_seqs if q_len == 1 else 0,
        query_lens=[q_len] * num_seqs, seq_lens_list=[ctx] * num_seqs, block_size=BLOCK_SIZE)
    return query, key, value, k_cache, v_cache, meta


def bench_store(rows: list, copy_bw: float) -> None:
    for name, _, hkv, d in SHAPES:
        t = 16384
        num_blocks = 2 * t // BLOCK_SIZE
        k_cache = torch.zeros((num_blocks, BLOCK_SIZE, hkv, d), device=DEV, dtype=DTYPE)
        v_cache = torch.zeros_like(k_cache)
        key = torch.randn((t, hkv, d), device=DEV, dtype=DTYPE)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEV)[:t]
        tsk.store_kvcache(key, value, k_cache, v_cache, slots)
        ok = torch.equal(k_cache.view(-1, hkv, d)[slots], key) and torch.equal(v_cache.view(-1, hkv, d)[slots], value)
        ms = median_ms(tsk.store_kvcache, key, value, k_cache, v_cache, slots)
        ref_ms = median_ms(torch_ref.store_kvcache, key, value, k_cache, v_cache, slots)
        nbytes = 2 * 2 * key.numel() * key.element_size() + slots.numel() * 8
        rows.append({"kernel": "store_kvcache", "shape": f"{name}, {t} tokens", "ms": ms, "gbs": nbytes / ms / 1e6,
                     "frac": nbytes / (ms * 1e-3) / copy_bw, "tflops": None, "err": 0.0 if ok else float("inf"),
                     "ref_ms": ref_ms})


def bench_decode(rows: list, copy_bw: float) -> None:
    for num_seqs, ctx in ((64, 2048), (8, 8192), (256, 1024)):
        for name, hq, hkv, d in SHAPES:
            query, key, value, k_cache, v_cache, meta = paged_batch(num_seqs, ctx, 1, hq, hkv, d)
            scale = d ** -0.5
            out = tpa.paged_attention(query, k_cache, v_cache, meta, scale)
            ref = torch_ref.paged_attention(query.float(), key.float(), value.float(), k_cache.float(),
                                            v_cache.float(), meta, scale)
            err = rel_err(out, ref)
            del ref
            ms = median_ms(tpa.paged_attention, query, k_cache, v_cache, meta, scale, out=out)
            ref_ms = median_ms(torch_ref.paged_attention, query, key, value, k_cache, v_cache, meta, scale)
            nbytes = 2 * num_seqs * ctx * hkv * d * 2 + 2 * query.numel() * 2 + meta.block_tables.numel() * 8
            parts = triton.cdiv(ctx, tpa.choose_partition_size(num_seqs, hkv, ctx, DEV))
            rows.append({"kernel": "paged decode", "shape": f"{name}, {num_seqs} x {ctx} tok, {parts} part.",
                         "ms": ms, "gbs": nbytes / ms / 1e6, "frac": nbytes / (ms * 1e-3) / copy_bw, "tflops": None,
                         "err": err, "ref_ms": ref_ms, "target": name.startswith("SmolLM2")})
            del query, key, value, k_cache, v_cache, out


def bench_prefill(rows: list, copy_bw: float) -> None:
    for num_seqs, ctx, q_len in ((4, 4096, 2048), (8, 1024, 1024)):
        for name, hq, hkv, d in SHAPES:
            query, key, value, k_cache, v_cache, meta = paged_batch(num_seqs, ctx, q_len, hq, hkv, d)
            scale = d ** -0.5
            out = tpa.paged_attention(query, k_cache, v_cache, meta, scale)
            # the float32 reference on the first two sequences only (it loops over sequences)
            n = 2 * q_len
            sub = AttentionMetadata(meta.slot_mapping[:n], meta.query_start_loc[:3], meta.seq_lens[:2],
                                    meta.block_tables[:2], 0, meta.query_lens[:2], meta.seq_lens_list[:2],
                                    BLOCK_SIZE)
            ref = torch_ref.paged_attention(query[:n].float(), key[:n].float(), value[:n].float(), k_cache.float(),
                                            v_cache.float(), sub, scale)
            err = rel_err(out[:n], ref)
            del ref
            ms = median_ms(tpa.paged_attention, query, k_cache, v_cache, meta, scale, out=out)
            ref_ms = median_ms(torch_ref.paged_attention, query, key, value, k_cache, v_cache, meta, scale)
            cached = ctx - q_len
            visible = num_seqs * (q_len * cached + q_len * (q_len + 1) // 2)  # (query, key) pairs
            flops = 4 * visible * hq * d
            nbytes = 2 * num_seqs * ctx * hkv * d * 2 + 2 * query.numel() * 2
            rows.append({"kernel": "paged prefill", "shape": f"{name}, {num_seqs} x {q_len} new + {cached} cached",
                         "ms": ms, "gbs": nbytes / ms / 1e6, "frac": nbytes / (ms * 1e-3) / copy_bw,
                         "tflops": flops / (ms * 1e-3) / 1e12, "err": err, "ref_ms": ref_ms})
            del query, key, value, k_cache, v_cache, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(DEV)
    copy_bw = copy_bandwidth()
    print(f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
          f"torch {torch.__version__}, triton {triton.__version__}; dtype {DTYPE}, block_size {BLOCK_SIZE}")
    print(f"measured device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (1 GiB copy, read + write)\n")
    rows: list[dict] = []
    bench_store(rows, copy_bw)
    bench_decode(rows, copy_bw)
    bench_prefill(rows, copy_bw)

    print("| kernel | shape | median µs | GB/s | % of copy BW | TFLOP/s | rel. err vs torch_ref | torch_ref µs |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tf = f"{r['tflops']:.0f}" if r["tflops"] is not None else "–"
        print(f"| {r['kernel']} | {r['shape']} | {r['ms'] * 1e3:.1f} | {r['gbs']:.0f} | {100 * r['frac']:.0f}% | {tf} "
              f"| {r['err']:.1e} | {r['ref_ms'] * 1e3:.1f} |")
    bad = [r for r in rows if not r["err"] < 2e-2]  # accuracy: a failure; speed: reported, not a failure
    targets = [r for r in rows if r.get("target")]
    print()
    for r in targets:
        verdict = "meets" if r["frac"] >= TARGET else "MISSES"
        print(f"decode target ({r['shape']}): {100 * r['frac']:.0f}% of copy bandwidth {verdict} the "
              f"{100 * TARGET:.0f}% goal")
    if bad:
        print(f"ACCURACY FAILURES: {[r['kernel'] + ' ' + r['shape'] for r in bad]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "copy_bw": copy_bw, "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
