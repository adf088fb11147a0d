"""``vlite leak-check`` runs every target the same way: through the ``LeakCheckTarget`` interface
(``vlite/diagnostics/targets/base.py``), then prints and writes the report of the ``TargetRun``
(``vlite/diagnostics/report/target_report.py``). ``leak_check.py`` builds the target from the options.

Exit codes: 0 CLEAN, 1 LEAK / ZOMBIE / HOST-LEAK / WEDGED / EMPTY-OUTPUT / OUTPUT-DRIFT, 2 usage error or a target that cannot be reached
or read (one line on stderr), 3 INCONCLUSIVE, 130 INTERRUPTED.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from vlite.cli import common
from vlite.cli.interrupt import graceful_interrupt


def connect_or_fail(url: str, server_kind: str, api_key: str | None):
    """Connect to ``url`` and detect its kind; a one-line error and exit 2 when that fails."""
    from vlite.diagnostics.readers.adapters import SERVER_KINDS
    from vlite.diagnostics.targets.base import TargetError
    from vlite.diagnostics.targets.connection import connect

    if server_kind != "auto" and server_kind not in SERVER_KINDS:  # before a connection that may wait
        common.fail(f"unknown --server-kind {server_kind!r}; choose auto or one of: {', '.join(SERVER_KINDS)}")
    try:
        return connect(url, server_kind, api_key)
    except TargetError as exc:
        common.fail(str(exc))


def print_line(console: Console):
    """A progress-line printer for ``TargetPlan.on_line``: as is, an ``ALERT`` line in bold red."""
    def out(line: str) -> None:
        style = "bold red" if line.startswith("ALERT") else None
        console.print(f"[{style}]{escape(line)}[/]" if style else escape(line), highlight=False)
    return out


def run_target(target, plan, console: Console, report: Path | None, t_start: float | None = None) -> int:
    """Run ``plan`` on ``target`` (a ``LeakCheckTarget``), print and write its report; returns the
    exit code. Progress lines go to ``console``; a watch rewrites ``report`` at each idle point. A
    target that honours ``stop`` runs inside ``graceful_interrupt``: the first Ctrl-C ends the run
    and its report is still written. ``t_start`` (``time.time()`` at the command's start) adds
    ``total_s`` to the run facts. A target that cannot be reached or read: one line, exit 2.
    """
    from vlite.diagnostics.report.target_report import write_run_report
    from vlite.diagnostics.targets.base import TargetError

    plan.on_line = print_line(console)
    if report is not None:
        plan.on_report = lambda run: write_run_report(run, report)
    progress = PhaseProgress(console)
    plan.on_progress = progress.update

    def what() -> str:  # the Ctrl-C message names the phase under way
        return f"the {progress.phase}" if progress.phase else target.interruptible

    with graceful_interrupt(what) if target.interruptible else nullcontext() as stop:
        try:
            run = target.run(plan, stop=stop)
        except TargetError as exc:
            common.fail(str(exc))
        finally:
            progress.close()
        if t_start is not None:
            run.info["total_s"] = round(time.time() - t_start, 2)
        return finish(run, console, report)


# What each phase before the replay does, for its progress line.
PHASE_WORDS = {"calibration": "greedy runs that find stop tokens and strings"}


class PhaseProgress:
    """A Rich progress line for a phase before the replay (``TargetPlan.on_progress``): the
    calibration's greedy runs, done of total. ``phase`` is the phase under way (None between
    phases), which the Ctrl-C message names."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.phase: str | None = None
        self._progress = None
        self._task = None

    def update(self, phase: str, done: int, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if self._progress is None:
            self.phase = phase
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=self.console, transient=False)
            self._task = self._progress.add_task(f"{phase}: {PHASE_WORDS.get(phase, 'before the replay')}",
                                                 total=total)
            self._progress.start()
        self._progress.update(self._task, completed=done, total=total)
        if done >= total:
            self.close()

    def close(self) -> None:
        """End the progress line (the phase is over, or the run stopped or failed)."""
        if self._progress is not None:
            self._progress.stop()
        self._progress, self._task, self.phase = None, None, None


def finish(run, console: Console, report: Path | None) -> int:
    """Print the run's report, write its directory (a one-line error and exit 2 when that fails),
    print the verdict again, last, where a scrolled terminal shows it; returns the exit code."""
    from vlite.diagnostics.report.target_report import print_run, print_run_verdict, write_run_report

    print_run(run, console, timing=_timing(run))
    if report is not None:
        try:
            files = write_run_report(run, report)
        except OSError as exc:
            common.fail(f"cannot write the report to {report}: {exc}")
        console.print(f"report written to {report}/ ({files})", highlight=False)
    print_run_verdict(run, console, prefix="verdict: ")
    return run.exit_code


def _timing(run) -> str | None:
    """Requests, seconds and samples of a run that sent requests; None for one that sent none."""
    if run.replay is None or "replay_s" not in run.info:
        return None
    # only the in-process target loads a model; a client of a running server does not
    whole = "with engine start-up: model load, kernel build" if run.kind == "in-process" else "in all"
    return (f"{_requests(run.replay)} in {common.seconds(run.info['replay_s'])} "
            f"({common.seconds(run.info.get('total_s'))} {whole}); {common.plural(len(run.samples), 'sample')}")


def _requests(replay) -> str:
    """The requests of a replay; of an interrupted one, only those that ended, then the rest."""
    from vlite.diagnostics.workload.replay import request_counts

    if not replay.interrupted:
        return common.plural(len(replay.requests), "request")
    c = request_counts(replay)
    unseen = f", {c['in_flight']} never seen ending" if c["in_flight"] else ""
    return (f"{c['ended']} of {c['total']} requests ended ({c['sent']} sent: {c['cut']} in flight at Ctrl-C and "
            f"aborted by it{unseen}; {c['not_sent']} never sent)")
