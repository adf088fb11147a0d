"""``vlite leak-check log FILE``: post-mortem of a server's log: vLLM's or vlite's periodic stats
lines, and the servers' own abort, zombie and leak messages (vLLM, SGLang, TensorRT-LLM, llama.cpp)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import typer

from vlite.cli import common
from vlite.cli.leak_check import options as o


@o.with_group("out", o.REPORT)
def log(file: Path = typer.Argument(..., metavar="FILE", help="The server's log file."),  # noqa: B008
        out: SimpleNamespace = None) -> None:
    """Post-mortem of a server's log: its stats lines and abort, zombie, leak messages."""
    from vlite.cli.leak_check_target import run_target
    from vlite.diagnostics.targets.base import TargetPlan
    from vlite.diagnostics.targets.from_log import LogTarget

    o.check_writable(out.report)
    sys.exit(run_target(LogTarget(file), TargetPlan(), common.make_console(), out.report))
