"""The reader of the vlite probe's census (``probe/vlite_probe``) in another server's processes.

The probe, loaded into a server (vLLM's general plugin, or the ``.pth`` start-up hook), walks each
process at its idle points and exports, per process, how many passes it made and, per container,
how many entries hold a request id (``vlite_probe:request_ids_held{process,pid,container}``).
This reads them from the server's ``/metrics`` page, or from the probe's directory of per-process
JSON files where the page does not carry them (a server on this host that serves no
``prometheus_client`` registry).

At an idle point of the run, a pass that started before the idle point may have seen requests
still in flight; ``ProbeReader.at_idle_point`` asks for a pass (where the probe's directory is on
this host) and waits until every process the probe has reported made one after it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vlite.diagnostics.readers.metrics_text import MetricsFormatError, parse_page

PREFIX = "vlite_probe:"
PASS_REQUEST = "pass-requested"  # vlite_probe.export.PASS_REQUEST
WAIT_S = 12.0  # how long an idle point waits for every process's next pass
POLL_S = 1.0  # how often it reads the page meanwhile


@dataclass
class ProbeReading:
    """One read of the probe: per process (``"<process> (pid N)"``) its pass count, when the last
    pass started (Unix s), its duration, objects and whether a budget cut it short; per container
    (``"<process> (pid N): <container>"``) entries holding a request id, its size and cap."""

    processes: dict[str, dict] = field(default_factory=dict)
    containers: dict[str, dict] = field(default_factory=dict)
    stale: list[str] = field(default_factory=list)  # processes with no pass since the idle point
    directory: str | None = None  # the probe's directory, as it says (vlite_probe:info{dir})

    @property
    def passes(self) -> dict[str, int]:
        return {k: int(v.get("passes", 0)) for k, v in self.processes.items()}


def _process_key(process: str, pid: str | int) -> str:
    return f"{process} (pid {pid})"


def from_page(text: str) -> ProbeReading | None:
    """The probe's series on a ``/metrics`` page, or None when the page has none."""
    try:
        page = parse_page(text, allow_empty=True)
    except MetricsFormatError:
        return None
    samples = [s for s in page.samples if s.name.startswith(PREFIX)]
    if not samples:
        return None
    out = ProbeReading()
    fields = {"passes_total": "passes", "pass_start_seconds": "pass_start", "pass_seconds": "pass_seconds",
              "pass_cpu_seconds": "pass_cpu_seconds",
              "pass_objects": "objects", "pass_truncated": "truncated"}
    for s in samples:
        name = s.name[len(PREFIX):]
        if name == "info":
            out.directory = s.labels.get("dir") or None
            continue
        key = _process_key(s.labels.get("process", "?"), s.labels.get("pid", "?"))
        if name in fields:
            out.processes.setdefault(key, {"pid": s.labels.get("pid")})[fields[name]] = s.value
        elif "container" in s.labels:
            c = out.containers.setdefault(f"{key}: {s.labels['container']}", {"process": key})
            c[{"request_ids_held": "ids", "container_entries": "entries", "container_maxlen": "maxlen"}
              .get(name, name)] = s.value
    return out


def from_docs(docs: list[dict]) -> ProbeReading | None:
    """The same from the probe's JSON documents (``vlite_probe.export``), or None when none."""
    if not docs:
        return None
    out = ProbeReading(directory=docs[0].get("dir"))
    for d in docs:
        key = _process_key(d.get("process", "?"), d.get("pid", "?"))
        out.processes[key] = {"pid": str(d.get("pid")), "passes": d.get("passes", 0),
                              "pass_start": d.get("pass_start"), "pass_seconds": d.get("pass_seconds"),
                              "pass_cpu_seconds": d.get("pass_cpu_seconds"),
                              "objects": d.get("objects"), "truncated": float(bool(d.get("truncated")))}
        for name, c in (d.get("containers") or {}).items():
            out.containers[f"{key}: {name}"] = {"process": key, "ids": c.get("ids", 0),
                                                "entries": c.get("entries"), "maxlen": c.get("maxlen")}
    return out


def read_dir(directory: str) -> list[dict]:
    """The JSON documents in the probe's directory whose process is still alive."""
    out = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    except OSError:
        return out
    for name in names:
        try:
            with open(os.path.join(directory, name)) as f:
                doc = json.load(f)
            os.kill(int(doc["pid"]), 0)
        except (OSError, ValueError, KeyError, TypeError, ProcessLookupError):
            continue
        out.append(doc)
    return out


def session_dir(server_pid: int | None) -> str | None:
    """The probe's default directory for a server whose first probed process is ``server_pid``
    (``<tmp>/vlite-probe/<pid>``), if it exists."""
    if server_pid is None:
        return None
    path = os.path.join(tempfile.gettempdir(), "vlite-probe", str(server_pid))
    return path if os.path.isdir(path) else None


class ProbeReader:
    """Reads the probe at each idle point of a run.

    Args:
        page: returns the server's ``/metrics`` page now (raises what the target's reader raises).
        directory: the probe's directory, read where the page carries no probe series.
        wait_s: how long ``at_idle_point`` waits for every process's next pass.
    """

    def __init__(self, page: Callable[[], str], directory: str | None = None, wait_s: float = WAIT_S) -> None:
        self.page, self.directory, self.wait_s = page, directory, wait_s

    def read(self) -> ProbeReading | None:
        """The probe's series now (None: no probe answers)."""
        reading = from_page(self.page())
        if reading is None and self.directory:
            reading = from_docs(read_dir(self.directory))
        return reading

    @staticmethod
    def ask_for_passes(directory: str | None) -> bool:
        """Touch ``<directory>/pass-requested`` where the probe's directory is on this host: every
        probed process then makes a pass at its next idle moment, work or none (True if asked)."""
        if not directory or not os.path.isdir(directory):
            return False
        try:
            path = os.path.join(directory, PASS_REQUEST)
            with open(path, "a"):
                pass
            os.utime(path)
        except OSError:
            return False
        return True

    def at_idle_point(self, *, baseline: bool = False) -> ProbeReading | None:
        """Call at an idle point of the run: wait (up to ``wait_s``, reading the page every
        ``POLL_S``: a scrape costs the server CPU, and a busy server makes no pass) until every
        process the probe reports has made a pass since this call, then read. At the ``baseline``
        (before any request) the last passes stand. A process that made no pass in time is listed
        in ``ProbeReading.stale``: its counts are from before this idle point. None when no probe
        answers."""
        first = self.read()
        if first is None or baseline:
            return first
        self.ask_for_passes(first.directory or self.directory)
        waiting = dict(first.passes)
        deadline = time.monotonic() + self.wait_s
        reading = first
        while waiting and time.monotonic() < deadline:
            time.sleep(POLL_S)
            reading = self.read() or reading
            waiting = {k: n for k, n in waiting.items() if reading.passes.get(k, 0) <= n}
        reading.stale = sorted(waiting)
        return reading
