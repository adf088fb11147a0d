"""Continuous-batching scheduler with chunked prefill and recompute preemption.

Each step spends a token budget (``max_num_batched_tokens``): running sequences first (a
decode costs 1 token, an unfinished prefill its next chunk), then waiting sequences in
arrival order while the budget, ``max_num_seqs`` and the free blocks allow. When a running
sequence cannot get a block, the most recently arrived running sequence is preempted: its
blocks are freed and it goes back to the front of the waiting queue to be recomputed
(vLLM's recompute preemption; see vLLM docs, "Preemption").

After the runner has run a step, ``update_from_output`` does the bookkeeping (vLLM v1's
``Scheduler.update_from_output``): advance computed tokens, cache full blocks, append the
sampled tokens, check stops, fork parallel samples and beams, finish. Every way a sequence
ends goes through ``finish_sequence``, the one free path, which also writes the sequence's
final ``RequestRecord`` (kept in a bounded history for leak attribution).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from vlite.engine.config import CacheConfig, SchedulerConfig
from vlite.engine.core.detokenizer import find_stop_string
from vlite.engine.core.kv_cache_manager import KVCacheManager
from vlite.engine.core.ledger import AllocationSite
from vlite.engine.core.prompt_logprobs import needs_prompt_logprobs, record_prompt_logprobs
from vlite.engine.core.request import Request, RequestRecord
from vlite.engine.core.request_features import request_family, request_features
from vlite.engine.core.sched_output import ForkSamples, ScheduledSequence, SchedulerOutput, StepResult
from vlite.engine.core.sequence import FinishReason, Sequence, SequenceStatus
from vlite.engine.core.structured_output import StructuredOutputManager
from vlite.engine.metrics import SchedulerStats

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns a request's life: the waiting and running queues, each step's batch, the
    bookkeeping after the forward, and every finish.

    Args:
        config: token budget, ``max_num_seqs``; ``max_model_len`` (tokens) ends a sequence
            with finish reason "length" (``max_model_len`` argument overrides the config's).
        cache_config: the KV cache's ``block_size`` (tokens) and ``enable_prefix_caching``.
        num_blocks: physical KV blocks (the model runner sized the cache).
        enable_ledger: record every block allocation (off only to measure its cost).
        detokenize: appends the text of a sequence's newest tokens to ``seq.output_text`` and
            returns the new text (the output processor's), called after each token of a
            sequence with stop strings; None = no stop strings checked.
        finished_history: finished sequences whose records are kept for attribution.
        structured_output: the grammar compiler cache and per-sequence matchers (structured
            output); None: a manager without a tokenizer (constrained requests are refused).
    """

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 *, enable_ledger: bool = True, max_model_len: int | None = None,
                 detokenize: Callable[[Sequence], str] | None = None,
                 finished_history: int = 10_000, structured_output: StructuredOutputManager | None = None):
        self.config = config
        # The scheduler builds and alone talks to the block manager (as vLLM v1's scheduler
        # builds its KV cache manager); ``EngineView`` only reads it.
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size, enable_ledger=enable_ledger,
                                               enable_prefix_caching=cache_config.enable_prefix_caching)
        self.max_model_len = max_model_len or config.max_model_len or 1 << 62
        self.detokenize = detokenize
        self.finished_history = finished_history
        self.structured_output = structured_output or StructuredOutputManager()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}  # live requests by request id
        self.finished_records: OrderedDict[int, RequestRecord] = OrderedDict()  # by seq id, oldest first
        self.step_counter = 0
        self.stats = SchedulerStats()  # the coverage and token counters (make_stats)

    # ---- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (its first sequence waits).

        Raises:
            ValueError: a live request already has that id, or its structured-output
                constraint does not compile.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use by a live request")
        try:
            for seq in request.live:
                self.structured_output.add(seq)
        except Exception:
            for seq in request.live:
                self.structured_output.free(seq)
            raise
        self.requests[request.request_id] = request
        self.waiting.extend(request.live)
        self.stats.feature_counts.update(request_features(request.params))

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a new request made of one sequence (no beam search)."""
        self.add_request(Request.of(seq))

    def add_forked(self, child: Sequence) -> None:
        """Add a sequence forked from a running one (it already shares the parent's blocks);
        it continues from its parent's grammar state (structured output)."""
        req = self.requests[child.request_id]
        parent = next((s for s in req.live if s.seq_id == child.parent_seq_id), None)
        if parent is not None:
            self.structured_output.fork(parent, child)
        req.add_sequence(child)
        self.running.append(child)

    def num_blocks_for(self, num_tokens: int, width: int = 1) -> tuple[int, int]:
        """(blocks ``width`` sequences of ``num_tokens`` tokens need, blocks in the whole cache)."""
        bm = self.kv_cache_manager
        return width * bm.num_required_blocks(num_tokens), bm.num_total_blocks

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the counters (``SchedulerStats``) for metrics and the diagnostics."""
        return self.stats.copy()

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose the next step's batch within ``max_num_batched_tokens`` tokens.

        In order: (1) the running sequences, oldest first, each gets its next chunk (one token
        for a decode, up to the budget for a prefill); when its blocks do not fit, the latest
        arrival is preempted (recompute: blocks freed, requeued at the front of ``waiting``)
        until they do. (2) Only if nothing was preempted, waiting sequences join in arrival
        order while the budget, ``max_num_seqs`` and the free blocks allow, after a prefix-cache
        lookup. (3) If nothing could run because every running sequence is a beam waiting for
        a sibling without blocks, all of them are preempted (no deadlock).

        Returns the ``SchedulerOutput``: decodes first, then prefill chunks, with their block
        tables, the copy-on-write pairs to apply first, and for each sequence whose prompt
        ends with n > 1 samples still to fork, ``num_forks`` (the runner samples their first
        tokens). An empty output means nothing can run now.
        """
        self.step_counter += 1
        self.kv_cache_manager.current_step = self.step_counter
        out = SchedulerOutput(step=self.step_counter)
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens, num_computed = seq.num_tokens, seq.num_computed_tokens
            num_new = min(num_tokens - num_computed, budget)
            if num_new == 0:  # a beam waiting for its siblings' logits
                i += 1
                continue
            in_prefill = num_computed < num_tokens - 1
            site = AllocationSite.PREFILL if in_prefill else AllocationSite.DECODE_APPEND
            while not self.kv_cache_manager.allocate_slots(seq, num_new, site):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                item = ScheduledSequence(seq, num_new, num_computed + num_new == num_tokens)
                (prefills if in_prefill else decodes).append(item)
                budget -= num_new
                i += 1

        # New work joins only when nothing had to be preempted this step.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            # no cached prefix for a prompt whose logprobs are still missing: it is recomputed
            skip_cache = needs_prompt_logprobs(seq)
            hits = [] if skip_cache else self.kv_cache_manager.find_prefix_hits(seq)
            num_cached = len(hits) * self.kv_cache_manager.block_size
            num_new = min(seq.num_tokens - num_cached - seq.num_computed_tokens, budget)
            if not self.kv_cache_manager.allocate_slots(seq, num_new, AllocationSite.PREFILL, hits):
                break
            if seq.num_computed_tokens == 0 and not skip_cache:
                self.kv_cache_manager.prefix_cache_queries += seq.num_tokens
                self.kv_cache_manager.prefix_cache_hits += num_cached
            seq.num_computed_tokens += num_cached
            self.waiting.popleft()
            if seq.status is SequenceStatus.PREEMPTED:
                self.stats.num_resumptions_total += 1
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
            self.running.append(seq)
            prefills.append(ScheduledSequence(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens))
            budget -= num_new

        if not decodes and not prefills and self.running and self.waiting:
            # Every running sequence is a beam waiting for a sibling that cannot get blocks:
            # preempt them all, so the front of the waiting queue can run (no deadlock).
            for seq in reversed(self.running):
                self._preempt(seq)
                out.preempted.append(seq)
            self.running.clear()
            # Siblings next to each other, so a whole group is admitted together.
            order = {rid: i for i, rid in enumerate(dict.fromkeys(s.request_id for s in self.waiting))}
            self.waiting = deque(sorted(self.waiting, key=lambda s: order[s.request_id]))
        out.scheduled = decodes + prefills
        tables = self.kv_cache_manager.block_tables
        requests = self.requests
        for item in out.scheduled:
            seq = item.seq
            out.block_tables[seq.seq_id] = tables[seq.seq_id]
            if item.sample:
                req = requests[seq.request_id]
                if req.needs_logits:  # raw logits to rank beams or to fork n samples
                    out.keep_logits = True
                    if req.beam is None:  # n > 1: the runner samples the first token of every sample
                        item.num_forks = req.params.n - 1
        out.blocks_to_copy = self.kv_cache_manager.take_pending_copies()
        return out

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, requeue at the front of the waiting queue."""
        self.kv_cache_manager.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self.stats.num_preemptions_in_prefill += seq.num_output_tokens == 0
        rec = self._record_of(seq)
        if rec is not None:
            rec.status, rec.num_preemptions = seq.status.value, seq.num_preemptions
        self.waiting.appendleft(seq)

    # ---- after the forward -----------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: StepResult) -> list[Request]:
        """Book one executed step: advance computed tokens (tokens), cache the full blocks,
        append the sampled tokens, check stops, fork n samples after the prompt, advance beam
        searches, finish. Returns the requests that advanced or ended (output order)."""
        now = time.time()
        for item in sched.scheduled:
            seq = item.seq
            if seq.seq_id in result.prompt_logprobs:
                record_prompt_logprobs(seq, *result.prompt_logprobs[seq.seq_id],
                                       seq.num_computed_tokens + item.num_new_tokens)
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_output_tokens == 0:
                self.stats.prompt_tokens_total += item.num_new_tokens
            self.kv_cache_manager.cache_full_blocks(seq)
        touched: dict[str, Request] = {}
        sampled = result.sampler_output
        for row, seq in enumerate(result.sampled_seqs):
            req = touched.get(seq.request_id) or self.requests[seq.request_id]
            touched[req.request_id] = req
            if req.beam is not None:
                req.beam.pending[seq.seq_id] = result.logits[row]
                continue
            forks = result.forks.get(seq.seq_id)
            if forks is not None:
                self._fork_samples(req, seq, forks, now)
            self._append_token(seq, sampled.token_ids[row], sampled.logprobs[row], now)
        for req in touched.values():
            if req.beam is not None and req.beam.ready:
                self._beam_step(req, now)
        return list(touched.values())

    def fail(self, sched: SchedulerOutput, seq_ids: Iterable[int] | None, error: str) -> list[Request]:
        """End whole requests with finish reason "error" (every sequence of them): those of
        ``seq_ids``, or of every scheduled sequence when None. Returns those requests."""
        failed = None if seq_ids is None else set(seq_ids)
        reqs: dict[str, Request] = {}
        for item in sched.scheduled:
            if failed is None or item.seq.seq_id in failed:
                reqs.setdefault(item.seq.request_id, self.requests[item.seq.request_id])
        for req in reqs.values():
            for seq in list(req.live):
                self.finish_sequence(seq, FinishReason.ERROR, error=error)
            if req.beam is not None:
                req.beam.done = True
        return list(reqs.values())

    def _fork_samples(self, req: Request, parent: Sequence, forks: ForkSamples, now: float) -> None:
        """Parallel sampling: after the prompt, fork n - 1 children that share its blocks; each
        takes the first token the runner sampled for it from the parent's logits (and, for a
        seeded request, the generator that drew it)."""
        children = [parent.fork(i) for i in range(1, req.params.n)]
        for child, generator in zip(children, forks.generators):
            if generator is not None:
                child.generator = generator
            self.kv_cache_manager.fork(parent, child)
            self.add_forked(child)
        for child, token, logprobs in zip(children, forks.sampled.token_ids, forks.sampled.logprobs):
            self._append_token(child, token, logprobs, now)

    def _beam_step(self, req: Request, now: float) -> None:
        """Advance a beam search: fork beams chosen more than once, prune beams not chosen."""
        beam = req.beam
        continuations = beam.step()
        by_parent: dict[int, list] = {}
        for c in continuations:
            by_parent.setdefault(c.parent.seq_id, []).append(c)
        next_running: list[Sequence] = []
        for parent in beam.running:
            conts = by_parent.get(parent.seq_id, [])
            extra = []
            for c in conts[1:]:  # fork before the parent takes its own token
                child = parent.fork(req.next_index())
                self.kv_cache_manager.fork(parent, child)
                self.add_forked(child)
                extra.append((child, c))
            for seq, c in ([(parent, conts[0])] if conts else []) + extra:
                seq.output_token_ids.append(c.token)
                seq.cumulative_logprob = c.cumulative_logprob
                seq.last_token_time = now
                seq.first_token_time = seq.first_token_time or now
                next_running.append(seq)
                self.stats.generation_tokens_total += 1
        for parent in beam.running:
            if parent.seq_id not in by_parent:
                self.stats.num_beam_prunes += 1
                self.finish_sequence(parent, FinishReason.STOP, kind="stop:beam_pruned")  # pruned
        beam.running = next_running
        if beam.done:
            for seq in next_running:
                self.finish_sequence(seq, FinishReason.LENGTH)
            beam.running = []

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        """Append one sampled token, detokenize, advance the grammar (structured output), and
        finish on a grammar error, a stop token, EOS, stop string, the grammar's end state, or
        length (max_tokens or max_model_len), in that order (min_tokens first)."""
        seq.output_token_ids.append(token)
        grammar_done, grammar_error = (False, None) if seq.grammar_matcher is None else \
            self.structured_output.accept(seq, token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        self.stats.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        p = seq.sampling_params
        # text only where a stop string needs it now; the output processor decodes the rest when read
        new_text = self.detokenize(seq) if p.stop and self.detokenize is not None else ""
        done = seq.num_output_tokens >= p.min_tokens
        if grammar_error is not None:
            # The sampler only offers tokens the grammar allows, so a rejection means the
            # request's token filters (allowed_token_ids, bad_words) left none of them; the
            # matcher's own dump (grammar_error) is internal, so it goes to the debug log only.
            logger.debug("request %r: %s", seq.request_id, grammar_error)
            self.stats.num_rejected_after_scheduling += 1  # Coverage.rejections["after scheduling"]
            self.finish_sequence(seq, FinishReason.ERROR, error_kind="request", error=(
                f"the request's constraints leave no token to generate at output token {seq.num_output_tokens}: "
                "allowed_token_ids or bad_words exclude every token that its structured output allows next"))
        elif done and token in p.stop_token_ids:
            self.finish_sequence(seq, FinishReason.STOP, stop_reason=token)
        elif done and not p.ignore_eos and token in seq.eos_token_ids:
            self.finish_sequence(seq, FinishReason.STOP)
        elif (stop := find_stop_string(seq, len(new_text)) if done and new_text else None) is not None:
            self.finish_sequence(seq, FinishReason.STOP, stop_reason=stop)
        elif grammar_done:
            self.finish_sequence(seq, FinishReason.STOP, kind="stop:grammar")
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish_sequence(seq, FinishReason.LENGTH)

    # ---- the one exit path ---------------------------------------------------------------
    def finish_sequence(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None,
                        error: str | None = None, kind: str | None = None,
                        error_kind: str | None = None) -> None:
        """End ``seq`` for any reason and release its blocks (the one free path); idempotent.
        Its record gets the final state even when the release raises. ``kind`` overrides
        the coverage name of the finish (e.g. "stop:beam_pruned").

        Raises:
            whatever the block release raised (the record keeps it as ``release_error``).
        """
        if seq.status is SequenceStatus.FINISHED:
            return
        path = f"abort in {_abort_state(seq)}" if reason is FinishReason.ABORT else None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.error = error
        seq.error_kind = (error_kind or "engine") if error is not None else None
        seq.finished_time = time.time()
        self.structured_output.free(seq)
        rec = self._record_of(seq)  # before the request may leave ``requests``
        try:
            self.kv_cache_manager.free(seq)
            req = self.requests[seq.request_id]
            req.live.remove(seq)
            if not req.live:
                del self.requests[seq.request_id]
        except BaseException as exc:
            if rec is not None:
                rec.release_error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.record_finish(seq, kind, rec, path)

    def _record_of(self, seq: Sequence) -> RequestRecord | None:
        req = self.requests.get(seq.request_id)
        rec = req.records.get(seq.seq_id) if req is not None else None
        return rec if rec is not None else self.finished_records.get(seq.seq_id)

    def record_finish(self, seq: Sequence, kind: str | None = None, rec: RequestRecord | None = None,
                      path: str | None = None) -> None:
        """Copy ``seq``'s final state into its record, count the finish once, and keep the
        record in the bounded finished history (``finished_history`` sequences). ``path``
        names the finish path taken when it is more than the kind ("abort in decode")."""
        rec = rec or self._record_of(seq)
        if rec is None:
            return
        if rec.finish_reason is None and seq.finish_reason is not None:
            self.stats.finish_counts[kind or _finish_kind(seq)] += 1
        if seq.finish_reason is not None and rec.finish_path is None:
            rec.finish_path = path or kind or _finish_kind(seq)
        rec.status = seq.status.value
        rec.finish_reason = seq.finish_reason.value if seq.finish_reason else None
        rec.num_output_tokens = seq.num_output_tokens
        rec.num_preemptions = seq.num_preemptions
        rec.finished_time = seq.finished_time
        if seq.finish_reason is not None and rec.finished_step is None:
            rec.finished_step = self.step_counter  # the zombie check counts steps up to here
        rec.error = seq.error
        self.finished_records[seq.seq_id] = rec
        while len(self.finished_records) > self.finished_history:
            self.finished_records.popitem(last=False)

    def request_record(self, seq_id: int) -> RequestRecord | None:
        """The record of a live or recently finished sequence (None if forgotten or unknown)."""
        rec = self.finished_records.get(seq_id)
        if rec is None:
            rec = next((r.records[seq_id] for r in self.requests.values() if seq_id in r.records), None)
        return rec

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every live sequence of a request, in any state (waiting, mid-prefill,
        running, preempted). Returns the aborted sequences (empty if none was live).

        Raises:
            the first exception a sequence's finish raised, after every
            sequence of the request has been taken out of the queues.
        """
        seqs = list(self.requests.get(request_id, ()))
        family = request_family(self.requests[request_id].params) if seqs else None
        for seq in seqs:
            self.stats.abort_states[_abort_state(seq)] += 1
            self.stats.aborts_by_family[f"{family}: {_abort_state(seq)}"] += 1
        errors = []
        for seq in seqs:  # every sequence, even when one's release raises (n > 1, beams)
            try:
                self.finish_sequence(seq, FinishReason.ABORT)
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the siblings
                errors.append(exc)
        if errors:
            raise errors[0]
        return seqs


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
