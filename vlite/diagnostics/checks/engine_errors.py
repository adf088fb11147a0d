"""Exceptions the engine under test raised on a path the replay drove (add, the rollback of a
refused multi-prompt request, abort, step, the census), or over ``--url`` a control request
that got a 5xx or lost its connection. Each is a finding, never a crash of the tool: the run
goes on where the engine still can, and the verdict says what it caused (``Findings.verdict``:
LEAK where blocks leaked, else ENGINE-ERROR).

An error is a dict: ``path`` (e.g. "add_requests rollback", "abort", "step", "GET /metrics"),
``request_id`` (None for a batch-wide path such as ``step``), ``exception`` ("PlantedFault:
..."), ``traceback`` (the full text; report.json and report.md show it, the terminal one line)
and ``time`` (``time.time()`` seconds).
"""

from __future__ import annotations

import time
import traceback as tb
from collections import Counter


def engine_error(path: str, request_id: str | None, exc: BaseException) -> dict:
    """The finding for ``exc`` raised on ``path`` for ``request_id`` (None: no single request)."""
    return {"path": path, "request_id": request_id, "exception": one_line(exc),
            "traceback": "".join(tb.format_exception(type(exc), exc, exc.__traceback__)).rstrip(),
            "time": time.time()}


def one_line(exc: BaseException) -> str:
    """``"Type: message"`` on one line (a message's later lines are dropped)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def describe(errors: list[dict]) -> str:
    """The verdict line's words: "3 exceptions from the engine (abort 2, step 1; first: abort of
    req-4: PlantedFault: ...)"."""
    paths = Counter(e["path"] for e in errors)
    first = errors[0]
    who = f"{first['path']} of {first['request_id']}" if first["request_id"] else first["path"]
    n = len(errors)
    return (f"{n} exception{'s' if n != 1 else ''} from the engine ("
            + ", ".join(f"{p} {c}" for p, c in paths.items()) + f"; first: {who}: {first['exception']})")


def lines(errors: list[dict] | None, limit: int = 10) -> list[str]:
    """One terminal line per error, the first ``limit``: path, request id and the exception
    (report.json and report.md have every one, with its traceback)."""
    errors = errors or []
    out = [f"engine raised in {e['path']}" + (f" ({e['request_id']})" if e["request_id"] else "")
           + f": {e['exception']}" for e in errors[:limit]]
    if len(errors) > limit:
        out.append(f"engine raised {len(errors) - limit} more times: every one, with its traceback, is in "
                   "report.json and report.md (--report)")
    return out


def markdown(errors: list[dict] | None) -> str:
    """report.md's section: each error with its full traceback."""
    if not errors:
        return "_none_\n"
    out = []
    for e in errors:
        who = f" ({e['request_id']})" if e["request_id"] else ""
        out.append(f"- **{e['path']}**{who}: {e['exception']}\n\n```\n{e['traceback']}\n```\n")
    return "\n".join(out)
