"""Server adapters: map one server's ``/metrics`` series onto the leak checker's columns.

Each adapter knows the series one server exports (names read from that project's docs and
source; the fixtures under ``tests/diagnostics/fixtures/`` are recorded or rebuilt pages) and turns a scrape
into a ``MetricsReading``: KV usage as a fraction and, where the server exposes its pool size, in
blocks or tokens; running and waiting requests; prefix-cache queries and hits.

| kind | identified by | KV used | pool size | running / waiting |
|---|---|---|---|---|
| vlite | ``vlite:num_total_blocks`` | total - free - cached blocks | ``vlite:num_total_blocks`` | ``vlite:num_requests_running`` / ``_waiting`` |
| vllm | ``vllm:num_requests_running`` | ``vllm:kv_cache_usage_perc`` x pool | ``num_gpu_blocks`` - 1 (the null block) from ``vllm:cache_config_info`` labels, ``block_size`` from the same | ``vllm:num_requests_running`` / ``_waiting`` |
| sglang | ``sglang:num_running_reqs`` | ``sglang:num_used_tokens`` (tokens) | ``sglang:max_total_num_tokens`` when exported | ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` |
| llamacpp | ``llamacpp:requests_processing`` | ``llamacpp:kv_cache_tokens`` (older builds only) | none | ``llamacpp:requests_processing`` / ``_deferred`` |
| tgi | ``tgi_queue_size`` | ``tgi_batch_current_max_tokens`` (tokens reserved by the batch) | none | ``tgi_batch_current_size`` / ``tgi_queue_size`` |

Sums run over every label set (vLLM's ``engine`` label: one series per engine core).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vlite.diagnostics.targets.prom import MetricsPage

SERVER_KINDS = ("vlite", "vllm", "sglang", "llamacpp", "tgi")


class UnknownServerError(ValueError):
    """The ``/metrics`` page matches no known server (the message names what was looked for)."""


@dataclass
class MetricsReading:
    """One scrape in the leak checker's terms.

    kv_used: KV cache held by requests, in ``unit`` (blocks or tokens), evictable prefix-cache
        entries excluded (each server counts those as free); None when the server exposes no
        KV gauge. kv_total: the pool size in ``unit`` when exposed. kv_usage: kv_used / kv_total
        (0..1) when known. block_size: tokens per block, read from the server (never assumed).
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


class Adapter:
    """Base: ``kind``, the ``markers`` that identify the server, ``reads`` (column -> series) for the report."""

    kind = ""
    markers: tuple[str, ...] = ()
    reads: dict[str, str] = {}
    caveat = ""
    gauge_lag_s = 0.0  # how long idle gauges may lag behind the engine (seconds)

    def matches(self, page: MetricsPage) -> bool:
        return any(page.has(m) for m in self.markers)

    def read(self, page: MetricsPage) -> MetricsReading:  # pragma: no cover - abstract
        raise NotImplementedError


class VliteAdapter(Adapter):
    kind = "vlite"
    markers = ("vlite:num_total_blocks",)
    reads = {"kv_used": "vlite:num_total_blocks - vlite:num_free_blocks - vlite:num_cached_blocks",
             "kv_total": "vlite:num_total_blocks", "num_running": "vlite:num_requests_running",
             "num_waiting": "vlite:num_requests_waiting", "prefix_cache": "vlite:prefix_cache_queries/hits_total"}
    caveat = "cached (evictable) blocks are counted as free"

    def read(self, page: MetricsPage) -> MetricsReading:
        total = page.total("vlite:num_total_blocks")
        free = page.total("vlite:num_free_blocks")
        if total is None or free is None:
            raise KeyError("vlite:num_total_blocks / vlite:num_free_blocks")
        used = total - free - (page.total("vlite:num_cached_blocks") or 0.0)
        return MetricsReading(self.kind, _int(page.total("vlite:num_requests_running")),
                           _int(page.total("vlite:num_requests_waiting")), used, total,
                           used / total if total else None, "blocks", None,
                           page.total("vlite:prefix_cache_queries_total"), page.total("vlite:prefix_cache_hits_total"))


class VllmAdapter(Adapter):
    kind = "vllm"
    markers = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc")
    reads = {"kv_usage": "vllm:kv_cache_usage_perc (0..1; evictable prefix-cache blocks count as free)",
             "kv_total": "vllm:cache_config_info{num_gpu_blocks} - 1 (the null block), per engine",
             "block_size": "vllm:cache_config_info{block_size}", "num_running": "vllm:num_requests_running",
             "num_waiting": "vllm:num_requests_waiting",
             "prefix_cache": "vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total"}
    caveat = "gauges are updated only when the engine steps: a probe request forces a step"

    def read(self, page: MetricsPage) -> MetricsReading:
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
                           page.total("vllm:prefix_cache_queries_total"), page.total("vllm:prefix_cache_hits_total"))


class SglangAdapter(Adapter):
    kind = "sglang"
    markers = ("sglang:num_running_reqs", "sglang:token_usage")
    reads = {"kv_used": "sglang:num_used_tokens (tokens; evictable radix-cache tokens count as free)",
             "kv_usage": "sglang:token_usage", "kv_total": "sglang:max_total_num_tokens (when exported)",
             "num_running": "sglang:num_running_reqs", "num_waiting": "sglang:num_queue_reqs",
             "prefix_cache": "sglang:prompt_tokens_total / sglang:cached_tokens_total"}
    caveat = "needs --enable-metrics; idle gauges are refreshed on the scheduler's log interval and can lag"
    gauge_lag_s = 60.0

    def read(self, page: MetricsPage) -> MetricsReading:
        used = page.total("sglang:num_used_tokens")
        total = page.total("sglang:max_total_num_tokens")
        usage = page.first("sglang:token_usage")
        if used is None and usage is not None and total:
            used = usage * total
        unit = "tokens" if used is not None else "fraction"
        return MetricsReading(self.kind, _int(page.total("sglang:num_running_reqs")),
                           _int(page.total("sglang:num_queue_reqs")), used if used is not None else usage, total,
                           usage if usage is not None else (used / total if used is not None and total else None),
                           unit, _label_int(page.labels("sglang:cache_config_info"), "page_size"),
                           page.total("sglang:prompt_tokens_total"), page.total("sglang:cached_tokens_total"))


class LlamacppAdapter(Adapter):
    kind = "llamacpp"
    markers = ("llamacpp:requests_processing", "llamacpp:prompt_tokens_total")
    reads = {"kv_used": "llamacpp:kv_cache_tokens (older builds; current builds export no KV gauge)",
             "kv_usage": "llamacpp:kv_cache_usage_ratio (older builds)",
             "num_running": "llamacpp:requests_processing", "num_waiting": "llamacpp:requests_deferred"}
    caveat = "needs --metrics; current builds export no KV usage gauge (see /slots): process memory only"

    def read(self, page: MetricsPage) -> MetricsReading:
        tokens = page.total("llamacpp:kv_cache_tokens")
        ratio = page.first("llamacpp:kv_cache_usage_ratio")
        used, unit = ((tokens, "tokens") if tokens is not None else (ratio, "fraction") if ratio is not None
                      else (None, "none"))
        return MetricsReading(self.kind, _int(page.total("llamacpp:requests_processing")),
                           _int(page.total("llamacpp:requests_deferred")), used, None, ratio, unit, None,
                           page.total("llamacpp:prompt_tokens_total"), None)


class TgiAdapter(Adapter):
    kind = "tgi"
    markers = ("tgi_queue_size", "tgi_batch_current_size")
    reads = {"kv_used": "tgi_batch_current_max_tokens (tokens the running batch reserves)",
             "num_running": "tgi_batch_current_size", "num_waiting": "tgi_queue_size"}
    caveat = "no pool-size gauge (it is max_batch_total_tokens in GET /info): usage in tokens, no fraction"

    def read(self, page: MetricsPage) -> MetricsReading:
        used = page.total("tgi_batch_current_max_tokens")
        return MetricsReading(self.kind, _int(page.total("tgi_batch_current_size")), _int(page.total("tgi_queue_size")),
                           used, None, None, "tokens" if used is not None else "none", None, None, None)


ADAPTERS: dict[str, Adapter] = {a.kind: a for a in (VliteAdapter(), VllmAdapter(), SglangAdapter(), LlamacppAdapter(),
                                                    TgiAdapter())}


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
