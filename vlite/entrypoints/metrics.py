"""Prometheus metrics for /metrics, with vLLM's names under the ``vlite:`` prefix.

Gauges and engine counters are read at scrape time from the engine loop's latest stats
snapshot (a custom collector), the request-id census gauges from both censuses (the engine
loop's, in its stats, and the API server's own, ``vlite.entrypoints.census``); per-request histograms and the success counter are fed by
``observe`` with every RequestOutput, on the engine thread. Each app has its own
CollectorRegistry, so two servers in one process (tests) never share series. Every series
carries a ``model_name`` label, as vLLM's do. Histogram buckets are vLLM's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vlite.engine import EngineStats, RequestOutput

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
# vLLM V1's per-request phase histograms (its request_latency_buckets), observed when a request
# finishes: queue = first scheduled - arrival, prefill = first token - first scheduled,
# decode = last token - first token, inference = finish - first scheduled.
PHASES = (("queue", "Histogram of time spent in WAITING phase for request."),
          ("prefill", "Histogram of time spent in PREFILL phase for request."),
          ("decode", "Histogram of time spent in DECODE phase for request."),
          ("inference", "Histogram of time spent in RUNNING phase for request."))
FINISH_REASONS = ("stop", "length", "abort", "error")
# Client disconnects by route and when (vlite:client_disconnects; the leak check's API checklist):
# a streaming client that left before any token or mid-stream, or a non-streaming client that
# left before its response (to the server, a client timeout). Every series exists from the start.
DISCONNECT_ROUTES = ("/v1/completions", "/v1/chat/completions")
DISCONNECT_WHEN = ("before first token", "mid-stream", "non-streaming")

disable_created_metrics()  # no *_created series, as vLLM


# container path -> ended requests held; requests ended since; None or {"seconds", "blocked_by"} (overdue)
CensusCounts = tuple[dict[str, int], int, dict | None]


class _EngineStatsCollector(Collector):
    """Reads the engine's stats snapshot (and the API server's census counts) at every scrape."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None],
                 api_census: Callable[[], CensusCounts] | None = None) -> None:
        self.model_name = model_name
        self.stats = stats
        self.api_census = api_census

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:
            return
        gauges = [
            ("vlite:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vlite:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vlite:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
            ("vlite:num_free_blocks", "Empty free KV-cache blocks (free + cached + used = total).",
             s.num_free_blocks),
            ("vlite:num_cached_blocks", "Free KV-cache blocks that still hold a cached prefix (evictable).",
             s.num_cached_blocks),
            ("vlite:num_total_blocks", "KV-cache blocks in total.", s.num_total_blocks),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        counters = [
            ("vlite:num_preemptions", "Cumulative number of preemptions.", s.num_preemptions_total),
            ("vlite:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total),
            ("vlite:generation_tokens", "Number of generation tokens processed.", s.generation_tokens_total),
            ("vlite:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             s.blocks.prefix_cache_queries),
            ("vlite:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             s.blocks.prefix_cache_hits),
            # vLLM counts steps only as vllm:iteration_tokens_total's _count; the leak check maps a
            # client's disconnect to a step with it (zombies are judged in engine steps)
            ("vlite:engine_steps", "Engine steps scheduled since start.", s.step),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            yield c
        yield from _coverage_families(self.model_name, s.coverage)
        yield from self._census_families(s)

    def _census_families(self, s: EngineStats) -> Iterator[Metric]:
        """The request-id censuses at their last idle points (docs/architecture.md, "The leak check"): the engine
        loop's (paths as ``engine.<path>``) and the API server process's (``api_server.<path>``;
        the two walk disjoint objects, so a container is counted once); pending is their sum; a
        census overdue (kept from its idle points, ``IdleCensus.overdue``) is one series per process
        and what blocks it."""
        held, pending = dict(s.ended_requests_held or {}), s.census_pending
        overdue = {"engine": s.census_overdue}
        if self.api_census is not None:
            api_held, api_pending, overdue["api_server"] = self.api_census()
            held.update(api_held)
            pending += api_pending
        g = GaugeMetricFamily("vlite:ended_requests_held", "Ended requests still held at the last idle point, "
                              "by container (request-id census).", labels=["model_name", "container"])
        for path, count in sorted(held.items()):
            g.add_metric([self.model_name, path], count)
        yield g
        g = GaugeMetricFamily("vlite:census_pending_requests", "Requests ended since the last request-id "
                              "census (0: vlite:ended_requests_held is current).", labels=["model_name"])
        g.add_metric([self.model_name], pending)
        yield g
        g = GaugeMetricFamily("vlite:census_overdue_seconds", "Seconds a due request-id census has been kept from "
                              "its idle point while no new work came, by process and what blocks it (none: on time).",
                              labels=["model_name", "process", "blocked_by"])
        for process, due in overdue.items():
            for what in sorted((due or {}).get("blocked_by", {})):
                g.add_metric([self.model_name, process, what], due["seconds"])
        yield g


def _coverage_families(model_name: str, cov) -> Iterator[Metric]:
    """The engine's coverage counters (vlite.engine.introspection.Coverage), which vLLM lacks:
    what the leak checker reads over HTTP to say which paths a run exercised."""
    if cov is None:
        return
    labelled = [("vlite:kv_block_allocations", "KV block references allocated, by allocation site.", "site",
                 cov.allocation_sites),
                ("vlite:sequence_finished", "Sequences ended, by finish kind.", "kind", cov.finish_reasons),
                ("vlite:sequence_aborted", "Sequences aborted, by the state they were in.", "state",
                 cov.abort_states)]
    labelled += [("vlite:request_feature", "Requests admitted, by request-API feature.", "feature", cov.features),
                 ("vlite:sequence_aborted_by_family", "Sequences aborted, by request family and state.",
                  "family_state", cov.aborts_by_family),
                 ("vlite:request_rejected", "Requests refused by the engine, by stage (at admission; admitted, "
                  "then aborted because a sibling prompt was refused; after scheduling).", "stage",
                  getattr(cov, "rejections", {}))]
    for name, doc, label, counts in labelled:
        c = CounterMetricFamily(name, doc, labels=["model_name", label])
        for key, value in sorted(counts.items()):
            c.add_metric([model_name, key], value)
        yield c
    for name, doc, value in [("vlite:num_resumptions", "Preempted sequences scheduled again.", cov.resumptions),
                             ("vlite:num_preemptions_in_prefill", "Preemptions of a sequence with no output token "
                              "yet (its prefill dropped).", cov.preemptions_in_prefill),
                             ("vlite:forks", "Sequence forks (n > 1, beam search).", cov.forks),
                             ("vlite:copy_on_write", "Copy-on-write block copies.", cov.copy_on_write),
                             ("vlite:beam_prunes", "Beams pruned by beam search.", cov.beam_prunes)]:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([model_name], value)
        yield c


def _mean_time_per_output_token(out: RequestOutput) -> float:
    """Seconds per output token after the first, as vLLM's ``mean_time_per_output_token``
    (vllm/v1/metrics/stats.py): decode time over generated tokens - 1 (the longest choice's), 0 if
    fewer than two tokens came."""
    m, tokens = out.metrics, max((len(c.token_ids) for c in out.outputs), default=0)
    if tokens < 2 or m.first_token_time is None or m.last_token_time is None:
        return 0.0
    return max(0.0, m.last_token_time - m.first_token_time) / (tokens - 1)


class ServerMetrics:
    """The registry behind /metrics, and the per-request observations.

    Args:
        model_name: the ``model_name`` label.
        stats: returns the latest EngineStats (None while the model loads).
        api_census: returns the API server census's counts (container path -> ended requests
            held, requests ended since), added to the engine's in the census gauges; None: none.
    """

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None],
                 api_census: Callable[[], CensusCounts] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineStatsCollector(model_name, stats, api_census))
        # process_resident_memory_bytes, process_cpu_seconds_total, ...: the API server process,
        # as on vLLM's /metrics (prometheus_client's default registry has them; ours is per app)
        ProcessCollector(registry=self.registry)
        self.request_success = Counter("vlite:request_success", "Count of finished requests.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.ttft = Histogram("vlite:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vlite:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        # vLLM's per-request TPOT: decode time / (generated tokens - 1), 0 with one token or none
        self.tpot = Histogram("vlite:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ["model_name"],
                              buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vlite:e2e_request_latency_seconds", "Histogram of end to end request latency in "
                             "seconds.", ["model_name"], buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.phase_time = {phase: Histogram(f"vlite:request_{phase}_time_seconds", doc, ["model_name"],
                                            buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
                           for phase, doc in PHASES}
        self._last_token_time: dict[str, float] = {}
        self._lock = threading.Lock()
        self.client_disconnects = Counter("vlite:client_disconnects", "Requests whose client left before the "
                                          "response ended, by route and when (before the first token, mid-stream, "
                                          "or a non-streaming client: a timeout).", ["model_name", "route", "when"],
                                          registry=self.registry)
        for route in DISCONNECT_ROUTES:
            for when in DISCONNECT_WHEN:
                self.client_disconnects.labels(model_name, route, when)

    def client_disconnected(self, route: str, when: str) -> None:
        """Count one client that left ``route`` early (``when``: one of ``DISCONNECT_WHEN``);
        other routes are not counted (the label set stays fixed)."""
        if route in DISCONNECT_ROUTES and when in DISCONNECT_WHEN:
            self.client_disconnects.labels(self.model_name, route, when).inc()

    def observe(self, out: RequestOutput) -> None:
        """Record one RequestOutput (each carries at most one new token per step)."""
        m = out.metrics
        with self._lock:
            prev = self._last_token_time.get(out.request_id)
            if m.last_token_time is not None and m.last_token_time != prev:
                if prev is None:
                    if m.first_token_time is not None:
                        self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
                else:
                    self.itl.observe(max(0.0, m.last_token_time - prev))
                self._last_token_time[out.request_id] = m.last_token_time
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
        if out.finished:
            # One count per engine request (its n choices included): an error or abort of any
            # choice is the request's reason, else the first choice's.
            reasons = [c.finish_reason for c in out.outputs]
            reason = next((r for r in ("error", "abort") if r in reasons), reasons[0] if reasons else None)
            self.request_success.labels(self.model_name, reason or "error").inc()
            finished = m.finished_time or time.time()
            self.e2e.observe(max(0.0, finished - m.arrival_time))
            self.tpot.observe(_mean_time_per_output_token(out))
            self._observe_phases(m, finished)

    def _observe_phases(self, m, finished: float) -> None:
        """Queue, prefill, decode and inference time of a finished request; a phase it never
        reached (aborted while waiting, no token) is not observed, as in vLLM."""
        spans = {"queue": (m.arrival_time, m.first_scheduled_time),
                 "prefill": (m.first_scheduled_time, m.first_token_time),
                 "decode": (m.first_token_time, m.last_token_time),
                 "inference": (m.first_scheduled_time, finished if m.first_scheduled_time is not None else None)}
        for phase, (start, end) in spans.items():
            if start is not None and end is not None:
                self.phase_time[phase].observe(max(0.0, end - start))
