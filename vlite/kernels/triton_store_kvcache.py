"""Triton kernel that writes this step's K and V into the paged KV cache.

The same operation as ``torch_ref.store_kvcache`` (vLLM's ``reshape_and_cache``): token t's
key/value rows [Hkv, D] go to cache slot ``slot_mapping[t]`` (= block_id * block_size + offset);
a slot of -1 means "skip this token" (padding, e.g. the unused rows of a CUDA-graph batch).

Runs on CUDA, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported), which is how CI tests it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Fixed when this module is imported, like the @triton.jit decoration below.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                          key_stride, value_stride,
                          ROW: tl.constexpr, BLOCK: tl.constexpr):
    """One program per token: copy its ROW = Hkv * D contiguous elements of K and of V.

    key/value rows are ``key_stride``/``value_stride`` elements apart (their head and dim
    axes are contiguous); the cache is contiguous, so slot s starts at element s * ROW.
    """
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)  # int64: slot * ROW can pass 2**31 in a large cache
    offs = tl.arange(0, BLOCK)
    # A -1 slot masks every element: nothing is read or written for that token.
    mask = offs < tl.where(slot >= 0, ROW, 0)
    k = tl.load(key_ptr + t.to(tl.int64) * key_stride + offs, mask=mask)
    v = tl.load(value_ptr + t.to(tl.int64) * value_stride + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V into its cache slot, in place.

    Args:
        key, value: [T, Hkv, D], float32 / bfloat16 / float16, the same dtype as the cache;
            each token's [Hkv, D] block must be contiguous (a view split off a fused
            qkv projection is fine: only the token stride may differ).
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous.
        slot_mapping: [T] int64, slot of each token (block_id * block_size + offset); -1 = skip.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for name, x in (("key", key), ("value", value)):
        if x.stride(2) != 1 or x.stride(1) != head_dim:
            raise ValueError(f"{name} must have contiguous [Hkv, D] rows, got strides {tuple(x.stride())}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(f"K/V dtype {key.dtype} does not match the cache's {k_cache.dtype}")
    row = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row))
