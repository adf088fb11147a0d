"""The probe's thread: a census pass at each idle point of this process, within bounds.

An idle point: the process used less than ``VLITE_PROBE_BUSY_FRACTION`` of one core (its CPU time
less the probe's own) over the last ``VLITE_PROBE_QUIET_S`` seconds, and its other threads blocked
fewer than ``VLITE_PROBE_BUSY_WAITS`` times a second there. A pass is due there when a
reader asked for one (it touches ``<dir>/pass-requested`` at its own idle point: ``vlite leak-check``
does, where the directory is on its host), or when the process did ``MIN_WORK_S`` of work (CPU
time) since the last pass and ``VLITE_PROBE_INTERVAL_S`` passed, or ``REFRESH_S`` after the last. Each pass has a CPU-time budget (``VLITE_PROBE_BUDGET_MS``, default
2000) and a visit budget; what it found is written as names and counts (``export.write``) and the
pass's references to the host's objects are dropped before the thread sleeps again.

Settings (environment, read once per process): ``VLITE_PROBE`` (1 to enable), ``VLITE_PROBE_DIR``
(where each process writes its file; default ``<tmp>/vlite-probe/<session>``, the session being
the pid of the first probed process, passed on to its children in ``VLITE_PROBE_SESSION``),
``VLITE_PROBE_ID_PATTERN`` (a regular expression for request ids, ``walk.DEFAULT_ID_PATTERN``),
``VLITE_PROBE_INTERVAL_S`` (2), ``VLITE_PROBE_QUIET_S`` (1), ``VLITE_PROBE_BUSY_FRACTION`` (0.25),
``VLITE_PROBE_BUSY_WAITS`` (50 voluntary context switches a second),
``VLITE_PROBE_BUDGET_MS`` (2000).
"""

from __future__ import annotations

import collections
import os
import threading
import time

from vlite_probe import export, walk

POLL_S = 0.25
MIN_WORK_S = 0.1  # CPU seconds of the host's since the last pass that make a new one due
REFRESH_S = 60.0
MAX_OBJECTS = 300_000

_lock = threading.Lock()
_started_pid: int | None = None


def _float_env(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _host_waits() -> int:
    """Voluntary context switches of this process's threads but the calling one (Linux's
    RUSAGE_THREAD; 0 where it is missing: the CPU test alone then decides)."""
    try:
        import resource

        return (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                - resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw)
    except (ImportError, AttributeError, OSError, ValueError):
        return 0


def process_name() -> str:
    """This process's role as its host named it: the ``multiprocessing`` name (vLLM's
    ``EngineCore_DP0``, a worker's name) or ``main`` for the process that was started."""
    import multiprocessing

    name = multiprocessing.current_process().name
    return "main" if name == "MainProcess" else name


def session_dir() -> str:
    """Where every process of this server writes its file (``VLITE_PROBE_DIR``, else
    ``<tmp>/vlite-probe/<session>``); the first probed process names the session after its pid."""
    if os.environ.get("VLITE_PROBE_DIR"):
        return os.environ["VLITE_PROBE_DIR"]
    import tempfile

    session = os.environ.setdefault("VLITE_PROBE_SESSION", str(os.getpid()))
    return os.path.join(tempfile.gettempdir(), "vlite-probe", session)


class Probe:
    """The pass loop of one process (``run`` in a daemon thread)."""

    def __init__(self) -> None:
        self.directory = session_dir()
        self.pid = os.getpid()
        self.process = process_name()
        self.id_pattern = os.environ.get("VLITE_PROBE_ID_PATTERN") or walk.DEFAULT_ID_PATTERN
        self.interval_s = _float_env("VLITE_PROBE_INTERVAL_S", 2.0)
        self.quiet_s = _float_env("VLITE_PROBE_QUIET_S", 1.0)
        self.busy_fraction = _float_env("VLITE_PROBE_BUSY_FRACTION", 0.25)
        self.busy_waits = _float_env("VLITE_PROBE_BUSY_WAITS", 50.0)
        self.budget_s = _float_env("VLITE_PROBE_BUDGET_MS", 2000.0) / 1000.0
        self.passes = 0
        self.collector_registered = False
        self.stop = threading.Event()

    def run(self) -> None:
        """Poll the process's CPU use every ``POLL_S``; run a pass at each idle point that is due."""
        samples: collections.deque = collections.deque()  # (wall, host CPU, host waits since the previous poll)
        last_cpu, last_own = time.process_time(), time.thread_time()
        last_waits = _host_waits()
        start = time.monotonic()
        work, last_pass, asked_seen = MIN_WORK_S, -REFRESH_S, self._asked()
        while not self.stop.wait(POLL_S):
            self._register_collector()
            cpu, own, wall = time.process_time(), time.thread_time(), time.monotonic()
            host_cpu = max(0.0, (cpu - last_cpu) - (own - last_own))
            waits = _host_waits()
            last_cpu, last_own, work = cpu, own, work + host_cpu
            samples.append((wall, host_cpu, max(0, waits - last_waits)))
            last_waits = waits
            while samples and samples[0][0] < wall - self.quiet_s:
                samples.popleft()
            # idle: over the last quiet_s seconds the host used under busy_fraction of a core (a scrape
            # or a health check now and then is no work; a request being served is) and its threads
            # blocked fewer than busy_waits times a second (a process that mostly waits on another,
            # as vLLM's engine core on its worker, uses little CPU but wakes at every step)
            if wall - start < self.quiet_s or sum(c for _, c, _ in samples) > self.busy_fraction * self.quiet_s \
                    or sum(w for _, _, w in samples) > self.busy_waits * self.quiet_s:
                continue
            asked = self._asked()
            due = (asked != asked_seen or (work >= MIN_WORK_S and wall - last_pass >= self.interval_s)
                   or wall - last_pass >= REFRESH_S)
            if due:
                self.one_pass()
                last_pass, work, asked_seen = time.monotonic(), 0.0, asked
                samples.clear()
                last_cpu, last_own, last_waits = time.process_time(), time.thread_time(), _host_waits()

    def _asked(self) -> float:
        """The mtime of ``<directory>/pass-requested``, which a reader at an idle point touches (0: none)."""
        try:
            return os.stat(os.path.join(self.directory, export.PASS_REQUEST)).st_mtime
        except OSError:
            return 0.0

    def one_pass(self) -> dict:
        """Walk now and write the result; returns the document written (names and counts only)."""
        started = time.time()
        try:
            c = walk.census(self.id_pattern, max_objects=MAX_OBJECTS, budget_s=self.budget_s, skip=(self,))
            containers, objects, elapsed, cpu, truncated, error = (c.top(), c.objects, c.elapsed_s, c.cpu_s,
                                                                   c.truncated, None)
            del c
        except Exception as exc:  # reported, never raised into the host
            containers, objects, elapsed, cpu, truncated, error = {}, 0, 0.0, 0.0, True, f"{type(exc).__name__}: {exc}"
        self.passes += 1
        doc = {"pid": self.pid, "process": self.process, "dir": self.directory, "passes": self.passes,
               "pass_start": started,
               "pass_seconds": round(elapsed, 4), "pass_cpu_seconds": round(cpu, 4), "objects": objects,
               "truncated": truncated, "error": error, "containers": containers}
        export.write(self.directory, doc)
        return doc

    def _register_collector(self) -> None:
        """Once the host has imported ``prometheus_client``, put the probe's series on its default
        registry (what a server's ``/metrics`` usually serves); never imports it itself."""
        if not self.collector_registered:
            self.collector_registered = export.register_collector(self.directory)


def start_probe() -> bool:
    """Start the probe thread of this process once (again in a forked child); True if running."""
    global _started_pid
    with _lock:
        if _started_pid == os.getpid():
            return True
        probe = Probe()
        thread = threading.Thread(target=probe.run, name="vlite-probe", daemon=True)
        thread.start()
        _started_pid = probe.pid
    return True


def _after_fork() -> None:
    global _started_pid, _lock
    _lock = threading.Lock()  # a parent thread may have held it at the fork
    _started_pid = None
    try:
        start_probe()
    except Exception:
        pass


os.register_at_fork(after_in_child=_after_fork)
