"""The vlite-serve target: replay a workload against a running ``vlite serve`` with real clients
that really disconnect (``openai_client.send_request``), scrape ``/metrics`` while it runs (and
count its series per family at each idle point: ``checks/cardinality.py``), and read
``/debug/blocks`` at the end. A control request that gets a 5xx or loses its connection
(``control.py``) is a finding in the report, and the run goes on with what it could read.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from vlite.diagnostics.checks import snapshot
from vlite.diagnostics.checks.cardinality import FamilyCounts, cardinality_check, series_counts
from vlite.diagnostics.checks.detect import detect
from vlite.diagnostics.checks.host_memory import anon_swap_bytes, host_memory_check
from vlite.diagnostics.checks.kind_growth import request_kind, served_by_point
from vlite.diagnostics.checks.result import RunResult
from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.readers.gpu_alloc_trace import GpuAllocationTrace, HttpRecorder
from vlite.diagnostics.readers.metrics_text import labelled_values, parse_page
from vlite.diagnostics.readers.process import listening_pid, process_roles
from vlite.diagnostics.readers.samplers import MemoryProbe, Sampler
from vlite.diagnostics.targets import control
from vlite.diagnostics.targets.base import TargetError, TargetPlan, TargetRun
from vlite.diagnostics.targets.openai_client import send_request, wait_ready
from vlite.diagnostics.workload.replay import IdlePoint, ReplayResult, RequestResult
from vlite.diagnostics.workload.sources import RequestSpec

IDLE_TIMEOUT_S = 120.0  # how long to wait for the server to drain before giving up
POLL_FAILURES = 3  # failed /metrics reads in a row after which the drain polling gives up


def metrics_block_stats(base: str, client: httpx.Client):
    """A sampler source scraping ``{base}/metrics`` (blocks, requests and, where the server
    exports ``vlite:engine_steps_total``, the engine step counter ``num_steps``: None elsewhere)."""

    def read() -> dict:
        m = parse_page(control.get(client, f"{base}/metrics", timeout=5).text, allow_empty=True).first_values()
        total, free = int(m["vlite:num_total_blocks"]), int(m["vlite:num_free_blocks"])
        cached = int(m.get("vlite:num_cached_blocks", 0))
        return {"num_total_blocks": total, "num_free_blocks": free, "num_cached_blocks": cached,
                "num_used_blocks": total - free - cached, "num_running": int(m.get("vlite:num_requests_running", 0)),
                "num_waiting": int(m.get("vlite:num_requests_waiting", 0)), "num_steps": _steps(m)}
    return read


def _steps(m: dict[str, float]) -> int | None:
    """The engine step counter of a parsed /metrics page (None: a server without it)."""
    value = m.get("vlite:engine_steps_total")
    return None if value is None else int(value)


def step_timeline(rows: list[dict]) -> list[tuple[float, int]]:
    """``(time, engine step counter)`` of the sampler's rows that read one, by time (for
    ``pace.step_at``: the step at a client's disconnect)."""
    return sorted((r["time"], int(r["num_steps"])) for r in rows if r.get("num_steps") is not None)


def census_current_metrics(client, base: str, timeout_s: float = 5.0) -> str:
    """The /metrics page once the server's request-id census covers every ended request
    (``vlite:census_pending_requests`` 0; the serving loop runs it at idle points, at most once a
    second), or the last page read after ``timeout_s`` (a server without the census at once)."""
    deadline = time.time() + timeout_s
    while True:
        text = control.get(client, f"{base}/metrics").text
        pending = labelled_values(text, "vlite:census_pending_requests").get("vlite:census_pending_requests")
        if not pending or time.time() > deadline:
            return text
        time.sleep(0.2)


def census_from_metrics(text: str) -> dict | None:
    """The server's last census as the in-process one (``RunResult.findings.census``) from
    ``vlite:ended_requests_held{container}``: which container held how many ended requests (the
    ids stay in the server: ``/debug`` has them), and ``overdue``: each process whose census was
    kept from its idle points, with what blocks it (``vlite:census_overdue_seconds{process,
    blocked_by}``); None when the server exports no census."""
    samples = parse_page(text).samples
    if not any(s.name == "vlite:census_pending_requests" for s in samples):
        return None
    held = [{"path": s.labels.get("container", "?"), "kind": "?", "num_entries": int(s.value), "request_ids": [],
             "client_actions": []} for s in samples if s.name == "vlite:ended_requests_held" and s.value > 0]
    overdue: dict[str, dict] = {}
    for s in samples:
        if s.name == "vlite:census_overdue_seconds":
            o = overdue.setdefault(s.labels.get("process", "?"), {"process": s.labels.get("process", "?"),
                                                                  "seconds": s.value, "blocked_by": []})
            o["blocked_by"].append(s.labels.get("blocked_by", "?"))
    return {"held": held, "objects_visited": None, "elapsed_ms": None, "truncated": False,
            "overdue": list(overdue.values()), "source": "the server's /metrics (vlite:ended_requests_held)"}


def http_greedy(base: str, client: httpx.Client):
    """Greedy calibration runs over HTTP (calibrate.py): completions with logprobs give each
    token's text; /tokenize of the text gives the ids. One request at a time: ``stop`` (a first
    Ctrl-C) is read before each, so calibration ends within one request."""

    def run(items, stop=None, on_done=None):
        out = []
        for spec, max_tokens in items:
            if stop is not None and stop.is_set():
                out.append(None)
                continue
            body = {"prompt": spec.prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                    "logprobs": 0}
            try:
                r = client.post(f"{base}/v1/completions", json=body, timeout=120)
                choice = r.json()["choices"][0]
                pieces = (choice.get("logprobs") or {}).get("tokens") or []
                texts = [""]
                for p in pieces:
                    texts.append(texts[-1] + p)
                ids = client.post(f"{base}/tokenize", json={"prompt": choice.get("text", ""),
                                                            "add_special_tokens": False}).json().get("tokens", [])
            except (httpx.HTTPError, KeyError, ValueError, IndexError):
                ids, texts = [], [""]
            out.append((list(ids), texts))
            if on_done is not None:
                on_done(len(out))
        return out
    return run


def server_max_model_len(base: str, client: httpx.Client, headers: dict | None = None) -> int | None:
    """The served model's max_model_len (tokens) from ``/v1/models`` (vLLM's and vlite's
    ``max_model_len`` field), or None when the server does not say."""
    try:
        data = client.get(f"{base}/v1/models", headers=headers).json().get("data") or [{}]
        value = data[0].get("max_model_len")
    except (httpx.HTTPError, ValueError, AttributeError, TypeError, IndexError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


async def _wait_idle(base: str, client: httpx.AsyncClient, marks: dict | None = None,
                     timeout_s: float = IDLE_TIMEOUT_S, errors: list[dict] | None = None) -> bool:
    """Poll /metrics until nothing runs or waits twice in a row (bounded by ``timeout_s``).
    ``marks`` gets ``quiet_t`` (the time of the first of those quiet reads) and, where the server
    counts its steps, ``first_steps`` (the counter at the first read) and ``quiet_steps``. A read
    that fails (5xx, dropped connection) goes to ``errors``; after ``POLL_FAILURES`` in a row
    the wait gives up (False), as for a server that never drained."""
    deadline, quiet, failures = time.time() + timeout_s, 0, 0
    while time.time() < deadline:
        t = time.time()
        try:
            m = parse_page(control.checked(await client.get(f"{base}/metrics")).text, allow_empty=True).first_values()
        except control.CONTROL_FAILURES as exc:
            control.failed("GET /metrics (drain polling)", exc, errors)
            failures, quiet = failures + 1, 0
            if failures >= POLL_FAILURES:
                return False
            await asyncio.sleep(0.2)
            continue
        failures = 0
        if marks is not None and "first_steps" not in marks:
            marks["first_steps"] = _steps(m)
        quiet = quiet + 1 if m.get("vlite:num_requests_running", 0) + m.get("vlite:num_requests_waiting", 0) == 0 \
            else 0
        if quiet == 1 and marks is not None:
            marks.update(quiet_t=t, quiet_steps=_steps(m))
        if quiet >= 2:
            return True
        await asyncio.sleep(0.05)
    return False


def waves_of(ordered: list[RequestSpec], idle_every: int) -> list[list[RequestSpec]]:
    """``ordered`` cut into waves of ``idle_every`` requests (all in one for 0); the extra probes
    (``all_paths.is_extra_probe``) ride in the wave they are in, uncounted."""
    from vlite.diagnostics.workload.all_paths import is_extra_probe

    waves: list[list[RequestSpec]] = [[]]
    counted = 0
    for spec in ordered:
        if idle_every and counted == idle_every:
            waves.append([])
            counted = 0
        waves[-1].append(spec)
        counted += 0 if is_extra_probe(spec) else 1
    return [w for w in waves if w]


async def _replay(base: str, specs: list[RequestSpec], max_concurrency: int, idle_every: int,
                  probe, stop=None, interrupt_drain_s: float = 5.0, max_model_len: int | None = None) -> ReplayResult:
    results = {s.request_id: RequestResult(s.request_id, s.action.kind, s.action.label, 0.0) for s in specs}
    out = ReplayResult([results[s.request_id] for s in specs], start_time=time.time())
    ordered = sorted(specs, key=lambda s: s.arrival_s)
    sem = asyncio.Semaphore(max_concurrency)
    t0, completed = out.start_time, 0

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    async def launch(spec: RequestSpec) -> None:
        await asyncio.sleep(max(0.0, spec.arrival_s - (time.time() - t0)))
        async with sem:
            if not stopped():
                await send_request(base, spec, results[spec.request_id], max_model_len=max_model_len)

    def idle_point(completed: int) -> None:
        try:
            out.idle_points.append(IdlePoint(time.time(), completed, *probe()))
        except control.CONTROL_FAILURES as exc:  # no trough here; the finding says why
            control.failed("GET /metrics (idle point)", exc, out.engine_errors)

    async with httpx.AsyncClient(timeout=10.0) as admin:
        await _wait_idle(base, admin, errors=out.engine_errors)
        idle_point(0)
        for wave in waves_of(ordered, idle_every):
            if stopped():
                break
            task = asyncio.ensure_future(asyncio.gather(*(launch(s) for s in wave)))
            while stop is not None and not task.done() and not stop.is_set():
                await asyncio.wait({task}, timeout=0.1)
            if stopped() and not task.done():
                await asyncio.wait({task}, timeout=interrupt_drain_s)  # those in flight may finish
                task.cancel()  # the rest disconnect: the server aborts them
            try:
                await task
            except asyncio.CancelledError:
                pass
            if stopped():
                break
            completed += len(wave)
            left = time.time()  # every client of the wave has finished or gone
            marks: dict = {}
            if not await _wait_idle(base, admin, marks, errors=out.engine_errors):
                break  # still busy after the bound (or unreadable): the final snapshot says what it can
            out.gauge_lags.append(max(0.0, marks["quiet_t"] - left) if "quiet_t" in marks else 0.0)
            if marks.get("first_steps") is not None and marks.get("quiet_steps") is not None:
                out.gauge_lag_steps.append(max(0, marks["quiet_steps"] - marks["first_steps"]))
            idle_point(completed)
        if stopped():
            _mark_interrupted(out)
            await _wait_idle(base, admin, timeout_s=interrupt_drain_s, errors=out.engine_errors)
    out.end_time = time.time()
    return out


def _mark_interrupted(out: ReplayResult) -> None:
    """After a Ctrl-C: requests never sent are "not-sent", those cut off are "aborted"."""
    now, aborted, not_sent = time.time(), 0, 0
    for r in out.requests:
        if r.outcome not in ("pending", "streaming"):
            continue
        if r.arrival_time:
            r.outcome, r.detail, r.abort_time, r.end_time = ("aborted", "the run was interrupted (Ctrl-C): the client "
                                                             "left", now, now)
            aborted += 1
        else:
            r.outcome, r.detail = "not-sent", "the run was interrupted before it was sent"
            not_sent += 1
    ended = sum(1 for r in out.requests if r.outcome not in ("not-sent", "pending"))
    out.interrupted = (f"interrupted (Ctrl-C) after {ended - aborted} of {len(out.requests)} requests had ended; "
                       f"{aborted} in flight aborted, {not_sent} never sent")


def run_http(url: str, specs: list[RequestSpec], *, max_concurrency: int = 32, idle_every: int = 0,
             sample_interval_s: float = 0.1, info: dict | None = None, zombie_options: dict | None = None,
             stop=None, on_progress=None, trace_gpu_allocations: bool = False) -> RunResult:
    """Replay ``specs`` against ``url`` (a running ``vlite serve``), then detect leaks at quiescence.
    ``stop`` (a ``threading.Event`` set by a first Ctrl-C): end the calibration or the replay,
    send no more, drain a few seconds, and report what was measured (verdict INTERRUPTED).
    ``on_progress("calibration", done, total)``: the calibration's progress (``TargetPlan``).
    ``trace_gpu_allocations``: have the server's engine record its CUDA allocator
    (``/debug/gpu_allocations``, ``vlite serve --enable-debug-endpoints``) and name the sites
    whose live bytes grew between idle points (``findings.gpu_allocations``).

    Raises:
        TargetError: the server is unreachable or has no vlite block metrics.
    """
    base = url.rstrip("/")
    sync = httpx.Client(timeout=10.0)
    wait_ready(base, sync)
    source = metrics_block_stats(base, sync)
    try:
        source()
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise TargetError(f"{base}/metrics is not a vlite server's metrics page: {type(exc).__name__}: {exc}") from exc
    from vlite.diagnostics.checks import coverage
    from vlite.diagnostics.workload.calibrate import calibrate, needs_calibration

    if needs_calibration(specs):
        specs = calibrate(specs, http_greedy(base, sync), stop=stop,
                          on_progress=(lambda d, t: on_progress("calibration", d, t)) if on_progress else None)
    errors: list[dict] = []  # control requests outside the replay that failed (findings)
    page = control.try_get(sync, f"{base}/metrics", "GET /metrics (before the replay)", errors)
    metrics_before = page.text if page is not None else ""
    coverage_before = coverage.from_metrics_text(metrics_before)
    pid = listening_pid(base)
    memory = MemoryProbe(pid=pid, include_children=True)  # a tensor-parallel server's workers are its children
    sampler = Sampler(source, memory, sample_interval_s).start()
    series: list[FamilyCounts] = []  # per idle point: series per /metrics family (cardinality.py)
    gpu_tracer = GpuAllocationTrace(HttpRecorder(base, sync)) if trace_gpu_allocations else None
    if gpu_tracer is not None:
        gpu_tracer.start()

    roles = process_roles(pid)  # per process (host_memory.py, kind_growth.py), where the server runs here

    def probe() -> tuple[int, int | None, dict | None]:
        row = source()
        series.append(series_counts(control.get(sync, f"{base}/metrics").text))
        if gpu_tracer is not None:
            gpu_tracer.idle_point()
        host = None
        if roles:
            per = {name: anon_swap_bytes([p]) for name, p in roles.items()}
            host = {"processes": per, "containers": {},
                    "anon_swap_bytes": None if None in per.values() else sum(per.values())}
        return row["num_used_blocks"], memory.read().get("rss_bytes"), host

    t0 = time.time()
    replay: ReplayResult | None = None
    try:
        replay = asyncio.run(_replay(base, specs, max_concurrency, idle_every, probe, stop=stop,
                                     max_model_len=server_max_model_len(base, sync)))
    finally:
        sampler.stop()
        completed = [p.requests_completed for p in replay.idle_points] if replay is not None else []
        gpu_growth = gpu_tracer.stop(completed) if gpu_tracer is not None else None
    sampler.sample()
    snap, final_metrics, debug_on = final_snapshot(sync, base, sampler.rows, errors)
    sync.close()
    snap.coverage = coverage.from_metrics_text(final_metrics) or snap.coverage
    from vlite.diagnostics.checks.pace import itl_p99

    # the server's pace: zombies are judged in its engine steps (the counter sampled during the
    # replay), or where no step is known against a wall-clock bound scaled by its p99 ITL
    zopts = {"step_timeline": step_timeline(sampler.rows), "step_time_s": itl_p99(metrics_before, final_metrics),
             **(zombie_options or {})}
    if not snap.request_history and replay.gauge_lags:  # no per-request timestamps: the running gauge
        zopts["gauge_lag_s"] = round(max(replay.gauge_lags), 3)
        if len(replay.gauge_lag_steps) == len(replay.gauge_lags):
            zopts["gauge_lag_steps"] = max(replay.gauge_lag_steps)
    findings = detect(snap, replay.requests, replay.idle_points, coverage_before=coverage_before,
                      zombie_options=zopts)
    findings.interrupted = replay.interrupted
    findings.engine_errors = replay.engine_errors + errors
    findings.census = census_from_metrics(final_metrics) if final_metrics else None
    if roles:  # a server on this host: its processes' anonymous memory, per process and per request kind
        kinds = {s.request_id: request_kind(s) for s in specs}
        findings.host_memory = host_memory_check(replay.idle_points, served_by_point(
            [p.time for p in replay.idle_points], [(kinds[r.request_id], r.end_time) for r in replay.requests]))
    findings.cardinality = cardinality_check([(p.requests_completed, c) for p, c in zip(replay.idle_points, series)])
    findings.gpu_allocations = gpu_growth
    if pid is None:
        findings.notes.append("server process not found locally: no RSS samples")
    if memory.note:
        findings.notes.append(memory.note)
    facts = {"target": "http", "url": base, "server_pid": pid, "processes": roles, "num_total_blocks": snap.num_total_blocks,
             "num_requests": len(specs), "debug_endpoints": debug_on,
             "gpu_source": memory.gpu_source, "replay_s": round(time.time() - t0, 2),
             "num_preemptions_total": None, "sampler_errors": sampler.errors, **(info or {})}
    if replay.interrupted:
        facts["interrupted"] = replay.interrupted
    return RunResult(findings, sampler.frame(), replay, facts)


def final_snapshot(client: httpx.Client, base: str, rows: list[dict],
                   errors: list[dict]) -> tuple[snapshot.Snapshot, str, bool]:
    """The drained state: ``/debug/blocks`` (the ledger) where it answers, else the counters of
    the last ``/metrics`` page, else those of the last sample taken (``rows``). A read that
    fails goes to ``errors``. Returns (snapshot, the last /metrics page or "", /debug answered).

    Raises:
        TargetError: nothing could be read at all (no page, no sample).
    """
    snap = None
    debug = control.try_get(client, f"{base}/debug/blocks", "GET /debug/blocks (final snapshot)", errors)
    if debug is not None and debug.status_code == 200:
        try:
            snap = snapshot.from_debug_blocks(debug.json())
        except (ValueError, KeyError, TypeError) as exc:
            control.failed("GET /debug/blocks (final snapshot)", exc, errors)
    try:
        text = census_current_metrics(client, base)
    except control.CONTROL_FAILURES as exc:
        control.failed("GET /metrics (final census)", exc, errors)
        text = ""
    if snap is None and text:
        try:
            snap = snapshot.from_metrics(parse_page(text, allow_empty=True).first_values())
        except (ValueError, KeyError) as exc:
            control.failed("GET /metrics (final census)", exc, errors)
    if snap is None:
        last = next((r for r in reversed(rows) if "num_total_blocks" in r), None)
        if last is None:
            raise TargetError(f"{base}: neither /debug/blocks nor /metrics could be read after the replay")
        snap = snapshot.Snapshot(int(last["num_total_blocks"]), int(last["num_free_blocks"]),
                                 int(last["num_used_blocks"]), int(last.get("num_cached_blocks", 0)),
                                 int(last.get("num_running", 0)), int(last.get("num_waiting", 0)), has_ledger=False)
    return snap, text, snap.has_ledger and debug is not None and debug.status_code == 200


class HttpTarget:
    """A running ``vlite serve`` at ``url``, read through ``/metrics`` and ``/debug/blocks``: the
    ``LeakCheckTarget`` around ``run_http``."""

    kind = "vlite-serve"
    interruptible = "the replay"

    def __init__(self, url: str, *, storm_requests: int = 0, wedge_timeout_s: float | None = None) -> None:
        self.url = url
        self.storm_requests, self.wedge_timeout_s = storm_requests, wedge_timeout_s

    def describe(self) -> str:
        return f"vlite serve at {self.url.rstrip('/')}"

    def run(self, plan: TargetPlan, *, stop: threading.Event | None = None) -> TargetRun:
        """``run_http`` with the plan's workload, one idle point every ``plan.wave_size()`` requests.

        Raises:
            TargetError: the server is unreachable or has no vlite block metrics.
        """
        before = None
        if self.storm_requests:
            from vlite.diagnostics.targets.storm import PROBE_RUNS, measure_before

            plan.on_line(f"storm checks: the wedge probe's request ({PROBE_RUNS} times) and the output canary "
                         "(twice) before any client abort")
            with httpx.Client() as client:
                before = measure_before(client, self.url.rstrip("/"))
        run = run_http(self.url, plan.specs, stop=stop, trace_gpu_allocations=plan.trace_gpu_allocations,
                       **plan.replay_options())
        if before is not None and run.findings.interrupted is None:
            self._storm_checks(run, before, plan)
        return TargetRun.of_run_result(self.kind, run)

    def _storm_checks(self, run: RunResult, before: dict, plan: TargetPlan) -> None:
        """The abort storm, the wedge probe and the output canary (``storm.py``) after the replay;
        a storm verdict becomes the run's unless it found a LEAK (``Findings.verdict``), the one it
        replaces a note."""
        from vlite.diagnostics.checks.storm import wedge_bound
        from vlite.diagnostics.targets import storm

        base = self.url.rstrip("/")
        bound = wedge_bound(before["probe_latencies_s"], override_s=self.wedge_timeout_s)
        plan.on_line(f"abort storm: {self.storm_requests} streamed requests at once, all cut together; then the "
                     f"wedge probe (bound {bound:.3g} s) and the output canary")
        with httpx.Client() as client:
            max_tokens = storm.fit_max_tokens(client, base)
            sent = asyncio.run(storm.abort_storm(base, self.storm_requests, max_tokens=max_tokens))
            s = storm.judge_after(client, base, before, bound, sent)
        if s["verdict"] and run.findings.verdict not in (Verdict.CLEAN, Verdict.LEAK):
            run.findings.notes.append(f"before the storm checks: {run.findings.summary(caveat=False)}")
        run.findings.storm = s
