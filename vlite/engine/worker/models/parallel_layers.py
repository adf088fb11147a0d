"""Tensor-parallel building blocks (Megatron-LM, Shoeybi et al. 2019; vLLM's ``parallel_state``
and ``model_executor/layers/linear.py`` use the same split).

With ``tensor_parallel_size`` N, rank r holds:
  * column-parallel layers (``qkv_proj``, ``gate_up_proj``): rows r/N of each stacked output
    (its own attention heads, its own slice of the intermediate size); no communication;
  * row-parallel layers (``o_proj``, ``down_proj``): columns r/N of the input; each rank's
    partial product is summed by one ``all_reduce`` (the bias is added once, by rank 0);
  * the vocab-parallel embedding: vocabulary rows [r*V/N, (r+1)*V/N) (padded up to a multiple
    of N); tokens outside a rank's range give zeros, and one ``all_reduce`` assembles the rows;
  * the vocab-parallel lm_head: the same vocabulary rows; the logits slices are gathered on rank 0.
With N = 1 every layer is the plain layer and no collective runs.

The collectives are ``torch.distributed``'s on its default process group (gloo on CPU, NCCL on
CUDA), which the worker initialises before it builds the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from vlite.engine.worker.models.linear import Linear


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group: ``rank`` in [0, ``size``)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same bits); identity when size is 1."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_on_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` [..., n] along the last dim on rank 0 ([..., size*n]);
        other ranks get None. Identity when size is 1."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None


@dataclass(frozen=True)
class HeadPartition:
    """Which attention heads one rank owns.

    q_start, num_q: query heads [q_start, q_start + num_q).
    kv_start, num_kv: KV heads [kv_start, kv_start + num_kv); with more ranks than KV heads each
        KV head is replicated on size / num_kv_heads ranks (as vLLM does).
    """

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """Tensor-parallel sizes that split this model: N divides the query heads and the
    intermediate size, and N divides the KV heads or the KV heads divide N."""
    return [n for n in range(1, num_heads + 1)
            if num_heads % n == 0 and intermediate_size % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)]


def check_tp_size(tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raise a one-line ValueError saying why ``tp_size`` cannot split this model, and which sizes can.

    Raises:
        ValueError: ``tp_size`` does not divide the query heads or the intermediate size, or
            neither divides the other with the KV heads.
    """
    if tp_size == 1:
        return
    why = []
    if num_heads % tp_size:
        why.append(f"its {num_heads} attention heads are not divisible by {tp_size}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        why.append(f"its {num_kv_heads} KV heads neither divide nor are divisible by {tp_size}")
    if intermediate_size % tp_size:
        why.append(f"its intermediate size {intermediate_size} is not divisible by {tp_size}")
    if why:
        sizes = ", ".join(map(str, valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)))
        raise ValueError(f"tensor_parallel_size {tp_size} cannot split this model: {'; '.join(why)}; "
                         f"sizes that work: {sizes}")


def partition_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> HeadPartition:
    """The heads of rank ``tp.rank``: contiguous query heads, and the KV heads their group uses
    (the sizes must have passed ``check_tp_size``)."""
    num_q = num_heads // tp.size
    if num_kv_heads >= tp.size:
        num_kv = num_kv_heads // tp.size
        kv_start = tp.rank * num_kv
    else:  # replicated: ranks r*K/N .. share KV head r // (N / K)
        num_kv = 1
        kv_start = tp.rank // (tp.size // num_kv_heads)
    return HeadPartition(tp.rank * num_q, num_q, kv_start, num_kv)


def shard_range(total: int, tp: TPGroup) -> tuple[int, int, int]:
    """(start, stop, shard_size) of rank ``tp.rank``'s slice of ``total`` rows split into
    ``tp.size`` equal shards of ceil(total / size) rows; the last shards may be short (padded)."""
    size = -(-total // tp.size)
    start = min(tp.rank * size, total)
    return start, min(start + size, total), size


class ColumnParallelLinear(Linear):
    """A linear layer holding rows ``output_sizes``-wise split across ranks; the caller builds it
    with the local (per-rank) output size. Its output stays split; no communication."""


class RowParallelLinear(Linear):
    """A linear layer holding its input's columns r/N; its partial results are summed over the
    ranks by one all-reduce. The bias lives on rank 0 only, so it is added once.

    Args:
        in_features: the local (per-rank) input size.
        out_features: the full output size.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias and tp.rank == 0)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """The embedding table's rows [vocab_start, vocab_end) on this rank, padded to the shard size;
    token ids outside the range give zero rows before the all-reduce (vLLM's
    ``VocabParallelEmbedding``)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        self.vocab_start, self.vocab_end, shard = shard_range(vocab_size, tp)
        super().__init__(shard, hidden_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        x = super().forward(local)
        x.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)


class ParallelLMHead(Linear):
    """The lm_head's vocabulary rows (same ranges as ``VocabParallelEmbedding``); ``logits``
    gathers the slices on rank 0 and drops the padding."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup) -> None:
        self.vocab_start, self.vocab_end, shard = shard_range(vocab_size, tp)
        super().__init__(hidden_size, shard, bias=False)
        self.vocab_size = vocab_size
        self.tp = tp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32 on rank 0, None on the others."""
        local = self(hidden).float()
        full = self.tp.gather_on_first(local)
        if full is None or self.tp.size == 1:
            return full
        return full[:, :self.vocab_size]


__all__ = ["ColumnParallelLinear", "HeadPartition", "ParallelLMHead", "RowParallelLinear", "TPGroup",
           "VocabParallelEmbedding", "check_tp_size", "partition_heads", "shard_range", "valid_tp_sizes"]
