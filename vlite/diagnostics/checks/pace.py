"""The server's own pace, for judging a zombie against it: which engine step a client's
disconnect fell in, and how long a step (an inter-token gap) took during the run.

A request whose client left is released at the next step boundary at best; on a slow engine (a
loaded CPU, a long prefill in the batch) that can be seconds after the disconnect, so the zombie
check counts engine steps where the server says them, and scales its wall-clock bound by the
measured step time where it does not (``zombie.py``).
"""

from __future__ import annotations

import bisect
import math


def step_at(timeline: list[tuple[float, int]], t: float) -> int | None:
    """The engine step counter at or just after time ``t``.

    ``timeline``: ``(time.time() s before the read, step counter read)`` pairs sorted by time, as
    a client samples ``vlite:engine_steps_total``. The first read that began at or after ``t``
    saw at least the counter at ``t``, so ``released_step - step_at(t)`` never counts more steps
    than the request really outlived its client (it may count fewer: the steps the engine ran
    between ``t`` and that read, at most one sampling interval's worth). None when no read
    began at or after ``t``.
    """
    i = bisect.bisect_left(timeline, (t, -math.inf))
    return timeline[i][1] if i < len(timeline) else None


def quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1, nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The ``q`` quantile of the observations a Prometheus histogram gained between two reads.

    ``before`` / ``after``: cumulative bucket counts by upper bound (``le``, seconds; +Inf as
    ``math.inf``). Returns the upper bound of the bucket where the quantile falls (an upper
    bound of the quantile, as a bound should be), the largest finite bound when it falls in
    +Inf, or None when nothing was observed in between.
    """
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    target = q * counts[-1]
    for b, c in zip(bounds, counts):
        if c >= target:
            return b if math.isfinite(b) else max((x for x in bounds if math.isfinite(x)), default=None)
    return None


def itl_p99(before_text: str, after_text: str, family: str = "vlite:inter_token_latency_seconds") -> float | None:
    """The p99 inter-token latency (s) observed between two ``/metrics`` pages (the histogram's
    bucket bound holding it), or None when no token gap was observed.

    Raises:
        MetricsFormatError: a page is not Prometheus text.
    """
    from vlite.diagnostics.readers.metrics_text import parse_page

    before, after = (parse_page(t, allow_empty=True).histogram_buckets(family) for t in (before_text, after_text))
    return histogram_quantile(before, after, 0.99)
