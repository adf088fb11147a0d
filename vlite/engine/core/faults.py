"""Planted faults: known defects the leak checker must find. Never on by default.

Each fault attaches to the engine's real code path (block manager free, abort, preemption,
admission) through a subclass that ``LLMEngine`` builds only when the fault is asked for
(``fault_seams``; ``raise-in-step`` in the model runner), so the leak checker is tested against
the same code that serves requests, and the engine's own classes carry no fault.
"""

from __future__ import annotations

FAULTS: dict[str, str] = {
    "skip-free-on-abort": "the abort/disconnect path raises before releasing blocks (ref_count stays 1)",
    "leak-on-preempt": "recompute preemption forgets to free the preempted sequence's blocks",
    "orphan-block-table": "free releases the blocks but keeps the sequence's block table entry",
    "double-free": "free releases a sequence's last block twice (ref_count goes below 0)",
    "refcount-not-decremented-on-fork": "freeing a forked child (n > 1, beam search) skips its shared blocks",
    "raise-in-step": "the model runner raises for a request whose client tag is 'raise-in-step'",
    "reclaim-on-admission": "an aborted request's blocks are parked, not freed, and reclaimed only when a new request "
                            "is admitted; admission reserves the parked blocks a second time, so an abort storm that "
                            "parks half the pool wedges the server (/health still 200; TensorRT-LLM PR #12313)",
    "empty-output-after-abort": "blocks released by an abort are reused unreset: a request admitted while any are "
                                "left ends at its first step with no token, HTTP 200 (TensorRT-LLM PR #15018)",
}


class PlantedFault(RuntimeError):
    """Raised by a planted fault, to mimic an exception that skips cleanup."""


class FaultSet:
    """The set of planted faults enabled for one engine.

    Raises:
        ValueError: an unknown fault name (the message lists the known ones).
    """

    def __init__(self, names: tuple[str, ...] | list[str] = ()) -> None:
        unknown = [n for n in names if n not in FAULTS]
        if unknown:
            raise ValueError(f"unknown fault {unknown[0]!r}; known faults: {', '.join(FAULTS)}")
        self.names = frozenset(names)

    def active(self, name: str) -> bool:
        return name in self.names

    def __bool__(self) -> bool:
        return bool(self.names)
