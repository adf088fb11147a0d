"""Torch implementations of the KV store and paged attention: the CPU path and the reference
the Triton kernels are tested against. Shapes are documented in ``attention.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from vlite.kernels.attention import AttentionMetadata


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k_cache.view(-1, Hkv, D)[slot] = key[t] for every t whose slot is not -1."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence's K (or V): [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decodes in one padded batch; each prefill chunk on its own with a causal mask that is
    offset by the tokens already in the cache (chunked prefill)."""
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_attention(query[:nd], k_cache, v_cache, meta, scale)
    starts = meta.query_start_loc.tolist()
    for i in range(nd, len(meta.query_lens)):
        s, e = starts[i], starts[i + 1]
        q_len, ctx = meta.query_lens[i], meta.seq_lens_list[i]
        if ctx == q_len:  # nothing cached before this chunk: the fresh K/V are the context
            k, v = key[s:e], value[s:e]
        else:
            k = gather_kv(k_cache, meta.block_tables[i], ctx)
            v = gather_kv(v_cache, meta.block_tables[i], ctx)
        out[s:e] = _attend(query[s:e], k, v, ctx - q_len, scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] over k/v [Lk, Hkv, D]; query j sits at position num_cached + j."""
    q_len, k_len = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gqa = qh.shape[0] != kh.shape[0]
    if num_cached == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        pos_q = torch.arange(num_cached, num_cached + q_len, device=q.device)
        mask = torch.arange(k_len, device=q.device)[None, :] <= pos_q[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence: gather every sequence's blocks into a padded batch."""
    nd = q.shape[0]
    block_size = k_cache.shape[1]
    max_len = max(meta.seq_lens_list[:nd])
    nblk = -(-max_len // block_size)
    tables = meta.block_tables[:nd, :nblk]
    k = k_cache[tables].flatten(1, 2)  # [nd, nblk*bs, Hkv, D]
    v = v_cache[tables].flatten(1, 2)
    mask = torch.arange(nblk * block_size, device=q.device)[None, :] < meta.seq_lens[:nd, None]
    qh = q.unsqueeze(2)  # [nd, Hq, 1, D]
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    gqa = qh.shape[1] != kh.shape[1]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=gqa)
    return o.squeeze(2)
