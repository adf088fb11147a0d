"""CPU threads: how torch's OpenMP threads wait, how many there are, and whether the machine has
room for them.

torch's CPU wheel runs its intra-op pool on GNU OpenMP (``libgomp``, bundled in ``torch/lib``),
and vlite's C++ kernels (built with ``-fopenmp``) resolve to that same loaded ``libgomp``: one
runtime, one set of settings. After each parallel region an idle thread spins before it sleeps:
300,000 spins when ``OMP_WAIT_POLICY`` is unset (a few ms; libgomp's ``GOMP_SPINCOUNT`` docs).
Beside a busy neighbour on a small machine those spinning threads and the neighbour share the
cores, and every barrier waits for a thread that lost its time slice: W1 ran 15x
slower beside one busy process (transformers 2.5x). vlite sets ``GOMP_SPINCOUNT=1000``: a
thread spins about a microsecond, long enough for the next region of a step that follows at once,
then sleeps and lets the neighbour run. Measured on 2 cores (docs/benchmarks.md, "Beside other
work"): W1 quiet 631 output tok/s (libgomp's default 620-640, ``OMP_WAIT_POLICY=PASSIVE``
533-543), and beside one busy process 113 tok/s against the default's 74 and PASSIVE's 136.
PASSIVE (spin count 0) holds more beside a neighbour but costs 15% on a quiet machine and raised
serving ITL 40% in an earlier run, so it is the user's choice, not the default. vLLM's CPU worker
makes the same kind of choice for Intel's OpenMP (``KMP_BLOCKTIME=1``, in ms).

OpenMP reads these variables once, when the runtime loads (at ``import torch``), so
``apply_openmp_defaults`` runs at the top of the ``vlite`` command (``vlite/cli/main.py``),
before anything imports torch; the engine-core and tensor-parallel worker processes are spawned
and inherit the environment. A variable the user set is left as it is.

This module imports no torch at import time.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("vlite.engine")

# the wait policy vlite sets when the user set none of the variables that decide it
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "1000"}
# any of these set by the user means the user chose how threads wait: vlite sets nothing
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "KMP_LIBRARY")
# the machine is oversubscribed when other work's load exceeds the CPUs vlite's threads leave by this much
LOAD_MARGIN = 0.5


def apply_openmp_defaults(environ: dict | None = None) -> dict[str, str]:
    """Set ``OPENMP_DEFAULTS`` in ``environ`` (default ``os.environ``) unless the user set any of
    ``WAIT_VARIABLES`` (``GOMP_SPINCOUNT=300000`` restores libgomp's own default). Returns what it
    set ({} when nothing), and marks it (``VLITE_OMP_DEFAULTS_SET=1``) for ``wait_policy``.

    Call before torch is imported: OpenMP reads its environment once, when it loads. Once torch
    is loaded it sets nothing (the setting would not take effect, and the log would lie).
    """
    env = os.environ if environ is None else environ
    if any(env.get(name) for name in WAIT_VARIABLES):
        return {}
    if environ is None and "torch" in sys.modules:
        return {}
    env.update(OPENMP_DEFAULTS, VLITE_OMP_DEFAULTS_SET="1")
    return dict(OPENMP_DEFAULTS)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: ``taskset``, cgroup cpusets), else
    ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class LoadReading:
    """load_1m: the 1-minute load average (runnable + uninterruptible tasks, smoothed);
    others_runnable: tasks runnable now that are not this process's threads (None where
    ``/proc`` cannot tell)."""

    load_1m: float
    others_runnable: int | None


def read_load() -> LoadReading:
    """The machine's load now, from ``/proc/loadavg`` (field 4: runnable/total scheduling
    entities) less this process's own runnable threads (``/proc/self/task/*/stat``); the load
    average alone where ``/proc`` is missing."""
    load_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    try:
        runnable = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
        own = 0
        for stat in Path("/proc/self/task").glob("*/stat"):
            try:
                state = stat.read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            own += state == "R"
        return LoadReading(load_1m, max(0, runnable - own))
    except (OSError, ValueError, IndexError):
        return LoadReading(load_1m, None)


@dataclass(frozen=True)
class ThreadReport:
    """What ``vlite serve`` and ``vlite bench`` log at start.

    torch_threads: torch's intra-op threads (``torch.get_num_threads()``); wait_policy: the
    ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` in force, and who set it; cpus: ``available_cpus()``;
    load: ``read_load()``.
    """

    torch_threads: int
    wait_policy: str
    cpus: int
    load: LoadReading

    def line(self) -> str:
        """One log line: threads, wait policy, CPUs and load."""
        runnable = "" if self.load.others_runnable is None else f", {self.load.others_runnable} other tasks runnable"
        return (f"CPU threads: torch {self.torch_threads} intra-op, OpenMP wait policy {self.wait_policy}; "
                f"{self.cpus} CPUs available, load average {self.load.load_1m:.2f}{runnable}")

    def oversubscribed(self) -> str | None:
        """A warning when other work already takes the CPUs vlite's threads need, else None.

        Other work is the smaller of the 1-minute load average and the tasks runnable now besides
        this process (both must show it: the average lags, the instant count flickers); the
        machine is oversubscribed when that exceeds ``cpus - torch_threads`` by ``LOAD_MARGIN``.
        """
        others = self.load.load_1m if self.load.others_runnable is None \
            else min(self.load.load_1m, self.load.others_runnable)
        room = self.cpus - self.torch_threads
        if others <= room + LOAD_MARGIN:
            return None
        return (f"this machine is oversubscribed: load average {self.load.load_1m:.2f} and "
                f"{self.load.others_runnable if self.load.others_runnable is not None else '?'} other tasks runnable "
                f"on {self.cpus} CPUs, and vlite runs {self.torch_threads} torch threads; every step waits for "
                f"time slices and throughput can drop several-fold (set OMP_NUM_THREADS to fewer threads, or "
                f"free CPUs)")


def wait_policy() -> str:
    """The OpenMP wait policy this process runs with, as the environment says, e.g.
    "GOMP_SPINCOUNT=1000 (set by vlite)", "OMP_WAIT_POLICY=PASSIVE (set by the user)", or "unset (libgomp spins 300,000 times)"."""
    parts = [f"{name}={os.environ[name]}" for name in WAIT_VARIABLES if os.environ.get(name)]
    if not parts:
        return "unset (libgomp spins 300,000 times before sleeping)"
    set_by_vlite = os.environ.get("VLITE_OMP_DEFAULTS_SET") == "1"
    return " ".join(parts) + (" (set by vlite)" if set_by_vlite else " (set by the user)")


def thread_report() -> ThreadReport:
    """This process's ``ThreadReport`` (imports torch)."""
    import torch

    return ThreadReport(torch.get_num_threads(), wait_policy(), available_cpus(), read_load())


def log_thread_report(log: logging.Logger | None = None) -> ThreadReport:
    """Log the report's line at INFO and, when the machine is oversubscribed, a WARNING;
    returns the report."""
    log = log or logger
    report = thread_report()
    log.info("%s", report.line())
    warning = report.oversubscribed()
    if warning:
        log.warning("%s", warning)
    return report


__all__ = ["LOAD_MARGIN", "OPENMP_DEFAULTS", "WAIT_VARIABLES", "LoadReading", "ThreadReport", "apply_openmp_defaults",
           "available_cpus", "log_thread_report", "read_load", "thread_report", "wait_policy"]
