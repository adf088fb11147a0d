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
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from vlite.engine.beam_search import BeamState
from vlite.engine.block_manager import BlockManager, LedgerAnomaly
from vlite.engine.config import EngineConfig
from vlite.engine.detokenizer import detokenize_incrementally, find_stop_string, init_detokenizer, stop_holdback
from vlite.engine.faults import FaultSet
from vlite.engine.introspection import EngineView
from vlite.engine.loader import LoadedCheckpoint, load_checkpoint
from vlite.engine.metrics import EngineStats
from vlite.engine.model_runner import ModelRunner, SequenceError
from vlite.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vlite.engine.sampler import sample
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


@dataclass
class RequestGroup:
    """The sequences of one request: 1, n (parallel sampling) or the beams of a beam search."""

    request_id: str
    params: SamplingParams
    origin: RequestOrigin
    seqs: list[Sequence]
    beam: BeamState | None = None
    _next_index: int = 1
    num_reported_tokens: int = 0  # output tokens of seqs[0] already returned in a RequestOutput

    @property
    def needs_logits(self) -> bool:
        """Raw logits are needed to fork n samples after the prompt, or to rank beams."""
        return self.beam is not None or (self.params.n > 1 and len(self.seqs) == 1)

    def next_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1


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


def _finish_kind(seq: Sequence) -> str:
    """The coverage name of how ``seq`` ended: "stop:eos", "stop:stop_token", "stop:stop_string",
    "stop" (other), "length", "abort" or "error"."""
    reason = seq.finish_reason
    if reason is not FinishReason.STOP:
        return reason.value
    if isinstance(seq.stop_reason, str):
        return "stop:stop_string"
    if isinstance(seq.stop_reason, int):
        return "stop:stop_token"
    if seq.output_token_ids and seq.output_token_ids[-1] in seq.eos_token_ids:
        return "stop:eos"
    return "stop"


def _abort_state(seq: Sequence) -> str:
    """The state an aborted sequence was in: waiting, preempted, prefill, decode, or resumed
    (running again after a preemption)."""
    if seq.status is SequenceStatus.WAITING:
        return "waiting"
    if seq.status is SequenceStatus.PREEMPTED:
        return "preempted"
    if seq.status is SequenceStatus.RUNNING:
        if seq.num_preemptions:
            return "resumed"
        return "prefill" if seq.in_prefill and not seq.num_output_tokens else "decode"
    return seq.status.value


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
        self.model_runner = ModelRunner(ckpt, self.max_model_len, self.device, self.dtype, cpu_gemm=config.cpu_gemm,
                                        faults=self.faults, seed=config.seed)
        self.model = self.model_runner.model
        self.cpu_gemm = self.model_runner.cpu_gemm
        self.eos_token_ids = self._eos_token_ids()

        cache = config.cache
        self.block_size = cache.block_size
        self.bytes_per_block = self.model_runner.kv_cache_bytes_per_block(cache.block_size)
        num_blocks = self.model_runner.determine_num_blocks(cache, config.scheduler.max_num_batched_tokens)
        self.model_runner.initialize_kv_cache(num_blocks, cache.block_size,
                                              max_num_seqs=config.scheduler.max_num_seqs,
                                              enforce_eager=config.enforce_eager)
        self.block_manager = BlockManager(num_blocks, cache.block_size, enable_ledger=config.enable_ledger,
                                          faults=self.faults, enable_prefix_caching=cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.faults)
        self._records: dict[int, RequestRecord] = {}
        self._groups: dict[str, RequestGroup] = {}
        self._finished_order: OrderedDict[int, None] = OrderedDict()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Coverage counters (read through vlite.engine.introspection.EngineView): sequences
        # finished by kind ("stop:eos", "stop:stop_token", "stop:stop_string",
        # "stop:beam_pruned", "length", "abort", "error"), beams pruned, and aborted sequences by
        # the state they were in ("waiting", "prefill", "decode", "preempted", "resumed").
        self.finish_counts: Counter[str] = Counter()
        self.num_beam_prunes = 0
        self.abort_states: Counter[str] = Counter()

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
        group = RequestGroup(request_id, params, origin, [seq])
        if params.beam_width > 1:
            group.beam = BeamState(params.beam_width, params.length_penalty, params.max_tokens,
                                   frozenset() if params.ignore_eos else self.eos_token_ids, running=[seq])
        self.scheduler.add_sequence(seq)
        self._groups[request_id] = group
        self._records[seq.seq_id] = RequestRecord(seq.seq_id, origin, seq.num_prompt_tokens)
        return request_id

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejectedError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request "
                f"asks for {total} ({num_prompt_tokens} prompt + {params.max_tokens} max_tokens); "
                "shorten the prompt or lower max_tokens")
        # n samples or W beams must be able to hold their blocks at the same time.
        width = max(params.n, params.beam_width)
        needed = width * self.block_manager.num_required_blocks(total)
        if needed > self.block_manager.num_total_blocks:
            raise RequestRejectedError(
                f"the request needs {needed} KV blocks ({width} x {total} tokens at block_size {self.block_size}) but "
                f"the whole KV cache has {self.block_manager.num_total_blocks}; lower max_tokens or raise --num-blocks")

    def abort(self, request_id: str) -> bool:
        """Abort a live request (every sequence of it) in any state; its blocks go back to
        the free list.

        Returns False if no live request has that id (already finished or unknown).
        Raises:
            PlantedFault: only with the planted ``skip-free-on-abort`` fault.
        """
        seqs = list(self.scheduler.requests.get(request_id, ()))
        if not seqs:
            return False
        for seq in seqs:
            self.abort_states[_abort_state(seq)] += 1
        try:
            self.scheduler.abort(request_id)
        finally:
            for seq in seqs:
                self._record_finish(seq)
            self._groups.pop(request_id, None)
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
        copies = self.block_manager.take_pending_copies()
        if copies:
            self.model_runner.copy_blocks(copies)
        keep_logits = any(self._groups[item.seq.request_id].needs_logits for item in sched.scheduled if item.sample)
        try:
            result = self.model_runner.execute(sched, self.block_manager.block_tables, keep_logits)
        except SequenceError as exc:
            failed = set(exc.seq_ids)
            return self._fail([item.seq for item in sched.scheduled if item.seq.seq_id in failed], str(exc))
        except Exception as exc:  # a failed forward ends this batch's requests, not the engine
            logger.exception("step %d failed", sched.step)
            return self._fail([item.seq for item in sched.scheduled], f"{type(exc).__name__}: {exc}")

        now = time.time()
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_output_tokens == 0:
                self.prompt_tokens_total += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
        touched: dict[str, RequestGroup] = {}
        sampled = result.sampler_output
        for row, seq in enumerate(result.sampled_seqs):
            group = self._groups[seq.request_id]
            touched[group.request_id] = group
            if group.beam is not None:
                group.beam.pending[seq.seq_id] = result.logits[row]
                continue
            if group.params.n > 1 and len(group.seqs) == 1:
                self._fork_samples(group, seq, result.logits[row], now)
            self._append_token(seq, sampled.token_ids[row], sampled.logprobs[row], now)
        for group in touched.values():
            if group.beam is not None and group.beam.ready:
                self._beam_step(group, now)
        outputs = [self._make_output(g) for g in touched.values()]
        for out in outputs:
            if out.finished:
                self._groups.pop(out.request_id, None)
        return outputs

    def _fail(self, seqs: list[Sequence], error: str) -> list[RequestOutput]:
        """End whole requests with finish_reason error (every sequence of them)."""
        groups = {s.request_id: self._groups[s.request_id] for s in seqs}
        for group in groups.values():
            for seq in list(self.scheduler.requests.get(group.request_id, ())):
                self._finish(seq, FinishReason.ERROR, error=error)
            if group.beam is not None:
                group.beam.done = True
        outputs = [self._make_output(g) for g in groups.values()]
        for rid in groups:
            self._groups.pop(rid, None)
        return outputs

    def _fork_samples(self, group: RequestGroup, parent: Sequence, logits: torch.Tensor, now: float) -> None:
        """Parallel sampling: after the prompt, fork n - 1 children that share its blocks, and
        sample each child's first token from the same logits."""
        children = [parent.fork(i) for i in range(1, group.params.n)]
        for child in children:
            self.block_manager.fork(parent, child)
            self.scheduler.add_forked(child)
            self._records[child.seq_id] = RequestRecord(child.seq_id, group.origin, child.num_prompt_tokens,
                                                        status=child.status.value)
        group.seqs.extend(children)
        first = sample(logits.expand(len(children), -1).clone(), children, self.model_runner.generator)
        for child, token, logprobs in zip(children, first.token_ids, first.logprobs):
            self._append_token(child, token, logprobs, now)

    def _beam_step(self, group: RequestGroup, now: float) -> None:
        """Advance a beam search: fork beams chosen more than once, prune beams not chosen."""
        beam = group.beam
        continuations = beam.step()
        by_parent: dict[int, list] = {}
        for c in continuations:
            by_parent.setdefault(c.parent.seq_id, []).append(c)
        next_running: list[Sequence] = []
        for parent in beam.running:
            conts = by_parent.get(parent.seq_id, [])
            extra = []
            for c in conts[1:]:  # fork before the parent takes its own token
                child = parent.fork(group.next_index())
                self.block_manager.fork(parent, child)
                self.scheduler.add_forked(child)
                self._records[child.seq_id] = RequestRecord(child.seq_id, group.origin, child.num_prompt_tokens,
                                                            status=child.status.value)
                group.seqs.append(child)
                extra.append((child, c))
            for seq, c in ([(parent, conts[0])] if conts else []) + extra:
                seq.output_token_ids.append(c.token)
                seq.cumulative_logprob = c.cumulative_logprob
                seq.last_token_time = now
                seq.first_token_time = seq.first_token_time or now
                next_running.append(seq)
                self.generation_tokens_total += 1
        for parent in beam.running:
            if parent.seq_id not in by_parent:
                self.num_beam_prunes += 1
                self._finish(parent, FinishReason.STOP, kind="stop:beam_pruned")  # pruned: the one free path
        beam.running = next_running
        if beam.done:
            for seq in next_running:
                self._finish(seq, FinishReason.LENGTH)
            beam.running = []

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
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
            self._finish(seq, FinishReason.STOP, stop_reason=token)
        elif done and not p.ignore_eos and token in seq.eos_token_ids:
            self._finish(seq, FinishReason.STOP)
        elif (stop := find_stop_string(seq, len(new_text)) if done else None) is not None:
            self._finish(seq, FinishReason.STOP, stop_reason=stop)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None,
                error: str | None = None, kind: str | None = None) -> None:
        try:
            self.scheduler.finish_sequence(seq, reason, stop_reason, error)
        finally:
            self._record_finish(seq, kind)

    def _record_finish(self, seq: Sequence, kind: str | None = None) -> None:
        rec = self._records.get(seq.seq_id)
        if rec is None:
            return
        if rec.finish_reason is None and seq.finish_reason is not None:
            self.finish_counts[kind or _finish_kind(seq)] += 1
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

    def _make_output(self, group: RequestGroup) -> RequestOutput:
        """The request's state: one CompletionOutput per sample (by index), or the best beams
        once a beam search is done. Timestamps span all of the request's sequences."""
        primary = group.seqs[0]
        if group.beam is not None:
            finished = group.beam.done
            completions = self._beam_completions(group) if finished else []
        else:
            finished = all(s.is_finished for s in group.seqs)
            completions = [self._completion(s) for s in sorted(group.seqs, key=lambda s: s.index)]
        first_tokens = [s.first_token_time for s in group.seqs if s.first_token_time]
        last_tokens = [s.last_token_time for s in group.seqs if s.last_token_time]
        finishes = [s.finished_time for s in group.seqs if s.finished_time]
        metrics = RequestMetrics(primary.arrival_time, primary.first_scheduled_time,
                                 min(first_tokens, default=None), max(last_tokens, default=None),
                                 max(finishes) if finished and finishes else None,
                                 sum(s.num_preemptions for s in group.seqs))
        new_token_ids = primary.output_token_ids[group.num_reported_tokens:] if group.beam is None else []
        group.num_reported_tokens = primary.num_output_tokens
        return RequestOutput(group.request_id, primary.prompt, primary.prompt_token_ids, completions, finished,
                             group.origin, metrics, error=next((s.error for s in group.seqs if s.error), None),
                             stream_holdback=0 if finished else stop_holdback(primary),
                             new_token_ids=new_token_ids)

    @staticmethod
    def _completion(seq: Sequence) -> CompletionOutput:
        finished = seq.is_finished
        return CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason.value if finished and seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None)

    def _beam_completions(self, group: RequestGroup) -> list[CompletionOutput]:
        if any(s.finish_reason is FinishReason.ERROR for s in group.seqs):
            return [self._completion(group.seqs[0])]
        return [CompletionOutput(index=i, text=self.tokenizer.decode(h.token_ids, skip_special_tokens=True),
                                 token_ids=h.token_ids, finish_reason="stop" if h.ends_with_eos else "length",
                                 cumulative_logprob=h.score)
                for i, h in enumerate(group.beam.best(group.params.n))]

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
            coverage=EngineView(self).coverage(),
        )

    def _live_sequences(self) -> dict[int, Sequence]:
        return {s.seq_id: s for seqs in self.scheduler.requests.values() for s in seqs}

    def ledger(self) -> list[LedgerRecord]:
        """Every block reference still held, with its owner's origin and current (or final)
        status (oldest first)."""
        now = time.time()
        live = self._live_sequences()
        out = []
        for e in self.block_manager.ledger.held():
            rec = self._records.get(e.seq_id)
            seq = live.get(e.seq_id)
            status = seq.status.value if seq else (rec.status if rec else None)
            out.append(LedgerRecord(e.block_id, e.seq_id, e.request_id, e.site.value, e.step, now - e.time,
                                    rec.origin if rec else None, status, rec.finish_reason if rec else None))
        return out

    def sequences_view(self) -> list[dict]:
        """Every live sequence (all samples and beams of every request): ids, index, status,
        token counts (tokens) and block table. A read-only copy."""
        tables = self.block_manager.block_tables
        return [{"seq_id": s.seq_id, "request_id": s.request_id, "index": s.index, "status": s.status.value,
                 "parent_seq_id": s.parent_seq_id, "num_prompt_tokens": s.num_prompt_tokens,
                 "num_computed_tokens": s.num_computed_tokens, "num_output_tokens": s.num_output_tokens,
                 "num_preemptions": s.num_preemptions, "block_table": list(tables.get(s.seq_id, ())),
                 "origin": s.origin}
                for s in self._live_sequences().values()]

    def ledger_anomalies(self) -> list[LedgerAnomaly]:
        return self.block_manager.ledger.anomalies()

    def request_record(self, seq_id: int) -> RequestRecord | None:
        return self._records.get(seq_id)

    def live_state(self) -> dict[str, list]:
        """Per-request CPU-side state, for leak checks: ids of live requests and block tables,
        and which block tables belong to sequences that already finished."""
        live_seq_ids = set(self._live_sequences())
        tables = list(self.block_manager.block_tables)
        return {
            "live_request_ids": list(self.scheduler.requests),
            "block_table_seq_ids": tables,
            "orphan_block_tables": [sid for sid in tables if sid not in live_seq_ids],
            "finished_live_requests": [rid for rid, seqs in self.scheduler.requests.items()
                                       if any(s.is_finished for s in seqs)],
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
        seqs = self.scheduler.requests.get(request_id)
        if not seqs:
            return None
        seq = seqs[0]
        return {"status": seq.status.value, "seq_id": seq.seq_id, "num_prompt_tokens": seq.num_prompt_tokens,
                "num_computed_tokens": seq.num_computed_tokens, "num_output_tokens": seq.num_output_tokens,
                "num_preemptions": seq.num_preemptions,
                "num_blocks": len(self.block_manager.get_block_table(seq.seq_id))}
