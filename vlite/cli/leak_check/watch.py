"""``vlite leak-check watch --url U``: send no request; scrape a live server's /metrics (and its
memory on this host) until Ctrl-C or ``--duration``, judging at its natural idle points."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import typer

from vlite.cli import common
from vlite.cli.leak_check import options as o

STUCK = {
    "stuck_after": (float, typer.Option(300.0, "--stuck-after", rich_help_panel=o.PANEL_MODE, min=0.1, help=(
        "A running gauge above 0 this long with no request finished or aborted is flagged (seconds)."))),
}
WATCH = {
    "duration": (float | None, typer.Option(None, "--duration", rich_help_panel=o.PANEL_MODE, min=0.1,
                                            help="Stop after this many seconds (default: at Ctrl-C).")),
    "interval": (float | None, typer.Option(None, "--interval", rich_help_panel=o.PANEL_MODE, min=0.01,
                                            help="Seconds between scrapes (default 1).")),
    **STUCK,
    "server_log": (Path | None, typer.Option(None, "--server-log", rich_help_panel=o.PANEL_MODE, help=(
        "Follow the server's log file (from its end) and alert on the servers' own messages about aborts, "
        "zombies and leaked KV (vLLM, SGLang, TensorRT-LLM, llama.cpp)."))),
}


@o.with_group("out", o.REPORT)
@o.with_group("wa", WATCH)
@o.with_group("srv", o.server("The live server to watch, http://host:port."))
def watch(srv: SimpleNamespace = None, wa: SimpleNamespace = None, out: SimpleNamespace = None) -> None:
    """Send no request: scrape a live server, judging at its idle points."""
    from vlite.cli.leak_check_target import connect_or_fail, run_target
    from vlite.diagnostics.targets.base import TargetPlan
    from vlite.diagnostics.targets.watch import WatchTarget

    if not srv.url:
        common.fail("watch needs --url (the server to watch)")
    o.check_writable(out.report)
    if wa.server_log is not None and not wa.server_log.is_file():
        common.fail(f"--server-log {wa.server_log}: no such file (give the log file the server writes)")
    target = WatchTarget(connect_or_fail(srv.url, srv.server_kind, srv.api_key), interval_s=wa.interval or 1.0,
                         duration_s=wa.duration, stuck_after_s=wa.stuck_after, server_pid=srv.server_pid,
                         server_log=wa.server_log)
    sys.exit(run_target(target, TargetPlan(), common.make_console(), out.report))
