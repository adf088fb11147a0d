"""Python allocation sites that keep growing over an in-process run (``--trace-allocations``).

``tracemalloc`` records every Python allocation with its traceback, including objects that
``gc.freeze()`` moved out of the collector's sight (vllm#44175's block-id list was invisible to
``gc.get_objects()`` for that reason, but not to the allocator). A snapshot is kept at the first
idle point after the first wave (past the engine's warm-up) and at the latest one; the report
lists the allocation sites whose traced bytes grew between them, per request served. Sites in
the leak checker itself (``vlite/diagnostics``) and in ``tracemalloc`` are left out: the
checker's own samples grow with the run by design.

It slows the replay: 14.3 s against 13.0 s untraced on SmolLM2's default run (docs/benchmarks.md, "`--trace-allocations`: cost");
tracing starts when the replay does, after the model load (tracing from interpreter start made
the same replay 21.6 s and the start-up 144 s longer).
"""

from __future__ import annotations

import os
import tracemalloc

import vlite

_CHECKER_DIR = os.path.join(os.path.dirname(vlite.__file__), "diagnostics")
TOP_SITES = 5


class AllocationTrace:
    """tracemalloc over one replay.

    Args:
        nframes: frames kept per allocation (1: the line that allocated; more costs more).

    ``start()`` before the replay, ``idle_point()`` at each idle point (the first, before any
    request, is the baseline: not kept), ``stop(requests_completed)`` after it with the requests
    completed at each idle point: returns the growing sites (see ``growth``).
    """

    def __init__(self, nframes: int = 1) -> None:
        self.nframes = nframes
        self._owned = False
        self._num_points = 0
        self._first: tuple[int, tracemalloc.Snapshot] | None = None  # (idle point index, snapshot)
        self._last: tuple[int, tracemalloc.Snapshot] | None = None

    def start(self) -> None:
        if not tracemalloc.is_tracing():  # already on (PYTHONTRACEMALLOC): leave it as it was found
            tracemalloc.start(self.nframes)
            self._owned = True

    def idle_point(self) -> None:
        """Keep a snapshot: at the second idle point (after the first wave) and the latest."""
        index, self._num_points = self._num_points, self._num_points + 1
        if index == 0 or not tracemalloc.is_tracing():
            return
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, _CHECKER_DIR + os.sep + "*")])
        if self._first is None:
            self._first = (index, snap)
        else:
            self._last = (index, snap)

    def stop(self, requests_completed: list[int]) -> dict:
        """Stop tracing (if this started it) and return ``growth(requests_completed)``."""
        if self._owned:
            tracemalloc.stop()
            self._owned = False
        return self.growth(requests_completed)

    def growth(self, requests_completed: list[int]) -> dict:
        """``sites``: up to ``TOP_SITES`` allocation sites whose traced bytes grew from the first
        kept idle point to the last, largest first, each with ``site`` ("file:line"),
        ``bytes_diff``, ``count_diff`` (blocks) and ``bytes_per_request``; ``from_requests`` and
        ``to_requests``: requests completed at the two snapshots (``requests_completed[i]`` is
        the count at idle point i). Empty sites when fewer than two idle points were kept."""
        if self._first is None or self._last is None or self._last[0] >= len(requests_completed):
            return {"sites": [], "from_requests": None, "to_requests": None}
        (i0, s0), (i1, s1) = self._first, self._last
        r0, r1 = requests_completed[i0], requests_completed[i1]
        served = max(1, r1 - r0)
        sites = []
        for stat in s1.compare_to(s0, "lineno"):
            if stat.size_diff <= 0:
                continue
            frame = stat.traceback[0]
            sites.append({"site": f"{_short(frame.filename)}:{frame.lineno}", "bytes_diff": stat.size_diff,
                          "count_diff": stat.count_diff, "bytes_per_request": round(stat.size_diff / served, 1)})
            if len(sites) == TOP_SITES:
                break
        return {"sites": sites, "from_requests": r0, "to_requests": r1}


def _short(filename: str) -> str:
    """A path from its package root (``vlite/engine/...``, ``torch/...``) when it has one."""
    for marker in ("site-packages" + os.sep, os.sep + "vlite" + os.sep):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail if marker.startswith("site") else "vlite" + os.sep + tail
    return filename
