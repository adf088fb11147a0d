"""LLMEngine: add_request / step / abort / generate over the paged KV cache.

One step = Scheduler.schedule() -> ModelRunner.execute() -> token bookkeeping, detokenization
and stop checks -> RequestOutputs. Every sequence exit goes through
``Scheduler.finish_sequence`` (the one free path), and the engine keeps a bounded record of
finished requests so that the leak checker can name the origin of any block still held.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import torch

from vlite.engine.block_manager import BlockManager, LedgerAnomaly
from vlite.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from vlite.engine.detokenizer import detokenize_incrementally, find_stop_string, init_detokenizer, stop_holdback
from vlite.engine.faults import FaultSet
from vlite.engine.loader import LoadedCheckpoint, load_checkpoint
from vlite.engine.metrics import EngineStats
from vlite.engine.model_runner import ModelRunner, SequenceError, kv_cache_bytes_per_block
from vlite.engine.models.llama import LlamaForCausalLM
from vlite.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.scheduler import Scheduler
from vlite.engine.sequence import FinishReason, RequestOrigin, Sequence, SequenceStatus

logger = logging.getLogger("vlite.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestRejectedError(ValueError):
    """A request the engine will never run (bad input, or it could never fit); nothing was allocated."""


@dataclass
class RequestRecord:
    """What the engine remembers about a request, live or finished (for leak attribution)."""

    seq_id: int
    origin: RequestOrigin
    num_prompt_tokens: int
    status: str = SequenceStatus.WAITING.value
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    finished_time: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class LedgerRecord:
    """A block reference still held, joined with its owner's origin and final state."""

    block_id: int
    seq_id: int
    request_id: str
    site: str
    step: int
    age_s: float
    origin: RequestOrigin | None
    status: str | None
    finish_reason: str | None


_request_counter = itertools.count()


class LLMEngine:
    """The offline/online engine.

    Args:
        config: engine configuration; the model is loaded from ``config.model``.
        checkpoint: an already loaded checkpoint (tests reuse one across engines).

    Raises:
        ModelNotFoundError: the model cannot be found locally.
        ValueError: an invalid configuration.
    """

    def __init__(self, config: EngineConfig | None = None, checkpoint: LoadedCheckpoint | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.faults = FaultSet(config.inject_faults)
        ckpt = checkpoint or load_checkpoint(config.model)
        self.model_name = ckpt.name
        self.tokenizer = ckpt.tokenizer
        self.hf_config = ckpt.config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _DTYPES[config.dtype]
        self.max_model_len = self._derive_max_model_len()
        torch.manual_seed(config.seed)
        qkv_bias = any(k.endswith("q_proj.bias") for k in ckpt.state_dict)
        with torch.device("meta"):
            model = LlamaForCausalLM(ckpt.config, self.max_model_len, qkv_bias=qkv_bias)
        model = model.to_empty(device="cpu")  # skips random init: every weight comes from the checkpoint
        if model.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.init_rope_tables()
        model.load_hf_state_dict(ckpt.state_dict)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.init_rope_tables()  # keep the rotary tables in float32 on the right device
        self.model.cos_table = self.model.cos_table.to(self.device)
        self.model.sin_table = self.model.sin_table.to(self.device)
        self.eos_token_ids = self._eos_token_ids()

        cache = config.cache
        self.block_size = cache.block_size
        self.bytes_per_block = kv_cache_bytes_per_block(self.model, cache.block_size, self.dtype)
        num_blocks = cache.num_blocks or self._size_kv_cache()
        self.block_manager = BlockManager(num_blocks, cache.block_size, enable_ledger=config.enable_ledger,
                                          faults=self.faults)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.faults)
        self.model_runner = ModelRunner(self.model, num_blocks, cache.block_size, self.device, self.dtype,
                                        self.faults, seed=config.seed)
        if self.device.type == "cuda" and not config.enforce_eager:
            from vlite.engine.cuda_graphs import capture_decode_graphs

            self.model_runner.cuda_graphs = capture_decode_graphs(
                self.model, self.model_runner.kv_caches, cache.block_size, config.scheduler.max_num_seqs,
                self.max_model_len, self.device)
        self._records: dict[int, RequestRecord] = {}
        self._finished_order: OrderedDict[int, None] = OrderedDict()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ---- set-up helpers ------------------------------------------------------------------
    def _derive_max_model_len(self) -> int:
        limit = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        window = getattr(self.hf_config, "sliding_window", None)
        if window and getattr(self.hf_config, "use_sliding_window", True):
            limit = min(limit, int(window))  # no sliding-window attention: stay inside the window
        asked = self.config.scheduler.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds the model's limit of {limit} tokens")
        return asked or limit

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (getattr(self.hf_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return frozenset(ids)

    def _size_kv_cache(self) -> int:
        """Blocks from the byte budget (CPU) or from free device memory after a profile run (CUDA)."""
        cache = self.config.cache
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget(cache.gpu_memory_utilization)
        else:
            budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {self.bytes_per_block} bytes")
        return int(num_blocks)

    def _profile_cuda_budget(self, utilization: float) -> int:
        """Bytes for the KV cache: utilization * total, less torch's peak over a max-size
        forward (weights + activations) and the memory torch's allocator does not hold (CUDA
        context, library workspaces, other processes). The decode CUDA graphs, captured
        afterwards, live in the remaining 1 - utilization."""
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        runner = ModelRunner(self.model, self.block_manager_blocks_for(tokens), self.block_size, self.device,
                             self.dtype)
        from vlite.engine.scheduler import ScheduledSequence, SchedulerOutput

        seq = Sequence("profile", None, [0] * tokens, SamplingParams(max_tokens=1, temperature=0),
                       RequestOrigin("profile", route="profile"))
        table = list(range(self.block_manager_blocks_for(tokens)))
        runner.execute(SchedulerOutput(0, [ScheduledSequence(seq, tokens, True)]), {seq.seq_id: table})
        peak = torch.cuda.max_memory_allocated(self.device)
        del runner
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        return int(total * utilization - peak - non_torch)

    def block_manager_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                    origin: RequestOrigin | None = None) -> str:
        """Queue one request; returns its request id.

        Args:
            prompt: text to tokenize (with the tokenizer's special tokens), or None with
                ``prompt_token_ids``.
            sampling_params: defaults to ``SamplingParams()``.
            request_id: defaults to ``origin.request_id`` or a fresh uuid.
            origin: who sent it; defaults to route "api".

        Raises:
            RequestRejectedError: empty prompt, token ids outside the vocabulary, a duplicate
                live request id, or a request that can never fit (prompt + max_tokens beyond
                max_model_len or beyond the whole KV cache). Nothing is allocated.
        """
        params = sampling_params or SamplingParams()
        if request_id is None:
            request_id = origin.request_id if origin else f"req-{next(_request_counter)}-{uuid.uuid4().hex[:8]}"
        if origin is None:
            origin = RequestOrigin(request_id)
        elif origin.request_id != request_id:
            raise RequestRejectedError(f"origin.request_id {origin.request_id!r} != request_id {request_id!r}")
        if prompt_token_ids is None:
            if not isinstance(prompt, str) or not prompt:
                raise RequestRejectedError("prompt must be a non-empty string (or give prompt_token_ids)")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        prompt_token_ids = list(prompt_token_ids)
        if not prompt_token_ids:
            raise RequestRejectedError("prompt is empty: at least one token is required")
        vocab = self.hf_config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        self._check_fits(len(prompt_token_ids), params)
        if request_id in self.scheduler.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use by a live request")
        seq = Sequence(request_id, prompt, prompt_token_ids, params, origin, self.eos_token_ids)
        init_detokenizer(seq)
        self.scheduler.add_sequence(seq)
        self._records[seq.seq_id] = RequestRecord(seq.seq_id, origin, seq.num_prompt_tokens)
        return request_id

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejectedError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {total} ({num_prompt_tokens} prompt + {params.max_tokens} max_tokens); "
                "shorten the prompt or lower max_tokens")
        needed = self.block_manager.num_required_blocks(total)
        if needed > self.block_manager.num_total_blocks:
            raise RequestRejectedError(
                f"the request needs {needed} KV blocks ({total} tokens at block_size {self.block_size}) but the "
                f"whole KV cache has {self.block_manager.num_total_blocks}; lower max_tokens or raise --num-blocks")

    def abort(self, request_id: str) -> bool:
        """Abort a live request in any state; its blocks go back to the free list.

        Returns False if no live request has that id (already finished or unknown).
        Raises:
            PlantedFault: only with the planted ``skip-free-on-abort`` fault.
        """
        seq = self.scheduler.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        try:
            self.scheduler.finish_sequence(seq, FinishReason.ABORT)
        finally:
            self._record_finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return an output for every request that advanced or ended."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        for seq in sched.preempted:
            self._records[seq.seq_id].num_preemptions = seq.num_preemptions
        try:
            result = self.model_runner.execute(sched, self.block_manager.block_tables)
        except SequenceError as exc:
            failed = set(exc.seq_ids)
            return [self._finish(item.seq, FinishReason.ERROR, error=str(exc))
                    for item in sched.scheduled if item.seq.seq_id in failed]
        except Exception as exc:  # a failed forward ends this batch's requests, not the engine
            logger.exception("step %d failed", sched.step)
            return [self._finish(item.seq, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")
                    for item in sched.scheduled]

        now = time.time()
        outputs: list[RequestOutput] = []
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.seq.num_output_tokens == 0:
                self.prompt_tokens_total += item.num_new_tokens
        for seq, token, logprobs in zip(result.sampled_seqs, result.sampler_output.token_ids,
                                        result.sampler_output.logprobs):
            outputs.append(self._append_token(seq, token, logprobs, now))
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None,
                      now: float) -> RequestOutput:
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        new_text = detokenize_incrementally(self.tokenizer, seq)
        p = seq.sampling_params
        done = seq.num_output_tokens >= p.min_tokens
        if done and token in p.stop_token_ids:
            return self._finish(seq, FinishReason.STOP, stop_reason=token, new_token=token)
        if done and not p.ignore_eos and token in seq.eos_token_ids:
            return self._finish(seq, FinishReason.STOP, new_token=token)
        stop = find_stop_string(seq, len(new_text)) if done else None
        if stop is not None:
            return self._finish(seq, FinishReason.STOP, stop_reason=stop, new_token=token)
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, FinishReason.LENGTH, new_token=token)
        return self._make_output(seq, [token])

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None,
                error: str | None = None, new_token: int | None = None) -> RequestOutput:
        try:
            self.scheduler.finish_sequence(seq, reason, stop_reason, error)
        finally:
            self._record_finish(seq)
        return self._make_output(seq, [] if new_token is None else [new_token])

    def _record_finish(self, seq: Sequence) -> None:
        rec = self._records.get(seq.seq_id)
        if rec is None:
            return
        rec.status = seq.status.value
        rec.finish_reason = seq.finish_reason.value if seq.finish_reason else None
        rec.num_output_tokens = seq.num_output_tokens
        rec.num_preemptions = seq.num_preemptions
        rec.finished_time = seq.finished_time
        rec.error = seq.error
        self._finished_order[seq.seq_id] = None
        while len(self._finished_order) > self.config.finished_history:
            old, _ = self._finished_order.popitem(last=False)
            self._records.pop(old, None)

    def _make_output(self, seq: Sequence, new_token_ids: list[int]) -> RequestOutput:
        finished = seq.is_finished
        completion = CompletionOutput(
            index=0, text=seq.output_text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason.value if finished and seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None)
        metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                                 seq.last_token_time, seq.finished_time, seq.num_preemptions)
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion], finished,
                             seq.origin, metrics, error=seq.error,
                             stream_holdback=0 if finished else stop_holdback(seq),
                             new_token_ids=new_token_ids)

    # ---- offline batch -------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]], sampling_params: SamplingParams | list[SamplingParams]
                 | None = None, *, show_progress: bool = False) -> list[RequestOutput]:
        """Run a batch to completion with continuous batching; outputs in prompt order.

        ``prompts`` are strings or lists of token ids. Raises RequestRejectedError before
        anything runs if any prompt is invalid (nothing queued stays behind).
        """
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                if isinstance(prompt, str):
                    ids.append(self.add_request(prompt, p, origin=None))
                else:
                    ids.append(self.add_request(None, p, prompt_token_ids=list(prompt)))
        except Exception:
            for rid in ids:
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        progress = None
        if show_progress:
            from rich.progress import Progress

            progress = Progress(transient=True)
            task = progress.add_task("Generating", total=len(ids))
            progress.start()
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
                        if progress:
                            progress.advance(task)
        finally:
            if progress:
                progress.stop()
        return [final[rid] for rid in ids]

    # ---- read-only views for metrics and diagnostics -------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            step=self.scheduler.step_counter,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_live_requests=len(self.scheduler.requests),
            blocks=self.block_manager.stats(),
        )

    def ledger(self) -> list[LedgerRecord]:
        """Every block reference still held, with its owner's origin (oldest first)."""
        now = time.time()
        out = []
        for e in self.block_manager.ledger.held():
            rec = self._records.get(e.seq_id)
            out.append(LedgerRecord(e.block_id, e.seq_id, e.request_id, e.site.value, e.step, now - e.time,
                                    rec.origin if rec else None, rec.status if rec else None,
                                    rec.finish_reason if rec else None))
        return out

    def ledger_anomalies(self) -> list[LedgerAnomaly]:
        return self.block_manager.ledger.anomalies()

    def request_record(self, seq_id: int) -> RequestRecord | None:
        return self._records.get(seq_id)

    def live_state(self) -> dict[str, list]:
        """Per-request CPU-side state, for leak checks: ids of live requests and block tables,
        and which block tables belong to sequences that already finished."""
        live_seq_ids = {s.seq_id for s in self.scheduler.requests.values()}
        tables = list(self.block_manager.block_tables)
        return {
            "live_request_ids": list(self.scheduler.requests),
            "block_table_seq_ids": tables,
            "orphan_block_tables": [sid for sid in tables if sid not in live_seq_ids],
            "finished_live_requests": [rid for rid, s in self.scheduler.requests.items() if s.is_finished],
        }

    def block_tables_view(self) -> dict[int, list[int]]:
        return {sid: list(t) for sid, t in self.block_manager.block_tables.items()}

    def ref_counts(self) -> list[int]:
        return self.block_manager.ref_counts()

    def request_progress(self, request_id: str) -> dict[str, int | str] | None:
        """Where a live request is, for clients that inject aborts at a given phase.

        Returns None if no live request has that id; else ``status`` (waiting | running |
        preempted | finished), ``seq_id``, and token counts ``num_prompt_tokens``,
        ``num_computed_tokens`` (K/V in the cache), ``num_output_tokens``, plus
        ``num_preemptions`` and ``num_blocks`` (blocks in its block table).
        """
        seq = self.scheduler.requests.get(request_id)
        if seq is None:
            return None
        return {"status": seq.status.value, "seq_id": seq.seq_id, "num_prompt_tokens": seq.num_prompt_tokens,
                "num_computed_tokens": seq.num_computed_tokens, "num_output_tokens": seq.num_output_tokens,
                "num_preemptions": seq.num_preemptions,
                "num_blocks": len(self.block_manager.get_block_table(seq.seq_id))}
