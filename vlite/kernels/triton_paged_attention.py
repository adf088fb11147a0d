"""Triton paged attention: decode (one query per sequence) and prefill over the paged KV cache.

The algorithms:
  * Paged KV: K/V live in fixed-size blocks; a sequence's block table maps its logical block
    ``pos // block_size`` to a physical block (Kwon et al. 2023, vLLM's PagedAttention). The
    kernels gather K/V one token row at a time through the block table, so a tile of
    ``BLOCK_N`` tokens may span several cache blocks and any power-of-two block_size works.
  * Online softmax: each program walks its keys tile by tile, keeping a running row maximum
    ``m``, a running sum ``l`` and an unnormalised output ``acc`` that is rescaled whenever the
    maximum grows (FlashAttention, Dao et al. 2022; FlashAttention-2's exp2 form).
  * Decode splits long contexts into partitions of ``PARTITION_SIZE`` tokens so that a small
    batch still fills the chip; a second kernel merges the partitions' partial results
    (vLLM's paged_attention_v2, "flash-decoding").
  * GQA: a decode program handles all ``GROUP = Hq / Hkv`` query heads that share one KV head,
    so each K/V row is read once per group; the group is padded to 16 rows for ``tl.dot``.

Written for CUDA; tested on CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported). Two interpreter-only differences, both decided when this module is
imported: the interpreter cannot multiply bfloat16/float16 blocks (it returns garbage), so
``tl.dot`` operands are upcast to float32 there (``UPCAST``); on the GPU they stay in the
cache's dtype with float32 accumulation. Float32 inputs use ``input_precision="ieee"`` on the
GPU (no TF32) so that float32 results match the torch reference to 1e-3.

Shapes follow ``vlite/kernels/attention.py``: query [T, Hq, D]; caches
[num_blocks, block_size, Hkv, D]; decodes packed first in ``meta``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from vlite.kernels.metadata import AttentionMetadata

# Fixed when this module is imported, like the @triton.jit decorations below.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * LOG2E)

# GPU tile sizes (tokens). Tests pass smaller ones to exercise multi-tile paths on tiny shapes.
DECODE_BLOCK_N = 64
DECODE_PARTITION_SIZE = 512
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
MIN_DOT = 16  # tl.dot needs every dimension >= 16 on NVIDIA GPUs


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, kv_head, d, d_mask,
                  BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  UPCAST: tl.constexpr):
    """K and V rows [N, BLOCK_D] of the tokens at ``pos`` of one sequence, for one KV head,
    gathered through its block table row ``table``; invalid positions read as 0."""
    # Per-token gather through the block table (int64: slot * row size can pass 2**31).
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
    row = ((block * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running softmax (the online softmax of Milakov & Gimelshein 2018, as in
    FlashAttention): scores ``s`` [M, N] float32 in base 2 (masked keys -inf), values ``v`` [N, D];
    running row maximum ``m_i`` [M], sum of exponentials ``l_i`` [M] and unnormalised output
    ``acc`` [M, D], all float32. Returns the new (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
        out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        qk_scale,
        q_stride_t, q_stride_h, out_stride_t, out_stride_h, bt_stride, num_partitions,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION_SIZE: tl.constexpr,
        SINGLE_PARTITION: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid (num_decodes, Hkv, num_partitions): one KV head's query group of one sequence over
    the context tokens [part * PARTITION_SIZE, min((part + 1) * PARTITION_SIZE, seq_len)).

    ``qk_scale`` is softmax scale * log2(e): scores are kept in base 2.
    SINGLE_PARTITION: normalise and write the output [nd, Hq, D] directly. Otherwise write the
    partition's normalised output part_out [nd, Hq, P, D], its row maximum part_max [nd, Hq, P]
    and its sum of exponentials part_sum [nd, Hq, P] (float32) for ``_decode_reduce_kernel``.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    if not SINGLE_PARTITION:  # noqa: SIM102 (the outer test is a compile-time constant)
        if start >= seq_len:
            return  # past this sequence's end: the reduce kernel never reads this partition
    end = tl.minimum(start + PARTITION_SIZE, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, kv_head, d, d_mask,
                             BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N]
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile holds at least one valid token, so m_i is finite from the first tile on.
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    # A sequence of length 0 (a padded CUDA-graph row) has l == 0: write zeros, not NaN.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_PARTITION:
        o_ptr = out_ptr + seq.to(tl.int64) * out_stride_t + heads[:, None] * out_stride_h + d[None, :]
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        stat = (seq * (NUM_KV_HEADS * GROUP) + heads) * num_partitions + part  # [nd, Hq, P] index
        tl.store(part_max_ptr + stat, m_i, mask=g_mask)
        tl.store(part_sum_ptr + stat, l_i, mask=g_mask)
        tl.store(part_out_ptr + stat[:, None] * HEAD_DIM + d[None, :], out, mask=o_mask)


@triton.jit
def _decode_reduce_kernel(
        out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr,
        out_stride_t, out_stride_h, num_partitions,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PARTITION_SIZE: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (num_decodes, Hq): merge the partitions of one head's decode.

    Partition j contributes its normalised output with weight part_sum[j] * 2**(part_max[j] - max),
    the same rescaling the online softmax does within a partition. Only the partitions that
    hold tokens (j < cdiv(seq_len, PARTITION_SIZE)) are read; the others were never written.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = tl.cdiv(seq_len, PARTITION_SIZE)
    j = tl.arange(0, BLOCK_P)
    j_mask = j < num_used
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    stat = (seq * NUM_HEADS + head) * num_partitions + j
    maxes = tl.load(part_max_ptr + stat, mask=j_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + stat, mask=j_mask, other=0.0)
    m = tl.max(maxes, 0)
    m = tl.where(num_used > 0, m, 0.0)  # seq_len 0: avoid -inf - -inf
    w = tl.where(j_mask, tl.exp2(maxes - m) * sums, 0.0)
    parts = tl.load(part_out_ptr + stat[:, None] * HEAD_DIM + d[None, :],
                    mask=j_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_ptr = out_ptr + seq.to(tl.int64) * out_stride_t + head * out_stride_h + d
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _paged_prefill_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        qk_scale, first_seq,
        q_stride_t, q_stride_h, out_stride_t, out_stride_h, bt_stride,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Grid (num_prefills, Hq, cdiv(max_query_len, BLOCK_M)): BLOCK_M query rows of one head of
    sequence ``first_seq + program_id(0)`` against all of its K/V in the paged cache.

    The chunk's queries sit at positions num_cached .. seq_len - 1 (num_cached = seq_len -
    query_len: tokens from earlier chunks or a prefix-cache hit); query row r sees keys at
    positions <= num_cached + r (causal within the chunk, everything before it). This step's
    own K/V are read back from the cache, where ``store_kvcache`` has just put them.
    """
    seq = first_seq + tl.program_id(0)
    head = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return  # this sequence's chunk is shorter than the longest one in the batch
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len
    kv_head = head // GROUP

    r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = r < q_len
    q_pos = num_cached + r
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + r).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head * q_stride_h + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * bt_stride
    # Causal bound: the tile's last row sees keys up to its own position, nothing after.
    hi = tl.minimum(seq_len, num_cached + (m_tile + 1) * BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, table, pos, valid, kv_head, d, d_mask,
                             BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        # The first tile holds key 0, which every row sees: m_i is finite from then on, and a
        # tile wholly in a row's future only gives p = 0 and alpha = 1 for that row.
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptr = out_ptr + q_rows[:, None] * out_stride_t + head * out_stride_h + d[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def _check(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if query.stride(2) != 1:
        raise ValueError("query's head_dim axis must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache.dtype != query.dtype or v_cache.dtype != query.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {k_cache.dtype}")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")


def _dot_args(dtype: torch.dtype) -> dict:
    # float32 inputs: exact products (no TF32) so float32 matches the reference to 1e-3.
    return {"UPCAST": INTERPRETED, "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def choose_partition_size(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                          block_n: int = DECODE_BLOCK_N) -> int:
    """Tokens per decode partition: split only when the batch alone leaves the chip half idle.

    With num_seqs * Hkv programs at least twice the streaming multiprocessors, one partition
    per sequence (no reduce pass); otherwise DECODE_PARTITION_SIZE tokens per program.
    """
    one = max(block_n, triton.cdiv(max_seq_len, block_n) * block_n)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if num_seqs * num_kv_heads >= 2 * sms:
            return one
    return min(one, DECODE_PARTITION_SIZE)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, max_seq_len: int, *, out: torch.Tensor | None = None,
                 block_n: int = DECODE_BLOCK_N, partition_size: int | None = None) -> torch.Tensor:
    """Decode attention: one query token per sequence over its paged K/V.

    Args:
        query: [B, Hq, D] float32 / bfloat16 / float16 (the cache's dtype); D axis contiguous.
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous; Hq % Hkv == 0.
        block_tables: [B, max_blocks] int64 physical block ids (entries past a sequence's
            last block are never read).
        seq_lens: [B] int64 context lengths in tokens, the new token included; 0 gives a
            zero output (a padded row).
        scale: softmax scale (usually D ** -0.5).
        max_seq_len: an upper bound of ``seq_lens`` (a Python int, so no device sync); it
            fixes the number of partitions, so a CUDA graph captured with max_model_len
            serves every later length.
        out: optional [B, Hq, D] output (rows with stride(2) == 1) to write into.
        block_n: tokens per tile; partition_size: tokens per partition (a multiple of
            block_n); None picks ``choose_partition_size``.

    Returns:
        ``out``: [B, Hq, D] in the query's dtype.
    """
    _check(query, k_cache, v_cache)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    if partition_size is None:
        partition_size = choose_partition_size(num_seqs, num_kv_heads, max_seq_len, query.device, block_n)
    if partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} is not a multiple of block_n {block_n}")
    num_partitions = max(1, triton.cdiv(max_seq_len, partition_size))
    single = num_partitions == 1
    if single:  # the kernel writes ``out`` itself; the partial buffers are not touched
        part_out = part_max = part_sum = out
    else:
        part_max = torch.empty((num_seqs, num_heads, num_partitions), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty((num_seqs, num_heads, num_partitions, head_dim), dtype=torch.float32,
                               device=query.device)
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out, part_out, part_max, part_sum, query, k_cache, v_cache, block_tables, seq_lens,
        scale * LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        num_partitions,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        PARTITION_SIZE=partition_size, SINGLE_PARTITION=single, **_dot_args(query.dtype))
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, seq_lens, out.stride(0), out.stride(1), num_partitions,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, PARTITION_SIZE=partition_size,
            BLOCK_P=triton.next_power_of_2(num_partitions), BLOCK_D=triton.next_power_of_2(head_dim))
    return out


def paged_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, first_seq: int,
                  num_prefills: int, max_query_len: int, out: torch.Tensor, *, block_m: int = PREFILL_BLOCK_M,
                  block_n: int = PREFILL_BLOCK_N) -> torch.Tensor:
    """Prefill (chunk) attention over the paged cache, causal within each chunk.

    Args:
        query: [T, Hq, D] the packed step's queries (D axis contiguous); sequences
            ``first_seq .. first_seq + num_prefills - 1`` own rows
            query_start_loc[i]:query_start_loc[i + 1].
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], holding every one of these
            sequences' tokens up to seq_lens[i] (this step's K/V already stored).
        block_tables: [B, max_blocks] int64; seq_lens: [B] int64 (tokens);
        query_start_loc: [B + 1] int64 cumulative query lengths.
        scale: softmax scale; max_query_len: the longest chunk among these sequences (Python int).
        out: [T, Hq, D] output; only these sequences' rows are written.
        block_m, block_n: query rows / key tokens per tile (>= 16, powers of two).

    Returns:
        ``out``.
    """
    _check(query, k_cache, v_cache)
    if num_prefills == 0:
        return out
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    grid = (num_prefills, num_heads, triton.cdiv(max_query_len, block_m))
    _paged_prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale * LOG2E, first_seq,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        **_dot_args(query.dtype))
    return out


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, *, out: torch.Tensor | None = None, **tiles) -> torch.Tensor:
    """The attention interface's Triton path: decodes (the first ``meta.num_decodes``
    sequences) with ``paged_decode``, the rest with ``paged_prefill``.

    Args:
        query: [T, Hq, D]; caches [num_blocks, block_size, Hkv, D] already holding this step's K/V.
        meta: the step's ``AttentionMetadata`` (its Python lists give the launch sizes).
        tiles: optional tile sizes for tests: decode_block_n, partition_size, block_m, block_n.

    Returns:
        [T, Hq, D] in the query's dtype.
    """
    if out is None:
        out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        paged_decode(query[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                     max(meta.seq_lens_list[:nd]), out=out[:nd], block_n=tiles.get("decode_block_n", DECODE_BLOCK_N),
                     partition_size=tiles.get("partition_size"))
    num_prefills = len(meta.query_lens) - nd
    if num_prefills:
        paged_prefill(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                      nd, num_prefills, max(meta.query_lens[nd:]), out,
                      block_m=tiles.get("block_m", PREFILL_BLOCK_M), block_n=tiles.get("block_n", PREFILL_BLOCK_N))
    return out


__all__ = ["INTERPRETED", "choose_partition_size", "paged_attention", "paged_decode", "paged_prefill"]
