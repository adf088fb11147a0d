"""The report of any target's run (``targets/base.TargetRun``), on the console and in a directory.

Each kind of result keeps its own report: ``report.py`` tells a ``RunResult`` (in process,
``vlite serve``), ``blackbox_report.py`` a ``BlackboxResult`` (black box, stats log) and
``watch_report.py`` a ``WatchResult`` (watch, Prometheus range). This module picks the one that
fits the run, so ``vlite leak-check`` prints and writes every target's run with the same three
calls: ``print_run``, ``write_run_report``, ``print_run_verdict``. (The run cannot carry these
as methods: reports stand above targets, and a target importing its report would be an import
arrow running back up.)
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from vlite.diagnostics.checks.result import RunResult
from vlite.diagnostics.report.blackbox_report import print_blackbox, print_blackbox_verdict, write_blackbox_report
from vlite.diagnostics.report.report import print_report, print_verdict, write_report
from vlite.diagnostics.report.watch_report import print_watch, print_watch_verdict, write_watch_report
from vlite.diagnostics.targets.base import TargetRun
from vlite.diagnostics.targets.blackbox import BlackboxResult
from vlite.diagnostics.targets.watch import WatchResult


def _check(run: TargetRun) -> None:
    if not isinstance(run.result, (RunResult, BlackboxResult, WatchResult)):
        raise TypeError(f"a {run.kind} run holds a {type(run.result).__name__}: no report knows it")


def print_run(run: TargetRun, console: Console, timing: str | None = None) -> None:
    """The run's report on the console (the verdict line first, then what it found). ``timing``
    (requests, seconds and samples, where the run sent requests) goes where that report puts it:
    after the findings of an in-process or vlite-serve run, before those of a black-box one.

    Raises:
        TypeError: the run holds a result no report knows.
    """
    _check(run)
    res = run.result
    if isinstance(res, RunResult):
        print_report(res, console)
        if run.interrupted:
            console.print(f"[yellow]{run.interrupted}[/]", highlight=False)
        if timing:
            console.print(timing, highlight=False)
    elif isinstance(res, BlackboxResult):
        if timing:
            console.print(timing, highlight=False)
        print_blackbox(res, console)
    else:
        print_watch(res, console)


def print_run_verdict(run: TargetRun, console: Console, prefix: str = "") -> None:
    """The one-line verdict, colored as the run's report colors it."""
    _check(run)
    res = run.result
    if isinstance(res, RunResult):
        print_verdict(res.findings, console, prefix=prefix)
    elif isinstance(res, BlackboxResult):
        print_blackbox_verdict(res, console, prefix=prefix)
    else:
        print_watch_verdict(res, console, prefix=prefix)


def write_run_report(run: TargetRun, out_dir: Path) -> str:
    """Write the run's report directory ``out_dir`` (created); returns the files written, in words
    ("report.json, report.md, report.html, samples.csv, *.png").

    Raises:
        OSError: the directory cannot be created or written.
    """
    _check(run)
    res = run.result
    if isinstance(res, RunResult):
        write_report(res, out_dir)
        return "report.json, report.md, report.html, samples.csv, *.png"
    if isinstance(res, BlackboxResult):
        write_blackbox_report(res, out_dir)
        return f"report.json, report.md, report.html, samples.csv{', reproducer.jsonl' if res.reproducer else ''}, *.png"
    write_watch_report(res, out_dir)
    return "report.md, report.html, samples.csv, report.json"
