"""Engine statistics with vLLM-compatible meaning, and the ``--log-stats`` line."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStats:
    """A snapshot of the block manager's counters (blocks, and the usage fraction 0..1)."""

    num_total_blocks: int
    num_free_blocks: int      # free and empty
    num_used_blocks: int      # ref_count > 0 (held by live sequences)
    num_cached_blocks: int    # free but holding a cached full block (evictable)
    kv_cache_usage: float     # num_used_blocks / num_total_blocks
    num_block_tables: int
    num_ledger_entries: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0     # of which found cached


@dataclass
class SchedulerStats:
    """The counters the scheduler fills as it runs (counts since engine start), read through
    ``Scheduler.make_stats()`` by ``EngineStats`` and the diagnostics' coverage.

    ``finish_counts``: sequences finished by kind ("stop:eos", "stop:stop_token",
    "stop:stop_string", "stop:beam_pruned", "stop:grammar", "length", "abort", "error");
    ``abort_states``: aborted sequences by the state they were in; ``feature_counts``: requests
    by feature of the request API; ``aborts_by_family``: aborted sequences by "family: state";
    ``num_rejected_after_scheduling``: sequences ended for the request's own parameters after
    they were scheduled (HTTP 400).
    """

    num_preemptions_total: int = 0
    num_preemptions_in_prefill: int = 0  # of those, sequences with no output token yet
    num_resumptions_total: int = 0  # preempted sequences scheduled again (recompute)
    prompt_tokens_total: int = 0  # prefill tokens computed (tokens)
    generation_tokens_total: int = 0  # output tokens appended (tokens)
    num_beam_prunes: int = 0
    num_rejected_after_scheduling: int = 0
    finish_counts: Counter[str] = field(default_factory=Counter)
    abort_states: Counter[str] = field(default_factory=Counter)
    feature_counts: Counter[str] = field(default_factory=Counter)
    aborts_by_family: Counter[str] = field(default_factory=Counter)

    def copy(self) -> SchedulerStats:
        """A snapshot: later counts do not change it."""
        return dataclasses.replace(self, **{f.name: Counter(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), Counter)})


@dataclass(frozen=True)
class EngineStats:
    """A read-only snapshot for metrics and diagnostics.

    kv_cache_usage is a fraction 0..1 (vLLM's ``kv_cache_usage_perc``). Token totals count
    since engine start; num_live_requests counts the scheduler's per-request entries.
    """

    step: int
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_live_requests: int
    blocks: BlockStats
    coverage: object | None = None  # vlite.engine.introspection.Coverage: paths exercised so far
    # The serving loop's last request-id census at an idle point: container path -> ended
    # requests it still held (empty when nothing was held, or no census has run yet)
    ended_requests_held: dict = dataclasses.field(default_factory=dict)
    census_pending: int = 0  # requests ended since that census (0: its counts are current)
    # None, or {"seconds", "blocked_by": {what: count}}: the census is overdue (census.IdleCensus.overdue)
    census_overdue: dict | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.blocks.num_total_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.blocks.num_cached_blocks

    @property
    def kv_cache_usage(self) -> float:
        return self.blocks.kv_cache_usage


def format_log_stats(stats: EngineStats, prompt_throughput: float, generation_throughput: float) -> str:
    """One line in the shape of vLLM's periodic stats log (throughputs in tokens/s; the prefix
    cache hit rate is cumulative, in tokens)."""
    b = stats.blocks
    hit_rate = b.prefix_cache_hits / b.prefix_cache_queries if b.prefix_cache_queries else 0.0
    return (f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%, "
            f"Free blocks: {stats.num_free_blocks}/{stats.num_total_blocks} "
            f"(+{stats.num_cached_blocks} cached)")


class StatsLogger:
    """Logs ``format_log_stats`` at most every ``interval_s`` seconds (vLLM's periodic
    ``LoggingStatLogger``), with throughputs over the interval since the last line. Shared by the
    in-process engine loop and the engine core process."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last = (time.monotonic(), 0, 0)  # time, prompt tokens, generation tokens

    def maybe_log(self, get_stats: Callable[[], EngineStats]) -> None:
        """Log one line if the interval has passed (``get_stats`` is only called then)."""
        now = time.monotonic()
        last_t, last_prompt, last_gen = self._last
        if now - last_t < self.interval_s:
            return
        s = get_stats()
        dt = now - last_t
        self.logger.info(format_log_stats(s, (s.prompt_tokens_total - last_prompt) / dt,
                                          (s.generation_tokens_total - last_gen) / dt))
        self._last = (now, s.prompt_tokens_total, s.generation_tokens_total)
