"""Serving-benchmark metric arithmetic, as ``vllm bench serve`` computes it.

Per successful request (times in seconds, measured by the client):
  TTFT  = first token's arrival - request send time
  E2EL  = last token's arrival - request send time
  ITL   = gaps between consecutive token arrivals (output_tokens - 1 values per request,
          fewer when the server sends several tokens in one chunk)
  TPOT  = (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token
Summaries (mean, median, std, percentiles) are reported in milliseconds; an empty list gives 0.
Percentiles use numpy's default linear interpolation, as vLLM does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

METRIC_NAMES = {  # attribute name -> (display name, header line), in vLLM's order
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestFuncOutput:
    """What the client saw of one request.

    success: False when the request failed (HTTP error, broken stream, ...); ``error`` says why.
    latency: E2EL, seconds. ttft: seconds (0 when no token arrived).
    itl: seconds between consecutive content chunks after the first.
    output_tokens: tokens generated (from the server's usage, else counted from the chunks).
    prompt_len: prompt tokens.
    """

    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_len: int = 0
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0


@dataclass
class BenchmarkMetrics:
    """Aggregates over one serving run; all latency fields in milliseconds."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    summaries: dict[str, dict[str, float]]  # metric -> {"mean", "median", "std"}
    percentiles: dict[str, list[tuple[float, float]]]  # metric -> [(p, value_ms)]


def tpot_of(latency: float, ttft: float, output_tokens: int) -> float | None:
    """TPOT = (E2EL - TTFT) / (output_tokens - 1), seconds; None when output_tokens <= 1."""
    if output_tokens <= 1:
        return None
    return (latency - ttft) / (output_tokens - 1)


def itls_from_arrivals(send_time: float, arrivals: list[float]) -> tuple[float, list[float]]:
    """(TTFT, ITL list) from a request's send time and its chunks' arrival times (seconds).

    Raises:
        ValueError: no arrivals.
    """
    if not arrivals:
        raise ValueError("no token arrived")
    return arrivals[0] - send_time, [b - a for a, b in itertools.pairwise(arrivals)]


def summarize(values_s: list[float], percentiles: list[float]) -> tuple[dict[str, float], list[tuple[float, float]]]:
    """Mean / median / std and the given percentiles of ``values_s`` (seconds), all in ms."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0}, [(p, 0.0) for p in percentiles]
    stats = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    return stats, [(p, float(np.percentile(arr, p))) for p in percentiles]


def calculate_metrics(outputs: list[RequestFuncOutput], duration_s: float,
                      percentiles: list[float]) -> BenchmarkMetrics:
    """Aggregate per-request outputs of a run that lasted ``duration_s`` seconds.

    Throughputs count successful requests only. Raises ValueError if ``duration_s`` <= 0.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    itls = [x for o in ok for x in o.itl]
    tpots = [t for o in ok if (t := tpot_of(o.latency, o.ttft, o.output_tokens)) is not None]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    summaries, pcts = {}, {}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        summaries[name], pcts[name] = summarize(values, percentiles)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_in, total_output=total_out,
        request_throughput=len(ok) / duration_s, output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s, summaries=summaries, percentiles=pcts)


def percentile_word(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (vLLM's key spelling, e.g. ``p99_ttft_ms``)."""
    return str(int(p)) if int(p) == p else str(p)


def format_serving_result(m: BenchmarkMetrics, duration_s: float, selected: list[str],
                          max_concurrency: int | None = None, request_rate: float = float("inf")
                          ) -> tuple[str, dict[str, float]]:
    """vLLM's "Serving Benchmark Result" block, and the metric keys it adds to the JSON result."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label, value, fmt="<10"):
        lines.append("{:<40} {:{fmt}}".format(label, value, fmt=fmt))

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, "<10.2f")
    row("Benchmark duration (s):", duration_s, "<10.2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, "<10.2f")
    row("Output token throughput (tok/s):", m.output_throughput, "<10.2f")
    row("Total Token throughput (tok/s):", m.total_token_throughput, "<10.2f")
    keys: dict[str, float] = {}
    for attr, (name, header) in METRIC_NAMES.items():
        if attr not in selected:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        s = m.summaries[attr]
        row(f"Mean {name} (ms):", s["mean"], "<10.2f")
        row(f"Median {name} (ms):", s["median"], "<10.2f")
        keys[f"mean_{attr}_ms"], keys[f"median_{attr}_ms"], keys[f"std_{attr}_ms"] = s["mean"], s["median"], s["std"]
        for p, value in m.percentiles[attr]:
            word = percentile_word(p)
            row(f"P{word} {name} (ms):", value, "<10.2f")
            keys[f"p{word}_{attr}_ms"] = value
    lines.append("=" * 50)
    return "\n".join(lines), keys
