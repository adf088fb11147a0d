"""The one paged-attention interface the model calls.

The torch implementation serves every device for now; Triton kernels for CUDA plug in here.

Shapes (T = tokens in the step, B = sequences, Hq/Hkv = query/KV heads, D = head dim):
  query   [T, Hq, D], key/value [T, Hkv, D]      (float32 / bfloat16)
  k_cache, v_cache [num_blocks, block_size, Hkv, D]
Sequences are packed decodes first: the first ``num_decodes`` sequences have one query token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlite.kernels import torch_ref


@dataclass
class AttentionMetadata:
    """Per-step layout of the packed batch (built by the model runner).

    slot_mapping:    [T] int64, cache slot of each token (block_id * block_size + offset); -1 = skip.
    query_start_loc: [B + 1] int64, cumulative query lengths; sequence i owns tokens
                     query_start_loc[i]:query_start_loc[i+1].
    seq_lens:        [B] int64, context length of each sequence after this step (tokens).
    block_tables:    [B, max_blocks] int64, physical block ids, padded with 0.
    num_decodes:     the first num_decodes sequences are decodes (one query token each).
    query_lens / seq_lens_list: the same lengths as Python ints (no device syncs in loops).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_lens: list[int]
    seq_lens_list: list[int]
    block_size: int


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V into its slot. Shapes as in the module docstring."""
    torch_ref.store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of the packed queries over each sequence's paged K/V.

    ``key``/``value`` are this step's new K/V (already stored in the cache); implementations
    may use them directly when a sequence has no earlier cached context.
    Returns [T, Hq, D] in the query's dtype.
    """
    return torch_ref.paged_attention(query, key, value, k_cache, v_cache, meta, scale)
