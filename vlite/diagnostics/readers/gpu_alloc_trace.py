"""CUDA allocation sites whose live bytes keep growing over a run (``--trace-gpu-allocations``).

The GPU twin of ``alloc_trace.py`` (tracemalloc, host memory). NVML and torch's allocated and
reserved counters show that device memory grows, not what holds it; PyTorch's caching allocator
can record the Python stack of every live allocation (``vlite.engine.worker.cuda_alloc_sites``). The
tracer reads the live bytes per allocation site at each idle point, keeps the table of the first
idle point after the first wave (past the engine's warm-up) and of the latest, and names every
site whose live bytes grew between them, per request served.

Where the tables come from (an ``AllocationRecorder``):
- ``TorchRecorder``: this process's allocator (the in-process target); its snapshot provider can
  be replaced (a CPU stand-in in tests, which goes through the same path);
- ``HttpRecorder``: a ``vlite serve --enable-debug-endpoints`` engine's, through
  ``POST /debug/gpu_allocations/start``, ``GET /debug/gpu_allocations`` and ``.../stop``.

It names sites; it does not change the verdict (no per-request threshold has been measured on
a GPU yet, docs/leak-check/replay.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from vlite.engine import cuda_alloc_sites

TOP_SITES = 10


class AllocationRecorder(Protocol):
    """Where the live-bytes-per-site tables come from."""

    def start(self) -> str | None:
        """Start recording; None, or why it cannot (one line)."""
        ...

    def sites(self) -> dict[str, dict[str, int]]:
        """The live allocations now: ``{site: {"bytes", "count"}}`` (``cuda_alloc_sites.live_sites``)."""
        ...

    def stop(self) -> None:
        ...


class TorchRecorder:
    """This process's CUDA caching allocator.

    Args:
        snapshot: returns a ``torch.cuda.memory._snapshot()``-shaped dict; None: the real one,
            with the history started by ``start`` (``cuda_alloc_sites.start_recording``). A
            stand-in needs no CUDA and starts nothing.
        max_entries: the allocator's alloc/free history ring (``_record_memory_history``).
    """

    def __init__(self, snapshot: Callable[[], dict] | None = None,
                 max_entries: int = cuda_alloc_sites.DEFAULT_MAX_ENTRIES) -> None:
        self.snapshot = snapshot
        self.max_entries = max_entries
        self._started = False

    def start(self) -> str | None:
        if self.snapshot is not None:
            return None
        if cuda_alloc_sites.is_recording():  # someone else's recording: read it, leave it on
            return None
        reason = cuda_alloc_sites.start_recording(self.max_entries)
        self._started = reason is None
        return reason

    def sites(self) -> dict[str, dict[str, int]]:
        if self.snapshot is not None:
            return cuda_alloc_sites.live_sites(self.snapshot())
        import torch

        return cuda_alloc_sites.live_sites(torch.cuda.memory._snapshot())

    def stop(self) -> None:
        if self._started:
            cuda_alloc_sites.stop_recording()
            self._started = False


class HttpRecorder:
    """A ``vlite serve`` engine's allocator, through its ``/debug/gpu_allocations`` endpoints.

    Args:
        base: the server's URL (no trailing slash).
        client: an ``httpx.Client``.
    """

    def __init__(self, base: str, client) -> None:
        self.base = base
        self.client = client

    def start(self) -> str | None:
        r = self.client.post(f"{self.base}/debug/gpu_allocations/start")
        if r.status_code == 404:
            return "the server serves no /debug/gpu_allocations (start `vlite serve` with --enable-debug-endpoints)"
        if r.status_code != 200:
            return f"POST /debug/gpu_allocations/start answered {r.status_code}: {r.text[:200]}"
        doc = r.json()
        return None if doc.get("recording") else f"the server's engine: {doc.get('unavailable')}"

    def sites(self) -> dict[str, dict[str, int]]:
        r = self.client.get(f"{self.base}/debug/gpu_allocations")
        r.raise_for_status()
        return r.json()["sites"]

    def stop(self) -> None:
        self.client.post(f"{self.base}/debug/gpu_allocations/stop")


def site_growth(first: dict[str, dict[str, int]], last: dict[str, dict[str, int]], served: int,
                top: int = TOP_SITES) -> list[dict]:
    """The sites whose live bytes grew from ``first`` to ``last`` (``live_sites`` tables), largest
    growth first, at most ``top``: each ``{"site", "bytes_diff", "count_diff", "bytes_per_request"}``
    (``served``: requests completed between the two; at least 1 is assumed)."""
    served = max(1, served)
    rows = []
    for site, now in last.items():
        before = first.get(site, {"bytes": 0, "count": 0})
        diff = now["bytes"] - before["bytes"]
        if diff > 0:
            rows.append({"site": site, "bytes_diff": diff, "count_diff": now["count"] - before["count"],
                         "bytes_per_request": round(diff / served, 1)})
    rows.sort(key=lambda r: (-r["bytes_diff"], r["site"]))
    return rows[:top]


def snapshot_growth(first: dict, last: dict, served: int, top: int = TOP_SITES) -> list[dict]:
    """``site_growth`` of two ``torch.cuda.memory._snapshot()`` dicts."""
    return site_growth(cuda_alloc_sites.live_sites(first), cuda_alloc_sites.live_sites(last), served, top)


class GpuAllocationTrace:
    """Live CUDA bytes per allocation site over one replay.

    ``start()`` before the replay, ``idle_point()`` at each idle point (the first, before any
    request, is the baseline: not kept), ``stop(requests_completed)`` after it with the requests
    completed at each idle point: returns ``growth`` (or ``{"unavailable": why}`` where the
    recorder could not record: no CUDA, no debug endpoint).
    """

    def __init__(self, recorder: AllocationRecorder) -> None:
        self.recorder = recorder
        self.unavailable: str | None = None
        self.errors: list[str] = []
        self._num_points = 0
        self._first: tuple[int, dict] | None = None  # (idle point index, live_sites table)
        self._last: tuple[int, dict] | None = None

    def start(self) -> str | None:
        """Start the recorder; None, or why it cannot record (then every idle point is a no-op)."""
        try:
            self.unavailable = self.recorder.start()
        except Exception as exc:  # noqa: BLE001 - the run goes on without the sites
            self.unavailable = f"the recorder did not start: {type(exc).__name__}: {exc}"
        return self.unavailable

    def idle_point(self) -> None:
        """Read the live sites: kept at the second idle point (after the first wave) and the latest."""
        index, self._num_points = self._num_points, self._num_points + 1
        if index == 0 or self.unavailable is not None:
            return
        try:
            table = self.recorder.sites()
        except Exception as exc:  # noqa: BLE001 - a failed read loses one idle point, not the run
            self.errors.append(f"idle point {index}: {type(exc).__name__}: {exc}")
            return
        if self._first is None:
            self._first = (index, table)
        else:
            self._last = (index, table)

    def stop(self, requests_completed: list[int]) -> dict:
        """Stop the recorder (if it started) and return ``growth(requests_completed)``."""
        if self.unavailable is None:
            try:
                self.recorder.stop()
            except Exception as exc:  # noqa: BLE001 - the sites read so far still count
                self.errors.append(f"stop: {type(exc).__name__}: {exc}")
        return self.growth(requests_completed)

    def growth(self, requests_completed: list[int]) -> dict:
        """``sites``: ``site_growth`` from the first kept idle point to the last;
        ``from_requests``/``to_requests``: requests completed at the two (``requests_completed[i]``
        is the count at idle point i); ``unavailable``: why nothing was recorded (or None);
        ``errors``: failed reads. Empty sites when fewer than two idle points were kept."""
        out = {"sites": [], "from_requests": None, "to_requests": None, "unavailable": self.unavailable,
               "errors": list(self.errors)}
        if self._first is None or self._last is None or self._last[0] >= len(requests_completed):
            return out
        (i0, t0), (i1, t1) = self._first, self._last
        r0, r1 = requests_completed[i0], requests_completed[i1]
        out.update(sites=site_growth(t0, t1, r1 - r0), from_requests=r0, to_requests=r1)
        return out


def lines(result: dict | None) -> list[str]:
    """The report's lines for ``GpuAllocationTrace.growth`` (none when it did not run)."""
    if result is None:
        return []
    if result.get("unavailable"):
        return [f"GPU allocation sites: not recorded: {result['unavailable']}"]
    if not result["sites"]:
        if result["from_requests"] is None:
            return ["GPU allocation sites: fewer than two idle points after the first wave: nothing to compare"]
        return [f"GPU allocation sites: no live CUDA allocation grew from {result['from_requests']} to "
                f"{result['to_requests']} requests served"]
    scope = f"; {result['scope']}" if result.get("scope") else ""
    out = [f"GPU allocation sites whose live bytes grew from {result['from_requests']} to {result['to_requests']} "
           f"requests served (torch.cuda.memory._snapshot{scope}):"]
    for s in result["sites"]:
        out.append(f"  +{s['bytes_diff'] / 1024:.1f} KiB in {s['count_diff']:+d} blocks, "
                   f"{s['bytes_per_request']:.0f} B/request: {s['site']}")
    return out
