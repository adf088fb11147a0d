"""Model runner: packs a scheduled step into flat tensors, runs one forward, samples.

Per step it builds (T = scheduled tokens, B = scheduled sequences, decodes first):
  input_ids [T] int64, positions [T] int64, slot_mapping [T] int64,
  block_tables [B, max_blocks] int64, seq_lens [B] int64, query_start_loc [B + 1] int64,
and computes logits only for the last token of each sequence whose chunk reaches its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlite.engine.faults import FaultSet
from vlite.engine.models.llama import LlamaForCausalLM
from vlite.engine.sampler import SamplerOutput, sample
from vlite.engine.scheduler import SchedulerOutput
from vlite.engine.sequence import Sequence
from vlite.kernels.attention import AttentionMetadata


class SequenceError(RuntimeError):
    """A step failed because of specific sequences; the engine ends those with ``error``."""

    def __init__(self, seq_ids: list[int], message: str) -> None:
        super().__init__(message)
        self.seq_ids = seq_ids


@dataclass
class StepResult:
    """Sampled tokens for the sequences that reached their last token this step."""

    sampled_seqs: list[Sequence]
    sampler_output: SamplerOutput
    # [len(sampled_seqs), vocab] float32 logits before sampling, when asked for (n > 1, beams)
    logits: torch.Tensor | None = None


def kv_cache_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one physical block takes across all layers' K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize


class ModelRunner:
    """Runs the model over the paged KV cache.

    Args:
        model: the loaded model (already on ``device`` in ``dtype``).
        num_blocks, block_size: KV cache geometry; the cache is allocated here,
            one (K, V) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, faults: FaultSet | None = None, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.faults = faults or FaultSet()
        self.cuda_graphs = None  # decode CUDA graphs (vlite/engine/cuda_graphs.py), set by LLMEngine on CUDA
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(model.num_layers)]
        self.generator = torch.Generator().manual_seed(seed)

    def prepare(self, sched: SchedulerOutput, block_tables: dict[int, list[int]]):
        """Flatten the step. Returns (input_ids, positions, AttentionMetadata, logits_indices)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        num_decodes = 0
        for item in sched.scheduled:
            seq = item.seq
            if self.faults.active("raise-in-step") and seq.origin.client_tag == "raise-in-step":
                raise SequenceError([seq.seq_id], f"planted fault raise-in-step for {seq.request_id!r}")
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens
            table = block_tables[seq.seq_id]
            input_ids.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
            tables.append(table)
            if item.sample:
                logits_indices.append(len(input_ids) - 1)
            if item.num_new_tokens == 1 and not seq.in_prefill and len(tables) == num_decodes + 1:
                num_decodes += 1
        max_blocks = max(len(t) for t in tables)
        table_tensor = torch.zeros((len(tables), max_blocks), dtype=torch.long)
        for i, t in enumerate(tables):
            table_tensor[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=table_tensor.to(dev),
            num_decodes=num_decodes,
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            block_size=bs,
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta,
                torch.tensor(logits_indices, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy K/V of block src into block dst in every layer."""
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[int, list[int]],
                keep_logits: bool = False) -> StepResult:
        """Run one step: forward over all scheduled tokens, then sample where due.

        keep_logits: also return the raw logits of the sampled rows (for forks and beams).
        Raises:
            SequenceError: a failure tied to specific sequences.
        """
        input_ids, positions, meta, logits_indices = self.prepare(sched, block_tables)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            hidden = self.cuda_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sampled = [item.seq for item in sched.scheduled if item.sample]
        if not sampled:
            return StepResult([], SamplerOutput([], []))
        logits = self.model.compute_logits(hidden[logits_indices]).cpu()
        raw = logits.clone() if keep_logits else None
        return StepResult(sampled, sample(logits, sampled, self.generator), raw)


__all__ = ["ModelRunner", "SequenceError", "StepResult", "kv_cache_bytes_per_block"]
