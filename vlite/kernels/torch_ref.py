"""Torch implementations of the KV store and paged attention: the CPU path and the reference
the Triton kernels are tested against. Shapes are documented in ``attention.py``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from vlite.kernels.metadata import AttentionMetadata


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


# Longest context (tokens) of a prefill chunk that the decode kernel attends row by row (each
# query token as a decode row over its causal prefix): its K/V stay in the core's L2 and it runs
# 1.8-2.3x faster than SDPA's flash path up to 512 tokens, 1.2x at 1,024 and even at 2,048
# (float32, benchmarks/kernels/cpu_kernels.py).
KERNEL_PREFILL_MAX_CONTEXT = 1024


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    decode_attention: Callable | None = None) -> torch.Tensor:
    """Decodes in padded batches of similar length; each prefill chunk on its own with a causal
    mask that is offset by the tokens already in the cache (chunked prefill).

    decode_attention: another implementation for the decode rows, called as
        ``decode_attention(q [n, Hq, D], k_cache, v_cache, block_tables [n, max_blocks],
        seq_lens [n], scale)`` (the C++ CPU kernel, ``cpu_attention.paged_decode``). It also
        takes the rows of prefill chunks whose context is at most
        ``KERNEL_PREFILL_MAX_CONTEXT`` tokens: query token j of a chunk becomes a row over the
        first (cached + j + 1) tokens of its sequence, read from the cache (where this step's
        K/V already are).
    """
    nd = meta.num_decodes
    if decode_attention is not None:
        every = kernel_rows_of_every_token(meta)
        if every is not None:  # decode-only steps (most steps), and steps of short prefill chunks
            return decode_attention(query, k_cache, v_cache, *every, scale)
    elif nd == len(meta.query_lens):
        return _decode_attention(query, k_cache, v_cache, meta, scale)
    out = torch.empty_like(query)
    chunks = range(nd, len(meta.query_lens))
    if decode_attention is not None:
        rows = kernel_rows(meta)
        if len(rows.tokens):
            out.index_copy_(0, rows.tokens, decode_attention(query.index_select(0, rows.tokens), k_cache, v_cache,
                                                             rows.block_tables, rows.seq_lens, scale))
        chunks = [i for i in chunks if meta.seq_lens_list[i] > KERNEL_PREFILL_MAX_CONTEXT]
    elif nd:
        out[:nd] = _decode_attention(query[:nd], k_cache, v_cache, meta, scale)
    starts = list(itertools.accumulate(meta.query_lens, initial=0))
    for i in chunks:
        s, e = starts[i], starts[i + 1]
        q_len, ctx = meta.query_lens[i], meta.seq_lens_list[i]
        if ctx == q_len:  # nothing cached before this chunk: the fresh K/V are the context
            k, v = key[s:e], value[s:e]
        else:
            k = gather_kv(k_cache, meta.block_tables[i], ctx)
            v = gather_kv(v_cache, meta.block_tables[i], ctx)
        out[s:e] = _attend(query[s:e], k, v, ctx - q_len, scale)
    return out


@dataclass
class KernelRows:
    """The step's query tokens that go through the decode kernel as rows (decodes and short
    prefill chunks), derived once per step (``kernel_rows``).

    tokens: [n] int64 indices of those tokens in the step, or None for all of them in order.
    block_tables: [n, max_blocks] int64, each row's sequence's block table.
    seq_lens: [n] int64, each row's causal context: its position + 1 (tokens).
    """

    tokens: torch.Tensor | None
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


def kernel_rows_of_every_token(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(block_tables [T, max_blocks], seq_lens [T]) of the decode kernel's rows when they are
    every query token of the step in order (a decode-only step, or one whose prefill chunks all
    have at most ``KERNEL_PREFILL_MAX_CONTEXT`` tokens of context), else None."""
    nd = meta.num_decodes
    if nd == len(meta.query_lens):
        return meta.block_tables[:nd], meta.seq_lens[:nd]
    rows = kernel_rows(meta)
    return None if rows.tokens is not None else (rows.block_tables, rows.seq_lens)


def kernel_rows(meta: AttentionMetadata) -> KernelRows:
    """The rows of the step the decode kernel attends (see ``paged_attention``), built on the
    first layer's call and kept in ``meta.plan_cache``."""
    plan = meta.plan_cache.get("kernel_rows")
    if plan is not None:
        return plan
    nd, num_seqs = meta.num_decodes, len(meta.query_lens)
    taken = [i for i in range(num_seqs) if i < nd or meta.seq_lens_list[i] <= KERNEL_PREFILL_MAX_CONTEXT]
    dev = meta.seq_lens.device
    seqs = torch.tensor(taken, dtype=torch.long, device=dev)
    q_lens = torch.tensor([meta.query_lens[i] for i in taken], dtype=torch.long, device=dev)
    row_seq = torch.repeat_interleave(seqs, q_lens)
    # the j-th row of a chunk is step token query_start + j, at position (seq_len - query_len) + j
    j = torch.arange(len(row_seq), device=dev) - torch.repeat_interleave(torch.cumsum(q_lens, 0) - q_lens, q_lens)
    tokens = torch.repeat_interleave(meta.query_start_loc.index_select(0, seqs), q_lens) + j
    lens = torch.repeat_interleave(meta.seq_lens.index_select(0, seqs) - q_lens + 1, q_lens) + j
    every = len(taken) == num_seqs
    plan = KernelRows(None if every else tokens, meta.block_tables.index_select(0, row_seq), lens)
    meta.plan_cache["kernel_rows"] = plan
    return plan


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] over k/v [Lk, Hkv, D]; query j sits at position num_cached + j.

    GQA as a broadcast, not ``enable_gqa``: the queries become [Hkv, G, Lq, D] (G = Hq / Hkv)
    and each KV head is expanded over its G query heads as a stride-0 view, with no copy. On
    CPU, SDPA with ``enable_gqa=True`` falls back to the math path (it materializes the
    [Hq, Lq, Lk] scores: 45 ms for 1,024 tokens of SmolLM2, against 10 ms this way;
    ``benchmarks/kernels/cpu_kernels.py``).
    """
    if q.dtype != torch.float32:
        # bf16/fp16 on CPU: widened to float32 (exact) for the flash path, one rounding at the end.
        # SDPA's bf16 flash path rounds inside (W1's greedy bf16 tokens agreed with float32 at 64%
        # of positions, benchmarks/quality/bf16_agreement.py); its bf16 math path agreed at 79% but costs
        # 2x the float32 flash path in time
        if q.device.type == "cpu":
            return _attend(q.float(), k.float(), v.float(), num_cached, scale).to(q.dtype)
        return _attend_gqa_math(q, k, v, num_cached, scale)
    q_len, k_len, head_dim = q.shape[0], k.shape[0], q.shape[2]
    num_kv_heads = k.shape[1]
    group = q.shape[1] // num_kv_heads
    qh = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, Lq, D]
    kh = k.permute(1, 0, 2)[:, None].expand(num_kv_heads, group, k_len, head_dim)
    vh = v.permute(1, 0, 2)[:, None].expand(num_kv_heads, group, k_len, head_dim)
    mask = _chunk_mask(num_cached, q_len, k_len, q.device)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale)
    return o.permute(2, 0, 1, 3).reshape(q_len, num_kv_heads * group, head_dim)


def _chunk_mask(num_cached: int, q_len: int, k_len: int, device) -> torch.Tensor | None:
    """[Lq, Lk] bool, True where query j (at position num_cached + j) may see key i; None when
    nothing is cached before the chunk (plain causal attention, SDPA's ``is_causal``)."""
    if not num_cached:
        return None
    pos_q = torch.arange(num_cached, num_cached + q_len, device=device)
    return torch.arange(k_len, device=device)[None, :] <= pos_q[:, None]


def _attend_gqa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
                     scale: float) -> torch.Tensor:
    """``_attend`` through SDPA's ``enable_gqa`` (the math path on CPU), for bf16/fp16."""
    q_len, k_len = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    mask = _chunk_mask(num_cached, q_len, k_len, q.device)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=scale,
                                       enable_gqa=qh.shape[0] != kh.shape[0])
    return o.transpose(0, 1)


def decode_groups(seq_lens: list[int], max_waste: float = 0.25, min_group: int = 8) -> list[list[int]]:
    """Split decode rows into groups of similar context length, longest first.

    A padded batch costs memory traffic for its longest row, so rows are sorted by length and a
    new group starts once a row is more than ``max_waste`` shorter than its group's longest (and
    the group has ``min_group`` rows; tiny groups would cost more in per-call overhead).
    Returns lists of row indices into ``seq_lens``.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
    groups: list[list[int]] = [[]]
    for row in order:
        cur = groups[-1]
        if len(cur) >= min_group and seq_lens[row] < (1 - max_waste) * seq_lens[cur[0]]:
            groups.append(cur := [])
        cur.append(row)
    return groups


@dataclass
class DecodeGroup:
    """One padded decode batch, derived once per step (see ``decode_plan``).

    rows: [m] int64 indices of the group's decode rows, or None for all rows in order.
    flat_blocks: [m * num_blocks] int64 block ids, each row's table cut to num_blocks.
    mask: [m, 1, 1, num_blocks * block_size] bool, True where a position holds context.
    """

    rows: torch.Tensor | None
    flat_blocks: torch.Tensor
    mask: torch.Tensor
    num_rows: int
    num_blocks: int


def decode_plan(meta: AttentionMetadata) -> list[DecodeGroup]:
    """The step's decode groups with their block ids and masks, built on the first layer's call
    and kept in ``meta.plan_cache`` for the other layers (they share the step's layout)."""
    plan = meta.plan_cache.get("torch_decode")
    if plan is not None:
        return plan
    nd, block_size = meta.num_decodes, meta.block_size
    lens = meta.seq_lens_list[:nd]
    groups = decode_groups(lens)
    plan = []
    for rows in groups:
        idx = None if len(groups) == 1 else torch.tensor(rows, device=meta.seq_lens.device)
        tables = meta.block_tables[:nd] if idx is None else meta.block_tables.index_select(0, idx)
        seq_lens = meta.seq_lens[:nd] if idx is None else meta.seq_lens.index_select(0, idx)
        nblk = -(-lens[rows[0]] // block_size)
        positions = torch.arange(nblk * block_size, device=seq_lens.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
        plan.append(DecodeGroup(idx, tables[:, :nblk].reshape(-1), mask, len(rows), nblk))
    meta.plan_cache["torch_decode"] = plan
    return plan


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence. Rows of similar context length are gathered into one padded
    batch (``decode_groups``) and attended with one SDPA call per group.

    The gather copies each row's blocks out of the cache, so its cost is memory traffic:
    rows x padded length x Hkv x D per layer, for K and for V.
    """
    plan = decode_plan(meta)
    if len(plan) == 1:
        return _decode_group(q, k_cache, v_cache, plan[0], scale)
    out = torch.empty_like(q)
    for group in plan:
        # index_select / index_copy_: plain row copies (advanced-index assignment is much slower on CPU)
        out.index_copy_(0, group.rows, _decode_group(q.index_select(0, group.rows), k_cache, v_cache, group, scale))
    return out


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                  scale: float) -> torch.Tensor:
    """q [n, Hq, D] over the group's cached tokens; returns [n, Hq, D]."""
    n, length = group.num_rows, group.num_blocks * k_cache.shape[1]
    # index_select on the block dim: one contiguous copy of block_size * Hkv * D values per block
    k = k_cache.index_select(0, group.flat_blocks).view(n, length, *k_cache.shape[2:])
    v = v_cache.index_select(0, group.flat_blocks).view(n, length, *v_cache.shape[2:])
    num_kv_heads = k_cache.shape[2]
    # GQA without repeating K/V: the query heads that share a KV head become that head's
    # "query rows" ([n, Hkv, Hq/Hkv, D]), so each K/V row is read once per KV head. With one
    # query position per sequence there is no causal mask, only the padding mask.
    qh = q.reshape(n, num_kv_heads, -1, q.shape[-1])
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [n, Hkv, L, D]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=group.mask, scale=scale)
    return o.reshape(q.shape)
