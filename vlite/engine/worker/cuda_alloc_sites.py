"""Live CUDA allocations by allocation site, from PyTorch's allocator history.

``torch.cuda.memory._record_memory_history(stacks="python")`` makes the caching allocator keep
the Python stack of every allocation it serves; ``torch.cuda.memory._snapshot()`` then returns
its segments, each split into blocks. The format (torch/cuda/memory.py, ``_snapshot``'s
docstring; torch/cuda/_memory_viz.py reads it the same way)::

    {"segments": [{"address", "total_size", "stream", "segment_type", "allocated_size",
                   "active_size", "blocks": [{"size": int (bytes, rounded by the allocator),
                                              "requested_size": int, "address": int,
                                              "state": "active_allocated" | "active_awaiting_free"
                                                       | "inactive",
                                              "frames": [{"filename", "line", "name"}, ...]}]}],
     "device_traces": [[trace entries], ...]}

with ``frames`` innermost first (``_memory_viz`` reverses them for its flame graphs) and empty
for a block allocated before recording began. ``live_sites`` folds a snapshot into live bytes
per allocation site; ``leak-check --trace-gpu-allocations`` (in process) and
``/debug/gpu_allocations`` (``vlite serve --enable-debug-endpoints``) read it at idle points, and
``vlite.diagnostics.readers.gpu_alloc_trace`` diffs two of them.

The recording is per process: it sees the allocations of the process it runs in (the engine's,
or the engine core's under ``vlite serve``), not those of tensor-parallel worker processes.
"""

from __future__ import annotations

import os

import vlite

DEFAULT_MAX_ENTRIES = 10_000  # the alloc/free history ring; several KB an entry (torch's docs)
SITE_DEPTH = 3  # frames that name a site, innermost first
BEFORE_RECORDING = "(allocated before recording started)"
# Frames that never name a site: PyTorch's own Python (nn.Module.__call__ and the like) and the
# leak checker, which reads the allocator but must not be blamed for what it reads.
_SKIP = (os.sep + "torch" + os.sep, os.path.join("vlite", "diagnostics") + os.sep)
_VLITE_ROOT = os.path.dirname(os.path.dirname(vlite.__file__))

_recording = False  # this module started the allocator's history in this process


def unavailable_reason() -> str | None:
    """Why this process cannot record CUDA allocations (one line), or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device in this process (torch {torch.__version__})"
    return None


def start_recording(max_entries: int = DEFAULT_MAX_ENTRIES) -> str | None:
    """Start the allocator's history with Python stacks (at most ``max_entries`` alloc/free
    events kept). Returns None when recording, or why it cannot (``unavailable_reason``)."""
    global _recording
    reason = unavailable_reason()
    if reason is not None:
        return reason
    import torch

    torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=max_entries)
    _recording = True
    return None


def stop_recording() -> None:
    """Stop the history this module started (nothing otherwise)."""
    global _recording
    if _recording:
        import torch

        torch.cuda.memory._record_memory_history(None)
        _recording = False


def is_recording() -> bool:
    return _recording


def frame_text(frame: dict) -> str:
    """``path:line in name``, the path from the checkout or site-packages when it has one."""
    filename = str(frame.get("filename", "?"))
    for marker in ("site-packages" + os.sep, _VLITE_ROOT + os.sep):
        if marker in filename:
            filename = filename.split(marker, 1)[1]
            break
    return f"{filename}:{frame.get('line', '?')} in {frame.get('name', '?')}"


def site_of(frames: list[dict], depth: int = SITE_DEPTH) -> str:
    """The site of one allocation: its ``depth`` innermost frames outside torch and the leak
    checker, innermost first, joined by `` <- ``; the innermost frames whatever they are when
    every frame is one of those; ``BEFORE_RECORDING`` when it has none."""
    frames = [f for f in frames or () if f.get("filename") not in (None, "", "??")]
    if not frames:
        return BEFORE_RECORDING
    kept = [f for f in frames if not any(s in str(f["filename"]) for s in _SKIP)] or frames
    return " <- ".join(frame_text(f) for f in kept[:depth])


def live_sites(snapshot: dict, depth: int = SITE_DEPTH) -> dict[str, dict[str, int]]:
    """Live bytes per allocation site in one ``torch.cuda.memory._snapshot()``.

    Args:
        snapshot: the snapshot dict (format in this module's docstring); only ``segments`` is read.
        depth: frames per site (``site_of``).

    Returns:
        ``{site: {"bytes": sum of the blocks' ``size`` (bytes, as the allocator rounded them),
        "count": blocks}}`` over the blocks in state "active_allocated" (in use by a tensor).
    """
    out: dict[str, dict[str, int]] = {}
    for seg in snapshot.get("segments", ()):
        for block in seg.get("blocks", ()):
            if block.get("state") != "active_allocated":
                continue
            site = out.setdefault(site_of(block.get("frames") or [], depth), {"bytes": 0, "count": 0})
            site["bytes"] += int(block["size"])
            site["count"] += 1
    return out


def document() -> dict:
    """``/debug/gpu_allocations``: this process's live CUDA allocations by site.

    ``{"pid", "recording": bool, "unavailable": why not (or None), "sites": live_sites(...)
    ({} when not recording)}``."""
    reason = unavailable_reason()
    sites: dict = {}
    if reason is None and _recording:
        import torch

        sites = live_sites(torch.cuda.memory._snapshot())
    elif reason is None:
        reason = "not recording: POST /debug/gpu_allocations/start first"
    return {"pid": os.getpid(), "recording": _recording, "unavailable": reason, "sites": sites}
