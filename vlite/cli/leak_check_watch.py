"""The passive paths of ``vlite leak-check``: ``--watch --url URL`` (scrape a running server, send
no request) and ``--prometheus URL --job NAME --since 6h`` (judge a range Prometheus holds).

Exit codes: 0 CLEAN, 1 LEAK / ZOMBIE / HOST-LEAK, 2 usage error (one line on stderr), 3 INCONCLUSIVE.
Ctrl-C ends a watch: the report is written and the verdict's code returned.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape

from vlite.cli import common

_COLOR = {"CLEAN": "green", "INCONCLUSIVE": "yellow"}


def _print_line(console: Console):
    def out(line: str) -> None:
        style = "bold red" if line.startswith("ALERT") else None
        console.print(f"[{style}]{escape(line)}[/]" if style else escape(line), highlight=False)
    return out


def _finish(res, console: Console, report: Path | None) -> int:
    from vlite.diagnostics.report.watch_report import write_watch_report

    for n in res.notes:
        console.print(f"[yellow]note:[/] {escape(n)}", highlight=False)
    if report is not None:
        try:
            write_watch_report(res, report)
        except OSError as exc:
            common.fail(f"cannot write the report to {report}: {exc}")
        console.print(f"report written to {report}/ (report.md, report.html, samples.csv, report.json)",
                      highlight=False)
    color = _COLOR.get(res.verdict, "red")
    console.print(f"[bold {color}]verdict: {escape(res.summary)}[/]", highlight=False)
    return res.exit_code


def run_watch_cli(url: str, console: Console, report: Path | None, *, server_kind: str, api_key: str | None,
                  server_pid: int | None, interval_s: float, duration_s: float | None, stuck_after_s: float) -> int:
    """``--watch``: connect, scrape until ``duration_s`` or Ctrl-C, print, write the report."""
    from vlite.cli.leak_check_blackbox import connect_or_fail
    from vlite.diagnostics.report.watch_report import write_watch_report
    from vlite.diagnostics.targets.watch import watch

    conn = connect_or_fail(url, server_kind, api_key)
    until = f"for {duration_s:g} s" if duration_s else "until Ctrl-C"
    console.print(f"leak-check --watch: {conn.adapter.kind} at {conn.base}, scraping every {interval_s:g} s {until}; "
                  "no request is sent; Ctrl-C stops and writes the report", highlight=False)
    from vlite.cli.interrupt import graceful_interrupt

    # The first Ctrl-C ends the watch and writes the report; a second exits at once (130).
    with graceful_interrupt("the watch") as stop:
        write = (lambda r: write_watch_report(r, report)) if report is not None else None
        res = watch(conn, interval_s=interval_s, duration_s=duration_s, stuck_after_s=stuck_after_s, on_report=write,
                    on_line=_print_line(console), server_pid=server_pid, stop=stop)
        return _finish(res, console, report)


def run_prometheus_cli(prometheus: str, job: str | None, since: str, console: Console, report: Path | None, *,
                       instance: str | None, server_kind: str, step_s: float | None, stuck_after_s: float) -> int:
    """``--prometheus``: query the range, judge it, print, write the report."""
    from vlite.diagnostics.targets.prometheus_range import PrometheusError, judge_range, parse_since

    if not job:
        common.fail("--prometheus needs --job NAME (the job_name of the scrape config that scrapes the server)")
    try:
        since_s = parse_since(since)
    except ValueError as exc:
        common.fail(str(exc))
    console.print(f"leak-check --prometheus {prometheus}: job {job}, the last {since}", highlight=False)
    try:
        res = judge_range(prometheus, job, since_s, step_s=step_s, instance=instance, server_kind=server_kind,
                          stuck_after_s=stuck_after_s, on_line=_print_line(console))
    except PrometheusError as exc:
        common.fail(str(exc))
    return _finish(res, console, report)
