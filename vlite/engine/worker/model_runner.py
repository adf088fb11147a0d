"""Model runner: owns the model and its KV cache; packs a scheduled step into flat tensors,
runs one forward, samples.

Set-up, in vLLM's worker order: build and load the model (``__init__``), size the KV cache
(``determine_num_blocks``: a byte budget on CPU, a profile forward on CUDA), then allocate it
and capture the decode CUDA graphs (``initialize_kv_cache``). Nothing here reads the block
manager: block tables arrive with each step.

Per step it builds (T = scheduled tokens, B = scheduled sequences, decodes first):
  input_ids [T] int64, positions [T] int64, slot_mapping [T] int64,
  block_tables [B, max_blocks] int64, seq_lens [B] int64, query_start_loc [B + 1] int64,
and computes logits only for the last token of each sequence whose chunk reaches its end (and,
for requests asking for prompt logprobs, at their prompt positions: prompt_logprobs.py).

The step is packed in two stages so that it can cross a process boundary: ``prepare_input``
(engine process, plain Python lists: ``StepInput``) and ``ModelRunner.build_metadata`` (the
process that holds the model: tensors on its device). Under tensor parallelism each worker holds
a ``ModelRunner`` over its shard of the model (``vlite/engine/worker/worker.py``) and gets the same
``StepInput``; rank 0 returns the logits, and the engine samples (``sample_step``).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from vlite.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig
from vlite.engine.core.faults import FaultSet
from vlite.engine.core.prompt_logprobs import PromptLogprobsRows, compute_prompt_logprobs, plan_prompt_logprobs
from vlite.engine.core.sched_output import ForkSamples, SamplerOutput, ScheduledSequence, SchedulerOutput, StepResult
from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.cpu_malloc import tune_malloc
from vlite.engine.worker.loader import LoadedCheckpoint, WeightSource, checkpoint_files
from vlite.engine.worker.models.cpu_layer_loop import CpuLayerLoop
from vlite.engine.worker.models.cpu_layer_loop import default_choice as default_layer_loop
from vlite.engine.worker.models.linear import resolve_cpu_gemm_backend
from vlite.engine.worker.models.llama import LlamaForCausalLM
from vlite.engine.worker.models.parallel_layers import TPGroup
from vlite.engine.worker.sampler import argmax_on_device, plain_greedy, sample
from vlite.kernels.attention import AttentionMetadata
from vlite.kernels.attention import default_backend as default_attention_backend
from vlite.kernels.attention import prepare_backend as prepare_attention_backend
from vlite.kernels.fused_ops import default_choice as default_fused_ops

logger = logging.getLogger("vlite.engine")


class SequenceError(RuntimeError):
    """A step failed because of specific sequences; the engine ends those with ``error``."""

    def __init__(self, seq_ids: list[int], message: str) -> None:
        super().__init__(message)
        self.seq_ids = seq_ids


def copy_kv_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy blocks ``src[i]`` into blocks ``dst[i]`` of every layer's K and V cache, in place.

    kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim];
    src, dst: [P] int64 block ids on the caches' device, dst ids distinct. Every source is read
    before any destination is written (a dst that is also a src gives its old contents).

    One gather (``index_select``) and one indexed copy (``index_copy_``) along the block dim per
    cache tensor. The scattered assignment it replaces (``k_cache[dst] = k_cache[src]``, i.e.
    ``index_put_``) took 972 ms for one pair over 30 layers beside a busy process on 2 cores, against
    about 1 ms in one thread (docs/benchmarks.md, "Beside other work"). Neither op
    reads the ids on the host: no host sync on a GPU.
    """
    for k_cache, v_cache in kv_caches:
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))


@dataclass
class StepInput:
    """One step, flattened, in plain lists (what the engine sends each rank once per step).

    T = scheduled tokens, B = scheduled sequences (decodes first):
    input_ids, positions, slot_mapping: [T]; block_tables: B lists of physical block ids;
    query_lens, seq_lens: [B] tokens; num_decodes: leading one-token decodes;
    logits_indices: rows of the step whose logits are sampled;
    blocks_to_copy: copy-on-write (src, dst) pairs applied before the forward;
    prompt_logprobs: the rows whose logits give prompt logprobs (``plan_prompt_logprobs``).
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]
    query_lens: list[int]
    seq_lens: list[int]
    num_decodes: int
    logits_indices: list[int]
    blocks_to_copy: list[tuple[int, int]]
    prompt_logprobs: list[PromptLogprobsRows] = field(default_factory=list)


def prepare_input(sched: SchedulerOutput, block_tables: dict[int, list[int]], block_size: int,
                  faults: FaultSet | None = None) -> StepInput:
    """Flatten a scheduled step into a ``StepInput`` (its ``blocks_to_copy`` left empty: the
    caller applies copy-on-write first, even when this raises).

    Raises:
        SequenceError: the planted fault raise-in-step, for the sequences it names.
    """
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    num_decodes = 0
    planted = faults is not None and faults.active("raise-in-step")
    for item in sched.scheduled:
        seq = item.seq
        if planted and seq.origin.client_tag == "raise-in-step":
            raise SequenceError([seq.seq_id], f"planted fault raise-in-step for {seq.request_id!r}")
        start = seq.num_computed_tokens
        num_new = item.num_new_tokens
        end = start + num_new
        table = block_tables[seq.seq_id]
        if num_new == 1 and end == seq.num_tokens:  # a decode (or a one-token chunk): its last token
            outputs = seq.output_token_ids
            input_ids.append(outputs[-1] if outputs else seq.prompt_token_ids[-1])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            if len(tables) == num_decodes:
                num_decodes += 1
        else:
            input_ids.extend(seq.token_ids_slice(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        query_lens.append(num_new)
        seq_lens.append(end)
        tables.append(table)
        if item.sample:
            logits_indices.append(len(input_ids) - 1)
    return StepInput(input_ids, positions, slots, tables, query_lens, seq_lens, num_decodes, logits_indices, [],
                     plan_prompt_logprobs(sched))


def sample_step(sched: SchedulerOutput, logits: torch.Tensor | None, prompt_logprobs: dict[int, tuple[int, list]],
                generator: torch.Generator) -> StepResult:
    """Sample the step's due sequences from ``logits`` [n_sampled, vocab] float32 (CPU);
    with ``sched.keep_logits`` keep a copy of the raw logits. ``prompt_logprobs``: what
    ``compute_prompt_logprobs`` returned for this step, passed through."""
    sampled = [item.seq for item in sched.scheduled if item.sample]
    if not sampled:
        return StepResult([], SamplerOutput([], []), prompt_logprobs=prompt_logprobs)
    raw = logits.clone() if sched.keep_logits else None
    result = StepResult(sampled, sample(logits, sampled, generator), raw, prompt_logprobs)
    for row, item in enumerate(item for item in sched.scheduled if item.sample):
        if item.num_forks:  # n > 1: the first token of each sample still to fork, from the same logits
            result.forks[item.seq.seq_id] = sample_forks(item.seq, raw[row], item.num_forks, generator)
    return result


def sample_forks(seq: Sequence, logits: torch.Tensor, num_forks: int, generator: torch.Generator) -> ForkSamples:
    """Sample the first token of samples 1..``num_forks`` of ``seq``'s request from ``seq``'s raw
    ``logits`` [vocab] float32: each sample starts where ``seq`` stands (same grammar state,
    tokens and processors), with its own generator when the request is seeded (seed + i, as
    ``Sequence.fork`` gives it) or else the shared ``generator``."""
    seed = seq.sampling_params.seed
    generators = [None if seed is None else torch.Generator().manual_seed(seed + i) for i in range(1, num_forks + 1)]
    sampled = sample(logits.expand(num_forks, -1).clone(), [seq] * num_forks, generator, row_generators=generators)
    return ForkSamples(sampled, generators)


def step_tensors(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """The step's int64 inputs as tensors on ``device``, moved in one copy: the lists are packed
    into one host tensor, pinned and sent with one non-blocking host-to-device copy on CUDA (the
    host does not wait for it; kernels queued after it on the stream see the data), and left as
    they are on CPU. Returns one 1-D int64 view per list, in order, each of that list's length.
    """
    sizes = [len(p) for p in parts]
    flat = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.long)
    if device.type != "cpu":
        if device.type == "cuda":
            flat = flat.pin_memory()  # the caching host allocator keeps it until the copy is done
        flat = flat.to(device, non_blocking=True)
    return list(flat.split(sizes))


def kv_cache_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one physical block takes across all layers' K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize


def build_model(checkpoint: LoadedCheckpoint, max_model_len: int, device: torch.device,
                dtype: torch.dtype, tp: TPGroup | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> LlamaForCausalLM:
    """The checkpoint's weights in a ``LlamaForCausalLM`` on ``device`` in ``dtype``, eval mode
    (rotary tables stay float32). Weights are built on the meta device first: no random init.
    With ``tp`` (tensor parallelism) only this rank's shard is built and read; a checkpoint
    without an in-memory ``state_dict`` is read lazily from its safetensors files.

    Raises:
        ValueError: ``tp.size`` cannot split the model, or a tensor is missing or misshapen.
    """
    if checkpoint.state_dict:
        source = WeightSource.from_state_dict(checkpoint.state_dict)
    else:
        source = WeightSource.from_files(checkpoint_files(checkpoint.path))
    qkv_bias = any(k.endswith("q_proj.bias") for k in source.names())
    with torch.device("meta"):
        model = LlamaForCausalLM(checkpoint.config, max_model_len, qkv_bias=qkv_bias, tp=tp, rope=rope)
    model = model.to_empty(device="cpu")  # skips random init: every weight comes from the checkpoint
    if model.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope_tables()
    model.load_weights(source)
    del source
    model = model.to(device=device, dtype=dtype).eval()
    model.init_rope_tables()  # keep the rotary tables in float32 on the right device
    model.cos_table = model.cos_table.to(device)
    model.sin_table = model.sin_table.to(device)
    return model


class ModelRunner:
    """Runs the model over the paged KV cache.

    Args:
        checkpoint: the loaded weights and config; the model is built here.
        max_model_len: longest sequence, tokens (sizes the rotary tables).
        device, dtype: where and in which precision the model and the KV cache live.
        cpu_gemm: CPU linear-layer GEMM ("vlite" | "onednn" | "torch" | "auto" | None = $VLITE_CPU_GEMM).
        faults: planted faults for the leak checker's self-test.
        tp: this process's rank in a tensor-parallel group (default: one rank, the whole model);
            the runner then holds that rank's shard and KV heads (``vlite/engine/worker/worker.py``).
        rope: precomputed rotary tables (``vlite.engine.worker.models.llama.rope_tables``).

    The KV cache is allocated by ``initialize_kv_cache``: one (K, V) pair per layer, each
    [num_blocks, block_size, num_kv_heads, head_dim] in ``dtype``.

    Raises:
        ValueError: a bad ``VLITE_ATTENTION_BACKEND``, ``VLITE_FUSED_OPS``, ``VLITE_CPU_LAYER_LOOP``,
            ``VLITE_CPU_MALLOC`` or CPU GEMM choice, before anything is loaded.
    """

    def __init__(self, checkpoint: LoadedCheckpoint, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 *, cpu_gemm: str | None = None, faults: FaultSet | None = None, seed: int = 0,
                 tp: TPGroup | None = None, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if device.type == "cpu":
            tune_malloc()  # before the model is built: its buffers come from the tuned heap too
        # every VLITE_* switch is checked before the weights load (seconds), not after
        default_attention_backend()
        default_fused_ops()
        default_layer_loop()
        self.cpu_gemm = resolve_cpu_gemm_backend(cpu_gemm, dtype) if device.type == "cpu" else None
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.faults = faults or FaultSet()
        self.tp = tp or TPGroup()
        self.model = build_model(checkpoint, max_model_len, device, dtype, self.tp, rope)
        # bytes of this rank's weights (before oneDNN prepacking, which keeps the same amount)
        self.weight_bytes = sum(t.numel() * t.element_size()
                                for t in {id(p): p for p in self.model.parameters()}.values())
        # a kernel that needs building is built now, before the first step
        logger.info("attention: %s", prepare_attention_backend(device, default_fused_ops()))
        if self.cpu_gemm in ("onednn", "vlite"):
            self.model.prepack_cpu_gemm(self.cpu_gemm)
        if self.cpu_gemm:
            logger.info("CPU linear layers: %s GEMM (VLITE_CPU_GEMM=vlite|onednn|torch|auto)", self.cpu_gemm)
        self.block_size = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda_graphs = None  # decode CUDA graphs (vlite/engine/worker/cuda_graphs.py), on CUDA only
        # plain greedy steps take their argmax where the logits are (``execute``): on a GPU the
        # [N, vocab] float32 logits (196 KB a row for SmolLM2's vocabulary) then never cross to the host
        self.greedy_on_device = device.type != "cpu"
        self.generator = torch.Generator().manual_seed(seed)

    # ---- set-up --------------------------------------------------------------------------
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one physical block of ``block_size`` tokens takes across all layers' K and V."""
        return kv_cache_bytes_per_block(self.model, block_size, self.dtype)

    def determine_num_blocks(self, cache: CacheConfig, max_num_batched_tokens: int) -> int:
        """Blocks the KV cache gets: ``cache.num_blocks`` if set, else a byte budget
        (``kv_cache_memory_bytes`` on CPU, free memory after a profile forward on CUDA)
        divided by the bytes per block.

        Raises:
            ValueError: the budget holds no block.
        """
        if cache.num_blocks:
            return cache.num_blocks
        per_block = self.kv_cache_bytes_per_block(cache.block_size)
        if self.device.type == "cuda":
            budget = self.profile_cuda_budget(cache.gpu_memory_utilization, cache.block_size,
                                              max_num_batched_tokens)
        else:
            budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        return int(num_blocks)

    def profile_cuda_budget(self, utilization: float, block_size: int, max_num_batched_tokens: int) -> int:
        """Bytes for the KV cache: utilization * total, less torch's peak over a max-size
        forward (weights + activations) and the memory torch's allocator does not hold (CUDA
        context, library workspaces, other processes). The decode CUDA graphs, captured
        afterwards, live in the remaining 1 - utilization."""
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = min(max_num_batched_tokens, self.max_model_len)
        num_blocks = -(-tokens // block_size)
        kept = self.kv_caches, self.block_size
        self._allocate_kv_caches(num_blocks, block_size)  # a throwaway cache just big enough
        seq = Sequence("profile", None, [0] * tokens, SamplingParams(max_tokens=1, temperature=0),
                       RequestOrigin("profile", route="profile"))
        sched = SchedulerOutput(0, [ScheduledSequence(seq, tokens, True)])
        self.execute_model(prepare_input(sched, {seq.seq_id: list(range(num_blocks))}, block_size))
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches, self.block_size = kept
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        return int(total * utilization - peak - non_torch)

    def _allocate_kv_caches(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        shape = (num_blocks, block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(self.model.num_layers)]
        if self.device.type == "cpu":
            self.model.cpu_layer_loop = CpuLayerLoop.build(self.model, self.kv_caches[0])

    def initialize_kv_cache(self, num_blocks: int, block_size: int, *, max_num_seqs: int,
                            enforce_eager: bool = False) -> None:
        """Allocate the KV cache; on CUDA (unless ``enforce_eager``) capture the decode graphs,
        which read this cache."""
        self._allocate_kv_caches(num_blocks, block_size)
        if self.device.type == "cuda" and not enforce_eager:
            if default_attention_backend() == "torch":
                # the torch reference plans each step on the host (sizes, masks): nothing to capture
                logger.info("CUDA graphs off: VLITE_ATTENTION_BACKEND=torch runs every step eagerly")
                return
            from vlite.engine.worker.cuda_graphs import capture_decode_graphs

            self.cuda_graphs = capture_decode_graphs(self.model, self.kv_caches, block_size, max_num_seqs,
                                                     self.max_model_len, self.device)

    # ---- one step ------------------------------------------------------------------------
    def prepare(self, sched: SchedulerOutput, block_tables: dict[int, list[int]]):
        """Flatten the step. Returns (input_ids, positions, AttentionMetadata, logits_indices)."""
        return self.build_metadata(prepare_input(sched, block_tables, self.block_size, self.faults))

    def build_metadata(self, step: StepInput):
        """A ``StepInput`` as tensors on this runner's device, sent in one host-to-device copy
        (``step_tensors``). Returns (input_ids, positions, AttentionMetadata, logits_indices)."""
        tables = step.block_tables
        max_blocks = max(len(t) for t in tables)
        qsl = list(itertools.accumulate(step.query_lens, initial=0))
        flat_tables = [b for t in tables for b in itertools.chain(t, itertools.repeat(0, max_blocks - len(t)))]
        input_ids, positions, slots, query_start_loc, seq_lens, logits_indices, table_flat = step_tensors(
            [step.input_ids, step.positions, step.slot_mapping, qsl, step.seq_lens, step.logits_indices, flat_tables],
            self.device)
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=table_flat.view(len(tables), max_blocks),  # padded with block 0
            num_decodes=step.num_decodes,
            query_lens=step.query_lens,
            seq_lens_list=step.seq_lens,
            block_size=self.block_size,
        )
        return input_ids, positions, meta, logits_indices

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy K/V of block src into block dst in every layer, for each
        (src, dst) pair (``copy_kv_blocks``; the pairs' ids go to the device in one copy each)."""
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        copy_kv_blocks(self.kv_caches, src, dst)

    @torch.inference_mode()
    def execute_model(self, step: StepInput) -> tuple[torch.Tensor | None, dict[int, tuple[int, list]]]:
        """Apply the step's copy-on-write pairs, run the forward over its tokens, and return the
        logits [len(step.logits_indices), vocab] float32 on CPU (None when nothing is sampled,
        and on every rank but 0 under tensor parallelism) and the step's prompt logprobs
        ({seq_id: (first token index, entries)}; {} on ranks other than 0). Every rank must run every step: the
        forward's collectives pair up across ranks."""
        if step.blocks_to_copy:
            self.copy_blocks(step.blocks_to_copy)
        logits, prompt_logprobs = self.compute_logits(step)
        return None if logits is None else logits.cpu(), prompt_logprobs

    def compute_logits(self, step: StepInput) -> tuple[torch.Tensor | None, dict[int, tuple[int, list]]]:
        """``execute_model`` without its copy-on-write and the final move: the logits stay on
        this runner's device. Call inside ``torch.inference_mode``."""
        if not step.input_ids:
            return None, {}
        input_ids, positions, meta, logits_indices = self.build_metadata(step)
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            hidden = self.cuda_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, step.prompt_logprobs)  # {} unless asked
        if not step.logits_indices:
            return None, prompt_logprobs
        return self.model.compute_logits(hidden[logits_indices]), prompt_logprobs

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Run one step in this process: copy-on-write (``sched.blocks_to_copy``), forward over
        all scheduled tokens (through ``sched.block_tables``), then sample where due; with
        ``sched.keep_logits`` also return the raw logits of the sampled rows (for forks and beams).

        Raises:
            SequenceError: a failure tied to specific sequences.
        """
        if sched.blocks_to_copy:
            self.copy_blocks(sched.blocks_to_copy)
        step = prepare_input(sched, sched.block_tables, self.block_size, self.faults)
        logits, prompt_logprobs = self.compute_logits(step)
        if logits is not None and self.greedy_on_device and not sched.keep_logits:
            sampled = [item.seq for item in sched.scheduled if item.sample]
            if plain_greedy(sampled):  # argmax where the logits are: N ids cross, not N x vocab floats
                return StepResult(sampled, argmax_on_device(logits), None, prompt_logprobs)
        return sample_step(sched, None if logits is None else logits.cpu(), prompt_logprobs, self.generator)


__all__ = ["ModelRunner", "SequenceError", "StepInput", "StepResult", "build_model", "copy_kv_blocks", "kv_cache_bytes_per_block",
           "prepare_input", "sample_step", "step_tensors"]
