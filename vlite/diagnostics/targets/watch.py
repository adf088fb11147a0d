"""Passive leak watch: judge a production server from its own ``/metrics``, sending no request.

Operators notice leaks over hours (vllm#27073: KV usage stuck near 100% for 6 h; vllm#44175:
+0.57 GiB over 12 h) and cannot point a replay with aborts at production. ``vlite leak-check
--watch --url URL`` only scrapes: ``/metrics`` (through the server's adapter,
``readers/adapters.py``) and, when the server runs on this host, its process tree's memory. The
same judge reads a range a Prometheus server already holds (``prometheus_range.py``).

**Idle points.** A natural idle point is the end of the first ``idle_scrapes`` scrapes in a row
with ``running == waiting == 0`` and no request counter moving (a short request can start and end
between two scrapes: only its counters show it), after traffic since the last one. The first is
the baseline.

**Flags** (each an alert line when first raised; any flag makes the verdict):

* ``kv-held`` (LEAK): KV used at an idle point above the baseline's. Evictable prefix-cache
  entries are free in every adapter, so prefix-cache retention never counts. On a server whose
  idle gauges lag (SGLang: ``adapter.gauge_lag_s``) the KV must stay up for that long into the
  idle stretch, or at the next idle point.
* ``running-stuck`` (ZOMBIE): the running gauge stayed above 0 for ``stuck_after_s`` while no
  request finished or was aborted (SGLang#36333: ``num_running_reqs`` stuck at 3).
* ``uncounted`` (an alert, no verdict): requests the HTTP layer answered (vLLM's
  ``http_requests_total`` of the generation routes) that the engine never counted as finished or
  aborted, at an idle point: aborts the server never counted. Only where the server exports both
  counters (vLLM). vLLM 0.32 counts no client abort at all (measured), so this is informational:
  the KV and running checks say whether the uncounted requests cost anything.
* ``host-memory`` (HOST-LEAK): process memory at the idle points against requests served, the
  plateau test of ``host_memory.py`` (the later half of the idle points keeps its slope above
  ``ANON_SLOPE_BYTES`` per request, and where one interval is a one-time step, the idle points
  after it do); ``RssAnon + VmSwap`` of the process tree on this host, else
  the server's own ``process_resident_memory_bytes`` (the API server process only).

* ``log-signature`` (an alert, no verdict): with ``--server-log FILE``, a line the server wrote
  to its log since the watch began carries one of the servers' own messages about aborts,
  zombies or leaked KV (``checks/log_signatures.py``); one alert per message, the counts in the
  report. The KV and running checks judge; the log says why.

Verdict: CLEAN (0), LEAK / ZOMBIE / HOST-LEAK (1, the first such flag), INCONCLUSIVE (3: fewer
than two idle points, or no KV gauge and nothing else flagged).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from vlite.diagnostics.checks.host_memory import ANON_SLOPE_BYTES, MIN_POINTS, step_test
from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.readers.adapters import MetricsReading
from vlite.diagnostics.targets.base import TargetPlan, TargetRun, exit_code
from vlite.diagnostics.targets.connection import IDLE_SCRAPES, Connection

# "uncounted" is an alert without a verdict: vLLM 0.32 never counts client aborts in
# request_success_total (measured: tests/interop/vllm_zombie.sh), so on vLLM it is the normal case.
FLAG_VERDICT = {"kv-held": Verdict.LEAK, "running-stuck": Verdict.ZOMBIE, "uncounted": None,
                "host-memory": Verdict.HOST_LEAK, "log-signature": None}
DEFAULT_STUCK_AFTER_S = 300.0


@dataclass
class WatchIdlePoint:
    """One natural idle point: ``time`` (s since the epoch), KV used (the adapter's unit), requests
    served since the watch began, memory (bytes; None where unknown), HTTP requests the engine
    never accounted (None where not exported)."""

    index: int
    time: float
    kv_used: float | None
    requests_served: float
    memory_bytes: float | None
    memory_source: str | None
    uncounted: float | None
    generation_tokens: float | None


@dataclass
class Alert:
    flag: str
    time: float
    idle_point: int | None
    message: str


@dataclass
class WatchResult:
    verdict: str
    summary: str
    server_kind: str
    unit: str
    idle_points: list[WatchIdlePoint]
    alerts: list[Alert]
    samples: pd.DataFrame
    info: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    memory_test: dict | None = None
    instances: list[dict] | None = None  # a fleet judged replica by replica (prometheus_range.judge_fleet)

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)

    def as_target_run(self, kind: str) -> TargetRun:
        """This result as the ``TargetRun`` of a target of ``kind`` ("watch" or "prometheus")."""
        return TargetRun(kind, self.verdict, self.summary, self, self.samples, self.info, self.notes)


def _served(r: MetricsReading) -> float | None:
    """Requests the engine finished (any reason), else None."""
    return r.requests_finished if getattr(r, "requests_finished", None) is not None else None


class Watcher:
    """The passive judge: feed it one reading per scrape (``feed``); it finds idle points, raises
    flags and keeps the report current. Pure: time comes from the caller, so recorded ranges
    (Prometheus) and live scrapes go through the same code.

    Args:
        kind, unit: the server's adapter kind and KV unit.
        gauge_lag_s: how long the server's idle gauges may lag (``Adapter.gauge_lag_s``).
        stuck_after_s: the ``running-stuck`` window, seconds.
        idle_scrapes: scrapes in a row that make an idle point.
        kv_tol: KV above the baseline by more than this is held (0 for blocks / tokens).
        on_line: called with each line to print (idle points and alerts).
        on_idle: called after each idle point (the report writer).
    """

    def __init__(self, kind: str, unit: str, *, gauge_lag_s: float = 0.0, stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
                 idle_scrapes: int = IDLE_SCRAPES, kv_tol: float | None = None,
                 on_line: Callable[[str], None] | None = None, on_idle: Callable[[Watcher], None] | None = None) -> None:
        self.kind, self.unit = kind, unit
        self.gauge_lag_s, self.stuck_after_s, self.idle_scrapes = gauge_lag_s, stuck_after_s, idle_scrapes
        self.kv_tol = kv_tol if kv_tol is not None else (1e-6 if unit == "fraction" else 0.0)
        self.on_line = on_line or (lambda line: None)
        self.on_idle = on_idle or (lambda w: None)
        self.rows: list[dict] = []
        self.idle_points: list[WatchIdlePoint] = []
        self.alerts: list[Alert] = []
        self.notes: list[str] = []
        self.memory_test: dict | None = None
        self._idle_run = 0
        self._idle_start: float | None = None
        self._active = True  # traffic since the last idle point (the first idle point is the baseline)
        self._last_counts: tuple | None = None
        self._stuck_since: float | None = None
        self._pending_kv: WatchIdlePoint | None = None
        self._first: MetricsReading | None = None
        self._first_served: float | None = None
        self._first_uncounted: float | None = None
        self.log_signatures = None  # a checks.log_signatures.SignatureCounter once a log line is fed

    # -- state -------------------------------------------------------------------------------
    @property
    def flags(self) -> set[str]:
        return {a.flag for a in self.alerts}

    def verdict(self) -> tuple[str, str]:
        """(verdict, one-line summary) from the alerts so far."""
        judged = [a for a in self.alerts if FLAG_VERDICT[a.flag]]
        if judged:
            first = judged[0]
            verdict = FLAG_VERDICT[first.flag]
            others = sorted({a.flag for a in self.alerts} - {first.flag})
            also = f" (also flagged: {', '.join(others)})" if others else ""
            return verdict, f"{verdict}: {first.message}{also}"
        n = len(self.idle_points)
        if n < 2:
            return Verdict.INCONCLUSIVE, (f"INCONCLUSIVE: {n} natural idle point(s) seen; the judge needs a "
                                          "baseline and at least one idle point after traffic")
        if self._first is not None and self._first.kv_used is None:
            return Verdict.INCONCLUSIVE, (f"INCONCLUSIVE: this {self.kind} server exports no KV gauge; nothing "
                                          f"else was flagged over {n} idle points")
        base = self.idle_points[0].kv_used
        unc = self.idle_points[-1].uncounted
        counted = ("" if unc is None else "every request counted" if unc <= 0 else
                   f"{unc:g} requests never counted by the engine (flagged: aborts the server does not count)")
        return Verdict.CLEAN, (f"CLEAN: KV back to its baseline ({base:g} {self.unit}) at all {n} natural idle points; "
                               f"no request stuck running; host memory below its threshold{'; ' + counted if counted else ''}")

    def _alert(self, flag: str, t: float, idle: int | None, message: str) -> None:
        if flag in self.flags:
            return
        self.alerts.append(Alert(flag, t, idle, message))
        self.on_line(f"ALERT {flag}: {message}")

    # -- feeding -----------------------------------------------------------------------------
    def feed_log(self, t: float, lines: list[str]) -> None:
        """New lines of the server's log at time ``t`` (s): an alert for each server message
        about aborts, zombies or leaked KV seen for the first time (``checks/log_signatures.py``)."""
        from vlite.diagnostics.checks.log_signatures import SignatureCounter, describe

        if self.log_signatures is None:
            self.log_signatures = SignatureCounter()
        for name in self.log_signatures.feed(lines):
            h = self.log_signatures.hits[name]
            message = f"the server logged {describe(h)}; e.g. {h['example']!r}"
            self.alerts.append(Alert("log-signature", t, None, message))
            self.on_line(f"ALERT log-signature: {message}")

    def feed(self, t: float, r: MetricsReading, memory: dict | None = None) -> None:
        """One scrape at time ``t`` (s). ``memory``: ``{"bytes": ..., "source": ...}`` or None."""
        memory = memory or {}
        if self._first is None:
            self._first = r
            self._first_served = _served(r)
            self._first_uncounted = _uncounted(r)
        self.rows.append({"time": t, **r.row(), "memory_bytes": memory.get("bytes"),
                          "memory_source": memory.get("source")})
        counts = (_served(r), r.aborted, r.generation_tokens)
        moved = self._last_counts is not None and counts != self._last_counts
        quiet = r.idle and not moved  # a request may start and end between two scrapes: its counters move
        if not quiet:
            self._active = True
        self._check_stuck(t, r, moved)
        self._last_counts = counts
        if quiet:
            self._idle_run += 1
            if self._idle_run == 1:
                self._idle_start = t
            if self._idle_run == self.idle_scrapes and self._active:
                self._idle_point(t, r, memory)
            self._check_pending(t, r)
        else:
            self._idle_run = 0

    def _check_stuck(self, t: float, r: MetricsReading, moved: bool) -> None:
        if r.num_running <= 0:
            self._stuck_since = None
            return
        finished_or_aborted = self._last_counts is not None and (
            (_served(r), r.aborted) != self._last_counts[:2])
        if self._stuck_since is None or finished_or_aborted:
            self._stuck_since = t
        elif t - self._stuck_since >= self.stuck_after_s:
            self._alert("running-stuck", t, None,
                        f"{r.num_running} request(s) running for {t - self._stuck_since:.0f} s with no request "
                        f"finished or aborted (the running gauge never returned to 0)")

    def _idle_point(self, t: float, r: MetricsReading, memory: dict) -> None:
        served = (_served(r) or 0.0) - (self._first_served or 0.0)
        unc = _uncounted(r)
        unc = None if unc is None else unc - (self._first_uncounted or 0.0)
        p = WatchIdlePoint(len(self.idle_points) + 1, t, r.kv_used, served, memory.get("bytes"), memory.get("source"),
                           unc, r.generation_tokens)
        self.idle_points.append(p)
        self._active = False
        base = self.idle_points[0]
        held = None if (p.kv_used is None or base.kv_used is None) else p.kv_used - base.kv_used
        line = (f"idle point {p.index} at {time.strftime('%H:%M:%S', time.localtime(t))}: KV used "
                f"{_fmt(p.kv_used)} {self.unit} (baseline {_fmt(base.kv_used)}), {served:g} requests served")
        if p.memory_bytes is not None:
            line += f", memory {p.memory_bytes / 2**20:.1f} MiB"
        if unc is not None:
            line += f", {unc:g} uncounted"
        self.on_line(line)
        if held is not None and held > self.kv_tol:
            if self.gauge_lag_s <= 0 or self._pending_kv is not None:
                self._kv_alert(t, p, held)
            else:
                self._pending_kv = p
        elif held is not None:
            self._pending_kv = None
        if unc is not None and unc > 0:
            self._alert("uncounted", t, p.index,
                        f"{unc:g} requests answered over HTTP were never counted by the engine as finished or "
                        f"aborted (at idle point {p.index}): aborts the server never counted")
        self._check_memory(t, p)
        self.on_idle(self)

    def _kv_alert(self, t: float, p: WatchIdlePoint, held: float) -> None:
        self._alert("kv-held", t, p.index,
                    f"{held:g} {self.unit} of KV cache held at natural idle point {p.index} (baseline "
                    f"{_fmt(self.idle_points[0].kv_used)}, now {_fmt(p.kv_used)}; running == waiting == 0; evictable "
                    f"prefix-cache entries count as free)")

    def _check_pending(self, t: float, r: MetricsReading) -> None:
        """A lagging server's KV must stay up for ``gauge_lag_s`` into the idle stretch."""
        p = self._pending_kv
        if p is None or self._idle_start is None or r.kv_used is None:
            return
        base = self.idle_points[0].kv_used or 0.0
        if r.kv_used - base <= self.kv_tol:
            self._pending_kv = None
        elif t - self._idle_start >= self.gauge_lag_s:
            self._kv_alert(t, p, r.kv_used - base)

    def _check_memory(self, t: float, p: WatchIdlePoint) -> None:
        pts = [q for q in self.idle_points if q.memory_bytes is not None]
        if len(pts) < MIN_POINTS:
            return
        test = step_test([q.requests_served for q in pts], [float(q.memory_bytes) for q in pts], ANON_SLOPE_BYTES)
        test["source"] = pts[-1].memory_source
        self.memory_test = test
        if test["keeps_growing"]:
            self._alert("host-memory", t, p.index,
                        f"{p.memory_source} keeps growing: {pts[0].memory_bytes / 2**20:.1f} -> "
                        f"{pts[-1].memory_bytes / 2**20:.1f} MiB, {test['late_slope'] / 1024:.1f} KiB per request "
                        f"served over the later half of {len(pts)} idle points (95% CI above "
                        f"{ANON_SLOPE_BYTES // 1024} KiB/request)")

    def result(self, info: dict | None = None) -> WatchResult:
        verdict, summary = self.verdict()
        frame = pd.DataFrame(self.rows)
        notes = list(self.notes)
        if self._first is not None and _uncounted(self._first) is None:
            notes.append(f"{self.kind}: no HTTP request counter beside the engine's: the 'uncounted' check does not "
                         "apply")
        if self.idle_points and (self.idle_points[0].kv_used or 0) > self.kv_tol:
            notes.append(f"KV used at the first idle point (the baseline) was {_fmt(self.idle_points[0].kv_used)} "
                         f"{self.unit}: blocks held before the watch began are not judged")
        info = dict(info or {})
        if self.log_signatures is not None:
            from vlite.diagnostics.checks.log_signatures import describe

            hits = self.log_signatures.summary()
            info["log_signatures"] = hits
            notes += [f"log signature: {describe(h)}" for h in hits]
        return WatchResult(verdict, summary, self.kind, self.unit, list(self.idle_points), list(self.alerts), frame,
                           info, notes, self.memory_test)


def _uncounted(r: MetricsReading) -> float | None:
    rec = getattr(r, "requests_received", None)
    fin = getattr(r, "requests_finished", None)
    return None if rec is None or fin is None else rec - fin


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:g}"


# -- live watching ------------------------------------------------------------------------------
def local_memory(url: str, server_pid: int | None = None):
    """A callable returning ``{"bytes", "source"}`` for the server's process tree on this host
    (``RssAnon + VmSwap``, else RSS), or None when the server is not local / not found."""
    from vlite.diagnostics.checks.host_memory import anon_swap_bytes
    from vlite.diagnostics.readers.process import ProcessTreeProbe, is_local_url, listening_pid

    pid = server_pid if server_pid is not None else (listening_pid(url) if is_local_url(url) else None)
    if pid is None:
        return None, None
    probe = ProcessTreeProbe(pid)

    def read() -> dict:
        row = probe.read()
        anon = anon_swap_bytes([p["pid"] for p in probe.last_tree]) if probe.last_tree else None
        if anon is not None:
            return {"bytes": anon, "source": f"RssAnon + VmSwap of pid {pid} and its children"}
        return {"bytes": row.get("rss_bytes"), "source": f"RSS of pid {pid} and its children"}
    return read, pid


def watch(conn, *, interval_s: float = 1.0, duration_s: float | None = None, stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
          on_report: Callable[[WatchResult], None] | None = None, on_line: Callable[[str], None] = print, server_pid: int | None = None,
          sleep: Callable[[float], None] | None = None, clock: Callable[[], float] = time.time,
          info: dict | None = None, stop=None, log_path=None) -> WatchResult:
    """Scrape ``conn`` (a ``connection.Connection``) every ``interval_s`` until ``duration_s`` (None:
    until KeyboardInterrupt, Ctrl-C), judging as it goes; sends no request but ``GET /metrics``
    (and the adapter's JSON pages). ``on_report`` (the report writer,
    ``report/watch_report.write_watch_report``) gets the current result at each idle point and at
    the end. A scrape that fails is counted and skipped. ``stop``: a ``threading.Event`` (the CLI's
    first Ctrl-C, ``vlite.cli.interrupt``) that ends the watch like KeyboardInterrupt does.
    ``log_path``: the server's log file, followed from its end like ``tail -f`` (``LogFollower``);
    its new lines go to ``Watcher.feed_log`` after each scrape.

    Raises:
        OSError: ``log_path`` cannot be opened.
    """
    if sleep is None:
        sleep = stop.wait if stop is not None else time.sleep
    mem_read, pid = local_memory(conn.base, server_pid)
    facts = {"mode": "watch", "url": conn.base, "server_kind": conn.adapter.kind, "server_pid": pid,
             "interval_s": interval_s, "duration_s": duration_s, "stuck_after_s": stuck_after_s, **(info or {})}
    first = conn.state()
    w = Watcher(conn.adapter.kind, first.unit, gauge_lag_s=conn.adapter.gauge_lag_s, stuck_after_s=stuck_after_s,
                on_line=on_line)
    if mem_read is None:
        w.notes.append("the server's process is not on this host (or not found; pass --server-pid): no host memory")
    w.notes.append(f"{conn.adapter.kind}: {conn.adapter.caveat}")
    follower = LogFollower(log_path) if log_path is not None else None
    if follower is not None:
        facts["server_log"] = str(log_path)
    errors = 0
    start = clock()

    def current() -> WatchResult:
        facts.update(scrape_errors=errors, watched_s=round(clock() - start, 1), scrapes=len(w.rows))
        return w.result(facts)

    if on_report is not None:
        w.on_idle = lambda _w: on_report(current())
    try:
        while duration_s is None or clock() - start < duration_s:
            if stop is not None and stop.is_set():
                facts["stopped_by"] = "Ctrl-C"
                break
            t = clock()
            try:
                r = conn.state()
            except Exception as exc:  # noqa: BLE001 - a failed scrape is counted, the watch goes on
                errors += 1
                if errors in (1, 10, 100):
                    on_line(f"scrape failed ({errors} so far): {exc}")
                sleep(interval_s)
                continue
            mem = None
            if mem_read is not None:
                try:
                    mem = mem_read()
                except Exception:  # noqa: BLE001 - the process may have gone
                    mem = None
            w.feed(t, r, mem)
            if follower is not None:
                w.feed_log(t, follower.read_new())
            sleep(max(0.0, interval_s - (clock() - t)))
    except KeyboardInterrupt:
        facts["stopped_by"] = "Ctrl-C"
    if follower is not None:
        w.feed_log(clock(), follower.read_new())
        follower.close()
    res = current()
    if on_report is not None:
        on_report(res)
    return res


class LogFollower:
    """A server's log file read from its end on, like ``tail -f``: ``read_new`` returns the whole
    lines written since the last call (a file truncated or rotated is read again from its start).

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path) -> None:
        self.path = path
        self._f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._f.seek(0, 2)
        self._rest = b""

    def read_new(self) -> list[str]:
        import os

        try:
            if os.stat(self.path).st_size < self._f.tell():  # truncated or rotated in place
                self._f.seek(0)
                self._rest = b""
        except OSError:
            return []
        data = self._rest + self._f.read()
        *whole, self._rest = data.split(b"\n")
        return [line.decode(errors="replace") for line in whole]

    def close(self) -> None:
        self._f.close()


class WatchTarget:
    """A running server watched without sending a request: the ``LeakCheckTarget`` around ``watch``.

    Args:
        conn: the server (``connection.connect``).
        interval_s: seconds between scrapes.
        duration_s: stop after this many seconds (None: at the first Ctrl-C, ``stop``).
        stuck_after_s: the ``running-stuck`` window, seconds.
        server_pid: the server's root process (default: the one listening on the port).
        server_log: the server's log file to follow for its own messages (None: none).
    """

    kind = "watch"
    interruptible = "the watch"

    def __init__(self, conn: Connection, *, interval_s: float = 1.0, duration_s: float | None = None,
                 stuck_after_s: float = DEFAULT_STUCK_AFTER_S, server_pid: int | None = None,
                 server_log=None) -> None:
        self.conn, self.interval_s, self.duration_s = conn, interval_s, duration_s
        self.stuck_after_s, self.server_pid, self.server_log = stuck_after_s, server_pid, server_log

    def describe(self) -> str:
        return f"{self.conn.adapter.kind} at {self.conn.base}"

    def run(self, plan: TargetPlan, *, stop: threading.Event | None = None) -> TargetRun:
        """Scrape until ``duration_s`` or ``stop``; idle points and alerts go to ``plan.on_line``,
        the run so far to ``plan.on_report`` at each idle point and at the end."""
        until = f"for {self.duration_s:g} s" if self.duration_s else "until Ctrl-C"
        plan.on_line(f"leak-check --watch: {self.describe()}, scraping every {self.interval_s:g} s {until}; "
                     "no request is sent; Ctrl-C stops and writes the report")
        report = plan.on_report
        res = watch(self.conn, interval_s=self.interval_s, duration_s=self.duration_s,
                    stuck_after_s=self.stuck_after_s,
                    on_report=(lambda r: report(r.as_target_run(self.kind))) if report is not None else None,
                    on_line=plan.on_line, server_pid=self.server_pid, info=plan.info, stop=stop,
                    log_path=self.server_log)
        return res.as_target_run(self.kind)
