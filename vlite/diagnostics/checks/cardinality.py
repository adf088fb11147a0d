"""Metric label cardinality: a ``/metrics`` family whose series count grows with requests served.

A metric labelled by a client-chosen value (a stop string, a user id) adds one series per
distinct value, for ever (litellm#12159). Each series is small, so host memory's plateau test
misses it, but the page shows it from outside. At each idle point the leak check counts, per
metric family, its series (distinct label sets; a histogram's ``le`` and a summary's
``quantile`` are parts of one series) and the distinct values of each label
(``series_counts``); ``cardinality_check`` then calls a family a LEAK when its series kept
growing after the first wave and through the later half of the run (``MIN_LATE_SHARE``), by at
least ``MIN_NEW_SERIES`` and ``MIN_SERIES_PER_REQUEST``, and names the label whose distinct values grew the most. A label over a
fixed set (finish reasons, allocation sites, client actions) fills within a few waves and then
stays put; a label over client values grows with every wave that brings new ones.

Input: Prometheus text exposition format 0.0.4, read by ``readers/metrics_text.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.readers.metrics_text import FamilyCounts, MetricsFormatError, parse_page
from vlite.diagnostics.readers.probe_series import PREFIX as PROBE_PREFIX

# New series after the first wave below which growth is not called a leak: a label over a fixed
# set of up to this many values (vlite's request features, vLLM's finish reasons) may fill late in
# a short run whose waves each bring new kinds of request (a clean 12-request black-box run of
# vlite took vlite:request_feature from 1 to 10 series, 0.9 per request).
MIN_NEW_SERIES = 20
# ... and below this many new series per request served (a client value per request gives 1; a
# stop string on one request in five, 0.2).
MIN_SERIES_PER_REQUEST = 0.1
# ... and with less than this share, in the later half of the run (from the idle point nearest its
# middle, by requests served), of the growth a steady rate per request would give there (a set
# filling up slows down; values per request do not).
MIN_LATE_SHARE = 0.5


def series_counts(text: str) -> FamilyCounts:
    """Per metric family of a ``/metrics`` page: its number of series and each label's number of
    distinct values. Families are as the page declares them (``# TYPE``); a page that does not
    parse gives {} (the targets that read the page report that themselves).
    """
    try:
        return parse_page(text, allow_empty=True).series_counts()
    except MetricsFormatError:
        return {}


def cardinality_check(points: Sequence[tuple[int, FamilyCounts]]) -> dict:
    """The cardinality verdict over idle points ``(requests served so far, series_counts(page))``,
    baseline first.

    Returns ``{"verdict": "LEAK" | "CLEAN" | "too few idle points", "growing": [...],
    "families": n}``; each growing family is ``{"family", "label", "series_first", "series_last",
    "new_series", "series_per_request", "label_values_first", "label_values_last"}``, where
    "first" is the idle point after the first wave (warm-up left out) and "label" the label whose
    distinct values grew the most. Needs three idle points after the baseline.
    """
    pts = [p for p in points if p[1]]
    if len(pts) < 4:
        return {"verdict": "too few idle points", "growing": [], "families": len(pts[-1][1]) if pts else 0}
    warm, last = pts[1], pts[-1]
    middle = (warm[0] + last[0]) / 2
    mid = min(pts[2:-1], key=lambda p: abs(p[0] - middle))
    late = (last[0] - mid[0]) / max(1, last[0] - warm[0])  # the later part's share of the requests
    growing = []
    for fam, (n_last, labels_last) in sorted(last[1].items()):
        if fam.startswith(PROBE_PREFIX):
            continue  # the vlite probe's series: one per container it found, judged by checks/probe_census.py
        n_warm, labels_warm = warm[1].get(fam, (0, {}))
        n_mid = mid[1].get(fam, (0, {}))[0]
        served = max(1, last[0] - warm[0])
        new = n_last - n_warm
        if new < max(MIN_NEW_SERIES, MIN_SERIES_PER_REQUEST * served) or n_last - n_mid < MIN_LATE_SHARE * late * new:
            continue  # few new series, or few since the middle of the run: a fixed set filling up
        label = max(labels_last, key=lambda k: (labels_last[k] - labels_warm.get(k, 0), k), default="?")
        growing.append({"family": fam, "label": label, "series_first": n_warm, "series_last": n_last,
                        "new_series": n_last - n_warm, "series_per_request": round((n_last - n_warm) / served, 3),
                        "label_values_first": labels_warm.get(label, 0),
                        "label_values_last": labels_last.get(label, 0)})
    return {"verdict": Verdict.LEAK if growing else Verdict.CLEAN, "growing": growing, "families": len(last[1])}


def describe(check: dict) -> str:
    """The verdict line's part for growing families: "vlite:x series +12 by label stop (0.2/request)"."""
    return "; ".join(f"{g['family']} series {g['series_first']} -> {g['series_last']} growing by label "
                     f"{g['label']!r} ({g['series_per_request']:g} per request)" for g in check["growing"])
