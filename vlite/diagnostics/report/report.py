"""Leak-check reports: the terminal verdict and tables (Rich), and the report directory
(report.json, samples.csv, report.md, PNG plots). report.json is documented in docs/leak-check.md.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from vlite.diagnostics.checks import engine_errors
from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.report.writer import REPORT_VERSION, md_table, trend_line, write_report_dir

_BLOCK_COLS = ("request_id", "client_action", "status", "finish_reason", "site", "step", "age_s", "suspected_path",
               "evidence")
_REQ_COLS = ("request_id", "client_action", "finish_reason", "blocks", "sites", "step", "age_s", "suspected_path")


def _table(title: str, rows: list[dict], cols: tuple[str, ...], limit: int = 20) -> Table:
    table = Table(title=title, title_justify="left", show_lines=False)
    for c in cols:
        table.add_column(c, overflow="fold")
    for r in rows[:limit]:
        table.add_row(*["" if r.get(c) is None else escape(str(r.get(c))) for c in cols])
    if len(rows) > limit:
        table.caption = f"{len(rows) - limit} more rows in report.json"
    return table


def print_verdict(findings, console: Console, prefix: str = "") -> None:
    """The one-line verdict (LEAK and HOST-LEAK red, ZOMBIE or INCONCLUSIVE yellow, CLEAN green)."""
    f = findings
    verdict = f.verdict
    red = (Verdict.LEAK, Verdict.ENGINE_ERROR, Verdict.HOST_LEAK, Verdict.WEDGED, Verdict.EMPTY_OUTPUT, Verdict.OUTPUT_DRIFT)
    color = "red" if verdict in red else "green" if verdict == Verdict.CLEAN else "yellow"
    console.print(f"[bold {color}]{escape(prefix + f.summary())}[/]", highlight=False)


def print_report(run, console: Console | None = None) -> None:
    """Print the verdict line, leaked blocks by origin and by site, CPU-side state and trends."""
    console = console or Console()
    f = run.findings
    d = f.drain
    print_verdict(f, console)
    console.print(f"drain invariant: free {d.num_free_blocks} + cached {d.num_cached_blocks} vs total "
                  f"{d.num_total_blocks} blocks -> mismatch {d.mismatch_blocks:+d} ({d.sign})", highlight=False)
    if f.by_action:
        console.print(_table("Leaked blocks by client action", f.by_action,
                             ("action_kind", "blocks", "references", "requests")))
        console.print(_table("Leaked blocks by allocation site", f.by_site, ("site", "blocks", "references",
                                                                             "requests")))
        console.print(_table("Leaked blocks by owner request (oldest first)", f.by_request, _REQ_COLS, limit=12))
    if f.anomalies:
        console.print(_table("Ledger anomalies", f.anomalies, ("kind", "block_id", "request_id", "client_action",
                                                               "step", "release_sites")))
    cpu = f.cpu_state
    if cpu["orphan_block_tables"]:
        console.print(_table("Orphan block tables (CPU-side, sequence finished)", cpu["orphan_block_tables"],
                             ("seq_id", "num_blocks", "request_id", "client_action", "finish_reason")))
    if cpu["leftover_requests"]:
        console.print(_table("Per-request entries left behind", cpu["leftover_requests"],
                             ("request_id", "state", "client_action", "client_outcome")))
    if f.unattributed:
        console.print(_table("Unattributed blocks (not free at idle, no ledger entry)", f.unattributed,
                             ("block_id", "ref_count", "evidence")))
    if f.census and f.census["held"]:
        console.print(_table("Ended requests still held at idle (request-id census)", f.census["held"],
                             ("path", "kind", "num_entries", "request_ids", "client_actions")))
    if f.registries and (f.registries["leftover"] or f.registries["over_bound"]):
        console.print(_table("Per-request registries not empty at idle", f.registries["leftover"],
                             ("registry", "entries", "holds")))
        if f.registries["over_bound"]:
            console.print(_table("Bounded histories out of bounds", f.registries["over_bound"],
                                 ("history", "size", "bound", "problem")))
    for t in f.trends:
        console.print(trend_line(t), highlight=False, markup=False)
    for line in engine_errors.lines(f.engine_errors):  # one line each; report.json has the traceback
        console.print(line, highlight=False, markup=False, style="red")
    for line in extra_lines(f):
        style = "yellow" if line.startswith(("not exercised", Verdict.ZOMBIE, Verdict.HOST_LEAK)) else None
        console.print(line, highlight=False, markup=False, style=style)
    for note in f.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


def extra_lines(f) -> list[str]:
    """Coverage, zombie and registry lines (console and report.md)."""
    from vlite.diagnostics.checks import cache_probe, coverage, host_memory, zombie
    from vlite.diagnostics.checks.storm import lines as storm_lines
    from vlite.diagnostics.targets import gpu_alloc_trace

    out = coverage.lines(f.coverage) + zombie.lines(f.zombies) + host_memory.lines(f.host_memory)
    out += gpu_alloc_trace.lines(getattr(f, "gpu_allocations", None))
    out += [f"storm check: {line}" for line in storm_lines(getattr(f, "storm", None))]
    out += cache_probe.lines(f.host_memory)
    if f.registries:
        out.append(f"registries checked at idle: {len(f.registries['checked'])} "
                   f"({', '.join(f.registries['checked'])}); not empty: {len(f.registries['leftover'])}")
    if f.census:
        c = f.census
        where = (f"from {c['source']}" if c.get("source") else
                 f"{c['objects_visited']} objects walked in {c['elapsed_ms']} ms")
        out.append(f"request-id census at idle: {where}{' (stopped at its budget)' if c['truncated'] else ''}; "
                   f"containers holding ended requests: {len(c['held'])}")
    if f.attribution_available:
        out.append(f"unattributed blocks: {len(f.unattributed)}")
    return out


def report_dict(run) -> dict:
    """The machine-readable report (the schema of report.json)."""
    outcomes: dict[str, int] = {}
    for r in run.replay.requests:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {"version": REPORT_VERSION, "run": run.info, **run.findings.to_dict(),
            "client": {"outcomes": outcomes, "requests": [asdict(r) for r in run.replay.requests]},
            "idle_points": [asdict(p) for p in run.replay.idle_points]}


def report_markdown(run, plots: list[str]) -> str:
    f, info = run.findings, run.info
    d = f.drain
    verdict = f.verdict
    out = [f"# vlite leak-check report\n\n**{verdict}**{f.summary().removeprefix(verdict)}\n",
           "## Run\n", md_table([{"key": k, "value": v} for k, v in info.items()], ("key", "value"), 100),
           "## Drain invariant (at quiescence)\n",
           (f"free {d.num_free_blocks} + cached (evictable) {d.num_cached_blocks} vs total {d.num_total_blocks} blocks: "
           f"mismatch {d.mismatch_blocks:+d} -> **{d.sign}** (deficit {d.deficit_blocks} blocks, excess frees "
           f"{d.excess_frees}, negative ref_counts {d.negative_ref_counts})\n"),
           "## Trend (troughs at idle points)\n", "\n".join(f"- {trend_line(t)}" for t in f.trends) + "\n",
           "## Coverage, zombie requests, registries\n", "\n".join(f"- {line}" for line in extra_lines(f)) + "\n",
           "## Unattributed blocks (not free at idle, no ledger entry)\n",
           md_table(f.unattributed, ("block_id", "ref_count", "evidence")),
           "## Zombie requests (outlived their clients)\n",
           md_table((f.zombies or {}).get("zombies", []), ("request_id", "client_action", "outlived_s",
                                                            "outlived_steps", "tokens_after_leaving")),
           "## Per-request registries not empty at idle\n",
           md_table((f.registries or {}).get("leftover", []) + (f.registries or {}).get("over_bound", []),
                     ("registry", "history", "entries", "size", "bound", "holds")),
           "## Ended requests still held (request-id census)\n",
           md_table((f.census or {}).get("held", []), ("path", "kind", "num_entries", "request_ids",
                                                        "client_actions")),
           "## Leaked blocks by client action\n", md_table(f.by_action, ("action_kind", "blocks", "references",
                                                                          "requests")),
           "## Leaked blocks by allocation site\n", md_table(f.by_site, ("site", "blocks", "references", "requests")),
           "## Leaked blocks by owner request\n", md_table(f.by_request, _REQ_COLS),
           "## Blocks still held\n", md_table(f.leaked_blocks, ("block_id",) + _BLOCK_COLS),
           "## Ledger anomalies\n", md_table(f.anomalies, ("kind", "block_id", "request_id", "client_action", "step",
                                                    "release_sites")),
           "## CPU-side state\n", "Orphan block tables:\n\n",
           md_table(f.cpu_state["orphan_block_tables"], ("seq_id", "num_blocks", "request_id", "client_action",
                                                          "finish_reason")),
           "\nPer-request entries left behind:\n\n",
           md_table(f.cpu_state["leftover_requests"], ("request_id", "state", "client_action", "client_outcome")),
           "## Exceptions from the engine\n", engine_errors.markdown(f.engine_errors),
           "## Notes\n", "\n".join(f"- {n}" for n in f.notes) or "_none_", "\n\n## Plots\n",
           "\n".join(f"![{p}]({p})" for p in plots), ""]
    return "\n".join(out)


def write_report(run, out_dir: Path) -> Path:
    """Write report.json, samples.csv, report.md, report.html and the PNG plots into ``out_dir`` (created).

    Raises:
        OSError: the directory cannot be created or written.
    """
    from vlite.diagnostics.report.plots import write_plots

    return write_report_dir(out_dir, report_dict(run), run.samples, lambda d: write_plots(run, d),
                            lambda plots: report_markdown(run, plots))
