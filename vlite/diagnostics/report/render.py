"""The formatting of every leak-check report, once: a run's common header (``targets/base.TargetRun``)
and its mode's detail, read only through ``targets/base.RunDetail`` (sections, report.json
fields, plots, extra files), on the terminal (Rich), in report.json, report.md and report.html,
with samples.csv, the plots and the extra files. ``target_report`` picks the detail of a run.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vlite.diagnostics.report.atomic import atomic_write_text
from vlite.diagnostics.report.html_report import write_html
from vlite.diagnostics.report.writer import REPORT_VERSION, md_table
from vlite.diagnostics.targets.base import RunDetail, Section, TargetRun

# Verdict colors on the terminal: CLEAN green; not a verdict on a leak yellow; every flag red.
_YELLOW = ("INCONCLUSIVE", "INTERRUPTED")


def verdict_color(verdict: str) -> str:
    """The Rich color of ``verdict``: CLEAN green, INCONCLUSIVE / INTERRUPTED yellow, else red."""
    return "green" if verdict == "CLEAN" else "yellow" if verdict in _YELLOW else "red"


def _line(item) -> tuple[str, str | None]:
    return item if isinstance(item, tuple) else (item, None)


def _table(s: Section) -> Table:
    table = Table(title=s.title, title_justify="left", show_lines=False)
    for c in s.cols:
        table.add_column(c, overflow="fold")
    for r in s.rows[:s.terminal_limit]:
        table.add_row(*["" if r.get(c) is None else escape(str(r.get(c))) for c in s.cols])
    if len(s.rows) > s.terminal_limit:
        table.caption = f"{len(s.rows) - s.terminal_limit} more rows in report.json"
    return table


def print_section(s: Section, console: Console) -> None:
    """One section on the terminal: its text, its lines (each in its style), its table (left off
    when empty)."""
    if s.text:
        console.print(s.text, highlight=False, markup=False)
    for item in s.lines:
        text, style = _line(item)
        console.print(text, highlight=False, markup=False, style=style)
    if s.rows:
        console.print(_table(s))


def print_run_verdict(run: TargetRun, console: Console, prefix: str = "") -> None:
    """The one-line verdict, colored by ``verdict_color``."""
    console.print(f"[bold {verdict_color(run.verdict)}]{escape(prefix + run.summary)}[/]", highlight=False)


def print_run(run: TargetRun, detail: RunDetail, console: Console, timing: str | None = None) -> None:
    """The run's report on the terminal: the verdict line (where the mode opens with it), the
    mode's sections, the notes and what a Ctrl-C stopped; ``timing`` (requests, seconds and
    samples, where the run sent requests) first or last, as the mode says (``timing_first``)."""
    timing = timing if run.replay is not None else None  # no client ran: nothing was sent to time
    if timing and detail.timing_first:
        console.print(timing, highlight=False)
    if detail.headline_first:
        print_run_verdict(run, console)
    for s in detail.sections():
        if s.terminal:
            print_section(s, console)
    for note in run.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    if run.interrupted:
        console.print(f"[yellow]{escape(run.interrupted)}[/]", highlight=False)
    if timing and not detail.timing_first:
        console.print(timing, highlight=False)


def markdown_section(s: Section) -> str:
    """One section in Markdown: "## title", its text, its lines (bullets), its table."""
    out = [f"## {s.title}\n"] if s.title else []
    if s.text:
        out.append(s.text)
    if s.lines:
        out.append("\n".join(("- " if s.bullets else "") + _line(item)[0] for item in s.lines) + "\n")
    if s.rows is not None:
        out.append(md_table(s.rows, s.cols, s.limit))
    return "\n".join(out)


def run_markdown(run: TargetRun, detail: RunDetail, plots: list[str]) -> str:
    """report.md: the heading and verdict, the run facts, the mode's sections, the notes, the plots."""
    verdict = run.verdict
    out = [f"# {detail.title}\n", f"**{verdict}**{run.summary.removeprefix(verdict)}\n",
           markdown_section(Section("Run", rows=[{"key": k, "value": v} for k, v in run.info.items()],
                                    cols=("key", "value"), limit=100))]
    out += [markdown_section(s) for s in detail.sections() if s.markdown]
    out += ["## Notes\n", "\n".join(f"- {n}" for n in run.notes) or "_none_", ""]
    if run.interrupted:
        out += [f"_{run.interrupted}_\n"]
    if plots:
        out += ["## Plots\n", "\n".join(f"![{p}]({p})" for p in plots), ""]
    return "\n".join(out)


def run_json(run: TargetRun, detail: RunDetail) -> dict:
    """report.json: the common header (version, kind, verdict, summary, exit code, run facts,
    notes) and the mode's fields (``RunDetail.to_json``), which keep their names."""
    head = {"version": REPORT_VERSION, "kind": run.kind, "verdict": run.verdict, "summary": run.summary,
            "exit_code": run.exit_code, "interrupted": run.interrupted,
            "headline_not_exercised": run.headline_not_exercised, "run": run.info, "notes": run.notes}
    return head | detail.to_json()


def write_run_report(run: TargetRun, detail: RunDetail, out_dir: Path) -> str:
    """Write the run's report directory ``out_dir`` (created): report.json, samples.csv, the
    plots, the mode's extra files, report.md and report.html (one file, plots embedded). Returns
    the files written, in words ("report.json, report.md, report.html, samples.csv, *.png").

    Raises:
        OSError: the directory cannot be created or written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # each text file replaced whole: a Ctrl-C or kill mid-rewrite leaves the previous complete report
    atomic_write_text(out_dir / "report.json", json.dumps(run_json(run, detail), indent=2, default=str))
    atomic_write_text(out_dir / "samples.csv", run.samples.to_csv(index=False))
    plots = list(detail.plots(out_dir))
    extra = detail.extra_files()
    for name, text in extra.items():
        atomic_write_text(out_dir / name, text)
    md = run_markdown(run, detail, plots)
    atomic_write_text(out_dir / "report.md", md)
    write_html(out_dir, md, f"vlite leak-check {run.kind}: {run.verdict}")
    return ", ".join(["report.json", "report.md", "report.html", "samples.csv", *extra, *(["*.png"] if plots else [])])
