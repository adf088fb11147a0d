"""The one reporter family: any target's run (``targets/base.TargetRun``) on the terminal (Rich),
in report.json, report.md and report.html, with samples.csv, the PNG plots and the mode's extra
files in the report directory (formatted once, in ``render``).

A run is the common header (kind, verdict, summary, run facts, notes, interrupted, ...) plus the
mode's detail, read through one interface (``targets/base.RunDetail``: sections, report.json
fields, plots, extra files): the detail itself where it implements it, else the view its kind's
section builders give (``report``, ``blackbox_report``, ``watch_report``, ``fleet_report``; the
results stand below the reports and cannot name their builders). So every mode is printed and
written the same way: ``print_run``, ``write_run_report``, ``print_run_verdict``.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from vlite.diagnostics.report import blackbox_report, fleet_report, render, report, watch_report
from vlite.diagnostics.report.render import print_run_verdict, verdict_color
from vlite.diagnostics.targets.base import RunDetail, TargetRun

__all__ = ["detail_of", "print_run", "print_run_verdict", "run_json", "run_markdown", "verdict_color",
           "write_run_report"]

_VIEWS = {"in-process": report.InProcessView, "vlite-serve": report.InProcessView,
          "blackbox": blackbox_report.BlackboxView, "log": blackbox_report.BlackboxView,
          "watch": watch_report.WatchView, "prometheus": watch_report.WatchView, "fleet": fleet_report.FleetView}


def detail_of(run: TargetRun) -> RunDetail:
    """The run's detail as a ``RunDetail``: itself where it implements the interface, else the
    view of its target kind.

    Raises:
        TypeError: neither (a kind no report knows).
    """
    if isinstance(run.result, RunDetail):
        return run.result
    view = _VIEWS.get(run.kind)
    if view is None:
        raise TypeError(f"a {run.kind} run holds a {type(run.result).__name__}: no report knows it")
    return view(run.result)


def print_run(run: TargetRun, console: Console, timing: str | None = None) -> None:
    """The run's report on the terminal (``render.print_run``)."""
    render.print_run(run, detail_of(run), console, timing)


def run_markdown(run: TargetRun, plots: list[str]) -> str:
    """report.md of the run (``render.run_markdown``)."""
    return render.run_markdown(run, detail_of(run), plots)


def run_json(run: TargetRun) -> dict:
    """report.json of the run (``render.run_json``)."""
    return render.run_json(run, detail_of(run))


def write_run_report(run: TargetRun, out_dir: Path) -> str:
    """Write the run's report directory (``render.write_run_report``); the files written, in words.

    Raises:
        OSError: the directory cannot be created or written.
    """
    return render.write_run_report(run, detail_of(run), out_dir)
