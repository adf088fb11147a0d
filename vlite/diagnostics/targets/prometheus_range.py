"""Judge a range that a Prometheus server already holds: ``vlite leak-check --prometheus URL --job
NAME --since 6h``. No watching and no request to the inference server.

Through Prometheus's HTTP API (``/api/v1/label/__name__/values`` to learn the job's series and
pick the server's adapter, ``/api/v1/query_range`` for their values), the range is rebuilt step by
step into the ``/metrics`` pages the server exported, read through the same adapter as a live
scrape, and fed to the same judge as ``--watch`` (``watch.Watcher``). Memory is the server's own
``process_resident_memory_bytes`` (vLLM's and vlite's API server process; the engine core and
workers are other processes, not in it).

**A fleet.** A job with several replicas (its ``instance`` label, or another label that tells
them apart such as ``pod``: ``--instance-label``) is judged replica by replica, each through its
own Watcher, and gets a verdict per replica, never an average: one leaking pod of four is LEAK,
named, while the others stay CLEAN (``judge_fleet``; SGLang #36333: averaged pool metrics hid
the bad pod). The run's verdict is the worst replica's.

API reference: https://prometheus.io/docs/prometheus/latest/querying/api/ (range queries return
one series per label set, values as ``[unix_time, "string"]`` pairs aligned on ``step``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import httpx

from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.readers.adapters import METRIC_NAMES, UnknownServerError, detect_kind
from vlite.diagnostics.readers.metrics_text import MetricsPage, Sample
from vlite.diagnostics.targets.base import TargetError, TargetPlan, TargetRun
from vlite.diagnostics.targets.connection import IDLE_SCRAPES
from vlite.diagnostics.targets.watch import DEFAULT_STUCK_AFTER_S, Alert, Watcher, WatchResult

MAX_POINTS = 11000  # Prometheus refuses a range query of more points per series
DEFAULT_STEP_S = 15.0  # the step when the stored scrape interval cannot be learnt
_EXTRA = ("http_requests_total", "http_request_duration_highr_seconds_count", "process_resident_memory_bytes")
_SINCE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class PrometheusError(TargetError):
    """The Prometheus API cannot be reached, refused the query, or holds nothing for the job."""


def parse_since(text: str) -> float:
    """``6h``, ``30m``, ``90s``, ``2d``, ``1w`` -> seconds.

    Raises:
        ValueError: anything else (the message shows the allowed forms).
    """
    m = _SINCE.match(text or "")
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--since must be a positive duration like 90s, 30m, 6h, 2d or 1w; got {text!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


class PrometheusAPI:
    """The few read-only calls of Prometheus's HTTP API that the range judge needs.

    Args:
        base: the Prometheus server, e.g. ``http://127.0.0.1:9090``.
        client: an ``httpx.Client`` (tests pass one bound to a fake).
    """

    def __init__(self, base: str, client: httpx.Client | None = None) -> None:
        self.base = base.rstrip("/")
        self.client = client or httpx.Client(timeout=60.0)

    def _get(self, path: str, params: dict | list) -> object:
        try:
            r = self.client.get(f"{self.base}{path}", params=params)
        except httpx.HTTPError as exc:
            raise PrometheusError(f"{self.base}{path}: {type(exc).__name__}: {exc}") from exc
        try:
            body = r.json()
        except ValueError as exc:
            raise PrometheusError(f"{self.base}{path} answered HTTP {r.status_code} with no JSON: is this a "
                                  "Prometheus server?") from exc
        if r.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"{self.base}{path} answered HTTP {r.status_code}: {body.get('errorType', '')} "
                                  f"{body.get('error', '')}".strip())
        return body.get("data")

    def label_values(self, label: str, selector: str) -> list[str]:
        """Values of ``label`` over the series that match ``selector``."""
        return list(self._get(f"/api/v1/label/{label}/values", [("match[]", selector)]) or [])

    def query(self, query: str, at: float) -> list[dict]:
        """An instant query at ``at`` (s since the epoch): ``[{"metric": {...}, "value": [t, "v"]}, ...]``."""
        data = self._get("/api/v1/query", {"query": query, "time": f"{at:.3f}"})
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            raise PrometheusError(f"query answered {type(data).__name__}, not a vector")
        return data.get("result") or []

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict]:
        """``[{"metric": {...labels}, "values": [[t, "v"], ...]}, ...]``."""
        data = self._get("/api/v1/query_range", {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                 "step": f"{step:g}"})
        if not isinstance(data, dict) or data.get("resultType") != "matrix":
            raise PrometheusError(f"query_range answered {type(data).__name__}, not a matrix")
        return data.get("result") or []


def _selector(job: str, instance: str | None, label: str = "instance") -> str:
    sel = f'job="{job}"'
    if instance:
        sel += f',{label}="{instance}"'
    return "{" + sel + "}"


def pages_from_matrix(result: list[dict], label: str = "instance") -> list[tuple[float, MetricsPage]]:
    """Rebuild one ``MetricsPage`` per step from a range query's matrix (``job``, ``instance``
    and the replica ``label`` dropped; NaN and stale points left out)."""
    drop = {"__name__", "job", "instance", label}
    by_t: dict[float, list[Sample]] = {}
    for series in result:
        labels = {k: v for k, v in series.get("metric", {}).items() if k not in drop}
        name = series.get("metric", {}).get("__name__")
        if not name:
            continue
        for t, v in series.get("values", []):
            value = float(v)
            if value != value:  # NaN
                continue
            by_t.setdefault(float(t), []).append(Sample(name, labels, value))
    return [(t, MetricsPage(by_t[t])) for t in sorted(by_t)]


def judge_range(prometheus: str, job: str, since_s: float, *, step_s: float | None = None,
                instance: str | None = None, end: float | None = None, server_kind: str = "auto",
                stuck_after_s: float = DEFAULT_STUCK_AFTER_S, idle_scrapes: int = IDLE_SCRAPES,
                on_line: Callable[[str], None] = print, client: httpx.Client | None = None,
                label: str = "instance") -> WatchResult:
    """Judge the last ``since_s`` seconds (up to ``end``, default now) of ``job`` in Prometheus:
    one replica, or each of a fleet (``judge_fleet``).

    Args:
        step_s: the query step (default: the interval at which Prometheus stored the job's
            samples, else ``DEFAULT_STEP_S``; never so fine that a series exceeds ``MAX_POINTS``
            points). Idle points need ``idle_scrapes`` idle steps in a row.
        instance: judge only the replica whose ``label`` has this value (default: every one).
        label: the label that tells the job's replicas apart (``instance``, or e.g. ``pod``).

    Raises:
        PrometheusError: Prometheus unreachable or refusing, the job unknown, or no series of a
            known server (each a one-line message).
    """
    api = PrometheusAPI(prometheus, client)
    end = end if end is not None else time.time()
    step = max(step_s, since_s / (MAX_POINTS - 1)) if step_s else None
    instances = api.label_values(label, _selector(job, None))
    if not instances:
        raise PrometheusError(f"Prometheus at {api.base} holds no series of job {job!r} with a {label!r} label "
                              "(check --job: the job_name of its scrape config; --instance-label)")
    if instance is None and len(instances) > 1:
        return judge_fleet(api, job, instances, since_s, end, step, label=label, server_kind=server_kind,
                           stuck_after_s=stuck_after_s, idle_scrapes=idle_scrapes, on_line=on_line)
    return _judge_one(api, job, instance or instances[0], since_s, end, step, label=label, server_kind=server_kind,
                      stuck_after_s=stuck_after_s, idle_scrapes=idle_scrapes, on_line=on_line)


def stored_interval(api: PrometheusAPI, series: str, since_s: float, end: float) -> float | None:
    """Seconds between the samples Prometheus stored for ``series`` (a selector) over the last
    ``since_s`` seconds before ``end``: the range over its sample count (``count_over_time``).
    None when Prometheus does not answer the query or holds fewer than two samples."""
    try:
        result = api.query(f"count_over_time({series}[{max(1, round(since_s))}s])", end)
        count = max(float(r["value"][1]) for r in result) if result else 0.0
    except (PrometheusError, KeyError, IndexError, TypeError, ValueError):
        return None
    return since_s / count if count >= 2 else None


def _pick_step(step: float | None, scrape_s: float | None, since_s: float) -> float:
    """The query step: the one asked for, else the stored interval, else ``DEFAULT_STEP_S``;
    never finer than ``MAX_POINTS`` points allow (seconds)."""
    return max(step or scrape_s or DEFAULT_STEP_S, since_s / (MAX_POINTS - 1))


def _coarse_hint(res: WatchResult, step: float, scrape_s: float | None, idle_scrapes: int) -> str:
    """The summary's tail when too few idle points may only mean a step too coarse to see the
    idle stretches ("" when the step is already as fine as the stored samples)."""
    if res.verdict != "INCONCLUSIVE" or len(res.idle_points) >= 2:
        return ""
    if scrape_s is None:
        return (f"; at a {step:g} s step an idle stretch shows only if it lasts {idle_scrapes} steps "
                f"({idle_scrapes * step:g} s): try a smaller --interval (e.g. --interval 1)")
    if step < 2 * scrape_s:
        return ""
    return (f"; at a {step:g} s step an idle stretch shows only if it lasts {idle_scrapes} steps "
            f"({idle_scrapes * step:g} s), while Prometheus stored a sample every {scrape_s:.3g} s: "
            f"try --interval {max(1, round(scrape_s)):g}")


def _judge_one(api: PrometheusAPI, job: str, instance: str, since_s: float, end: float, step: float | None, *,
               label: str, server_kind: str, stuck_after_s: float, idle_scrapes: int,
               on_line: Callable[[str], None]) -> WatchResult:
    """One replica's range through the adapter and a ``Watcher`` (``judge_range``'s arguments)."""
    start = end - since_s
    sel = _selector(job, instance, label)
    names = api.label_values("__name__", sel)
    probe = MetricsPage([Sample(n, {}, 0.0) for n in names])
    try:
        adapter = detect_kind(probe, server_kind)
    except (UnknownServerError, ValueError) as exc:
        raise PrometheusError(f"job {job!r}: {exc}") from exc
    wanted = {m.series.split("{")[0] for m in METRIC_NAMES if m.kind == adapter.kind} | set(_EXTRA)
    query_names = sorted(wanted & set(names))
    pattern = "|".join(re.escape(n) for n in query_names)
    query = "{" + f'job="{job}",{label}="{instance}",__name__=~"{pattern}"' + "}"
    scrape_s = stored_interval(api, "{" + f'job="{job}",{label}="{instance}",__name__="{query_names[0]}"' + "}",
                               since_s, end) if query_names else None
    step = _pick_step(step, scrape_s, since_s)
    pages = pages_from_matrix(api.query_range(query, start, end, step), label)
    if not pages:
        raise PrometheusError(f"job {job!r} ({instance}) has no sample between "
                              f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(start))} and "
                              f"{time.strftime('%H:%M:%S', time.localtime(end))}")
    first = None
    w = None
    skipped = 0
    for t, page in pages:
        try:
            r = adapter.read(page)
        except (KeyError, ValueError):
            skipped += 1
            continue
        if w is None:
            first = r
            w = Watcher(adapter.kind, r.unit, gauge_lag_s=adapter.gauge_lag_s, stuck_after_s=stuck_after_s,
                        idle_scrapes=idle_scrapes, on_line=on_line)
        rss = page.total("process_resident_memory_bytes")
        w.feed(t, r, {"bytes": rss, "source": "process_resident_memory_bytes (the server's API process)"}
               if rss is not None else None)
    if w is None:
        raise PrometheusError(f"job {job!r}: none of the {len(pages)} steps could be read as a {adapter.kind} page")
    if adapter.extra_paths:
        w.notes.append(f"{adapter.kind}: {', '.join(adapter.extra_paths)} is not in Prometheus: no KV occupancy")
    w.notes.append(f"{adapter.kind}: {adapter.caveat}")
    if skipped:
        w.notes.append(f"{skipped} steps lacked the series the adapter needs and were skipped")
    info = {"mode": "prometheus", "prometheus": api.base, "job": job, label: instance,
            "server_kind": adapter.kind, "start": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)),
            "end": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(end)), "since_s": since_s, "step_s": step,
            "steps": len(pages), "series_queried": len(query_names), "kv_total": first.kv_total if first else None,
            "stored_interval_s": scrape_s}
    res = w.result(info)
    res.summary += _coarse_hint(res, step, scrape_s, idle_scrapes)
    return res


# a fleet's verdict is its worst replica's, in this order
_SEVERITY = (Verdict.LEAK, Verdict.ZOMBIE, Verdict.HOST_LEAK, Verdict.INCONCLUSIVE, Verdict.CLEAN)


def judge_fleet(api: PrometheusAPI, job: str, instances: list[str], since_s: float, end: float, step: float | None, *,
                label: str = "instance", server_kind: str = "auto", stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
                idle_scrapes: int = IDLE_SCRAPES, on_line: Callable[[str], None] = print) -> WatchResult:
    """Judge each replica of ``job`` (``instances``: the values of ``label``) on its own and
    combine without averaging: the verdict of the worst replica (``_SEVERITY``), a summary that
    names every replica that is not CLEAN, ``instances`` with one row per replica (``instance``,
    ``verdict``, ``summary``, ``idle_points``, ``kv_total``), the alerts and notes prefixed with
    their replica, the samples with an ``instance`` column.

    Raises:
        PrometheusError: as ``judge_range``, for any replica.
    """
    import pandas as pd

    per: dict[str, WatchResult] = {}
    for inst in instances:
        on_line(f"{label} {inst}:")
        per[inst] = _judge_one(api, job, inst, since_s, end, step, label=label, server_kind=server_kind,
                               stuck_after_s=stuck_after_s, idle_scrapes=idle_scrapes,
                               on_line=lambda line, i=inst: on_line(f"  {i}: {line}"))
    rows = [{"instance": i, "verdict": r.verdict, "summary": r.summary, "idle_points": len(r.idle_points),
             "kv_total": r.info.get("kv_total")} for i, r in per.items()]
    verdict = min((r.verdict for r in per.values()), key=lambda v: _SEVERITY.index(v) if v in _SEVERITY else 0)
    bad = [row for row in rows if row["verdict"] != Verdict.CLEAN]
    clean = [row["instance"] for row in rows if row["verdict"] == Verdict.CLEAN]
    n = len(rows)
    if not bad:
        summary = f"CLEAN: every one of the {n} replicas ({label}) is CLEAN: {', '.join(clean)}"
    else:
        named = "; ".join(f"{row['instance']}: {row['summary']}" for row in bad)
        rest = f"; CLEAN: {', '.join(clean)}" if clean else ""
        summary = f"{verdict} on {len(bad)} of {n} replicas ({label}): {named}{rest}"
    alerts = [Alert(a.flag, a.time, a.idle_point, f"{i}: {a.message}") for i, r in per.items() for a in r.alerts]
    notes = list(dict.fromkeys(f"{i}: {note}" for i, r in per.items() for note in r.notes))
    frames = [r.samples.assign(instance=i) for i, r in per.items() if not r.samples.empty]
    samples = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    first = next(iter(per.values()))
    info = {k: v for k, v in first.info.items() if k != label} | {"replica_label": label, "replicas": n}
    return WatchResult(verdict, summary, first.server_kind, first.unit, [], alerts, samples, info, notes,
                       instances=rows)


class PrometheusTarget:
    """A range of a server's metrics that a Prometheus server holds: the ``LeakCheckTarget``
    around ``judge_range`` (no request is sent, to Prometheus's API or to the inference server).

    Args:
        prometheus: the Prometheus server's URL.
        job: the scrape job of the inference server.
        since: how far back, e.g. ``90s``, ``30m``, ``6h`` (``parse_since``).
        instance: judge only this replica (default: every replica of the job, a verdict each).
        server_kind: the adapter, or "auto" (from the series).
        step_s: the query step (None: the interval of the stored samples, ``judge_range``).
        stuck_after_s: the ``running-stuck`` window, seconds.
        end: the range's end (``time.time()`` seconds; default: now).
        client: the ``httpx.Client`` for Prometheus's API (tests pass one bound to a fake).
        label: the label that tells the job's replicas apart (``instance``, or e.g. ``pod``).

    Raises:
        ValueError: no ``job``, or ``since`` is not a duration (the message says what is allowed).
    """

    kind = "prometheus"
    interruptible = None

    def __init__(self, prometheus: str, job: str | None, since: str, *, instance: str | None = None,
                 server_kind: str = "auto", step_s: float | None = None,
                 stuck_after_s: float = DEFAULT_STUCK_AFTER_S, end: float | None = None,
                 client: httpx.Client | None = None, label: str = "instance") -> None:
        if not job:
            raise ValueError("--prometheus needs --job NAME (the job_name of the scrape config that scrapes the "
                             "server)")
        self.prometheus, self.job, self.since = prometheus, job, since
        self.since_s = parse_since(since)
        self.instance, self.server_kind, self.step_s, self.stuck_after_s = instance, server_kind, step_s, stuck_after_s
        self.end, self.client, self.label = end, client, label

    def describe(self) -> str:
        return f"{self.prometheus}: job {self.job}, the last {self.since}"

    def run(self, plan: TargetPlan, *, stop: threading.Event | None = None) -> TargetRun:
        """Query the range and judge it (``judge_range``); idle points and alerts go to ``plan.on_line``.

        Raises:
            PrometheusError: Prometheus unreachable or refusing, or nothing of the job to judge.
        """
        plan.on_line(f"leak-check prometheus: {self.describe()}")
        res = judge_range(self.prometheus, self.job, self.since_s, step_s=self.step_s, instance=self.instance,
                          end=self.end, server_kind=self.server_kind, stuck_after_s=self.stuck_after_s,
                          on_line=plan.on_line, client=self.client, label=self.label)
        return res.as_target_run(self.kind)
