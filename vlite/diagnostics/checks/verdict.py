"""The verdicts of a leak check, their exit codes and meanings, and the run's exit code.

A ``Verdict`` is a ``str``: it compares equal to its name ("HOST-LEAK") and serialises as it in
report.json, so reports and readers that match on strings are unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

# A CLEAN run that sent or walked no client abort (while waiting, in prefill or in decode): the
# paths leak-check exists for went untested.
EXIT_HEADLINE_NOT_EXERCISED = 4


class Verdict(str, enum.Enum):
    """One verdict; ``exit_code`` and ``meaning`` are what ``vlite leak-check --help`` lists."""

    CLEAN = "CLEAN"
    LEAK = "LEAK"
    ZOMBIE = "ZOMBIE"
    HOST_LEAK = "HOST-LEAK"
    WEDGED = "WEDGED"
    EMPTY_OUTPUT = "EMPTY-OUTPUT"
    OUTPUT_DRIFT = "OUTPUT-DRIFT"
    ENGINE_ERROR = "ENGINE-ERROR"
    INCONCLUSIVE = "INCONCLUSIVE"
    INTERRUPTED = "INTERRUPTED"

    # As a plain str in f-strings, str() and format(), and in dict keys and sets (Enum hashes
    # the member's name: HOST_LEAK, not HOST-LEAK).
    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__

    @property
    def exit_code(self) -> int:
        """0 CLEAN, 3 INCONCLUSIVE, 130 INTERRUPTED (128 + SIGINT), 1 for every finding."""
        return _EXIT[self]

    @property
    def meaning(self) -> str:
        """One line: what the verdict says about the server."""
        return _MEANING[self]

    @property
    def is_finding(self) -> bool:
        """Whether the verdict reports a fault of the server (exit code 1)."""
        return self.exit_code == 1


_EXIT = {Verdict.CLEAN: 0, Verdict.INCONCLUSIVE: 3, Verdict.INTERRUPTED: 130}
_EXIT.update({v: 1 for v in Verdict if v not in _EXIT})
_MEANING = {
    Verdict.CLEAN: "blocks back on the free list, no per-request state left",
    Verdict.LEAK: "blocks or per-request state left after the drain",
    Verdict.ZOMBIE: "requests outlived their clients",
    Verdict.HOST_LEAK: "host memory keeps growing past warm-up",
    Verdict.WEDGED: "after an abort storm /health says 200 but a plain request does not complete",
    Verdict.EMPTY_OUTPUT: "after an abort storm the greedy canary gets HTTP 200 with zero tokens",
    Verdict.OUTPUT_DRIFT: "after an abort storm the greedy canary's text changed",
    Verdict.ENGINE_ERROR: "the engine raised on a path the run drove (add, abort, step, census), or a control "
                          "request over --url got a 5xx or a dropped connection; nothing leaked",
    Verdict.INCONCLUSIVE: "the server never drained, no KV gauge, no idle stretch, or every request ended in "
                          "an engine error",
    Verdict.INTERRUPTED: "Ctrl-C: the report of what was measured is written",
}


def exit_code(verdict: str) -> int:
    """The exit code of one verdict (a ``Verdict`` or its string); a string that is no verdict
    (e.g. a failed ``--scenario``) is a finding: 1."""
    try:
        return Verdict(verdict).exit_code
    except ValueError:
        return 1


def run_exit_code(verdicts: Iterable[str], *, headline_not_exercised: bool = False) -> int:
    """The exit code of a run judged by several verdicts (one per replica, target or scenario).

    INTERRUPTED wins (130), then any finding (1), then INCONCLUSIVE (3); all CLEAN gives 0, or
    ``EXIT_HEADLINE_NOT_EXERCISED`` (4) when no client abort was exercised. No verdict at all
    is INCONCLUSIVE (3).
    """
    codes = {exit_code(v) for v in verdicts}
    if not codes:
        return Verdict.INCONCLUSIVE.exit_code
    for code in (130, 1, 3):
        if code in codes:
            return code
    return EXIT_HEADLINE_NOT_EXERCISED if headline_not_exercised else 0
