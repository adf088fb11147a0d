"""The C++ paged decode-attention kernel for CPU (``cpu_paged_attention.cpp``), one op of vlite's
C++ CPU extension (``cpu_extension.py`` builds it on first use; when it cannot be built the torch
path, ``torch_ref``, does all the attention).

Only float32 and bfloat16 decodes go through the kernel; prefill chunks, other dtypes and head
shapes it does not take stay on the torch path (``supports``).
"""

from __future__ import annotations

import torch

from vlite.kernels.cpu_extension import load, loaded

__all__ = ["load", "paged_decode", "supports"]

_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel takes


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode`` takes these tensors: CPU float32 or bfloat16 (query and cache
    alike), contiguous caches, head_dim a multiple of 16 up to 256, at most 8 query heads per
    KV head."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (query.device.type == "cpu" and query.dtype in _DTYPES and k_cache.dtype == query.dtype
            and k_cache.is_contiguous() and head_dim % 16 == 0 and head_dim <= 256
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 8)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [n, Hq, D] float32 or bfloat16 (the caches' dtype), one token per sequence, over
    its first seq_lens[i] cached tokens of block_tables[i] ([n, max_blocks] int64); returns
    [n, Hq, D] in the query's dtype (float32 accumulation either way).

    Raises:
        RuntimeError: the kernel is not built (call ``load()`` first) or the tensors break its
            assumptions (``supports``).
    """
    module = loaded()
    if module is None:
        raise RuntimeError("the C++ CPU attention kernel is not loaded; call cpu_attention.load() first")
    return module.paged_decode(query.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens, scale)
