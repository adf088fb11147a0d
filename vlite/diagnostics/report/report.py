"""The sections of an in-process or ``vlite serve`` run's report: pure functions from the run's
findings (``checks/detect.Findings``), samples and replay to ``Section``s and report.json fields.
``report/target_report.py`` formats them; report.json is documented in docs/reference.md.
"""

from __future__ import annotations

from dataclasses import asdict

from vlite.diagnostics.checks import engine_errors
from vlite.diagnostics.report.writer import trend_line
from vlite.diagnostics.targets.base import Section, TargetRun

_BLOCK_COLS = ("request_id", "client_action", "status", "finish_reason", "site", "step", "age_s", "suspected_path",
               "evidence")
_REQ_COLS = ("request_id", "client_action", "finish_reason", "blocks", "sites", "step", "age_s", "suspected_path")
_ORPHAN_COLS = ("seq_id", "num_blocks", "request_id", "client_action", "finish_reason")
_LEFTOVER_COLS = ("request_id", "state", "client_action", "client_outcome")
_ANOMALY_COLS = ("kind", "block_id", "request_id", "client_action", "step", "release_sites")
_CENSUS_COLS = ("path", "kind", "num_entries", "request_ids", "client_actions")
_TITLE = "vlite leak-check report"


def extra_lines(f) -> list[str]:
    """Coverage, zombie and registry lines (console and report.md)."""
    from vlite.diagnostics.checks import cache_probe, coverage, host_memory, zombie
    from vlite.diagnostics.checks.storm import lines as storm_lines
    from vlite.diagnostics.readers import gpu_alloc_trace

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


def _styled(line: str) -> tuple[str, str | None]:
    return line, "yellow" if line.startswith(("not exercised", "ZOMBIE", "HOST-LEAK")) else None


def terminal_sections(f) -> list[Section]:
    """The terminal's view: the drain invariant, the leaked blocks by origin and by site, the
    CPU-side state, the trends and the coverage lines (tables only where they have rows)."""
    d = f.drain
    cpu, reg, census = f.cpu_state, f.registries or {}, f.census or {}

    def table(title: str, rows: list[dict], cols: tuple[str, ...], limit: int = 20) -> Section:
        return Section(title, rows=rows, cols=cols, terminal_limit=limit, markdown=False)

    out = [Section(lines=[f"drain invariant: free {d.num_free_blocks} + cached {d.num_cached_blocks} vs total "
                          f"{d.num_total_blocks} blocks -> mismatch {d.mismatch_blocks:+d} ({d.sign})"], markdown=False)]
    if f.by_action:
        out += [table("Leaked blocks by client action", f.by_action, ("action_kind", "blocks", "references", "requests")),
                table("Leaked blocks by allocation site", f.by_site, ("site", "blocks", "references", "requests")),
                table("Leaked blocks by owner request (oldest first)", f.by_request, _REQ_COLS, limit=12)]
    out += [table("Ledger anomalies", f.anomalies, _ANOMALY_COLS),
            table("Orphan block tables (CPU-side, sequence finished)", cpu["orphan_block_tables"], _ORPHAN_COLS),
            table("Per-request entries left behind", cpu["leftover_requests"], _LEFTOVER_COLS),
            table("Unattributed blocks (not free at idle, no ledger entry)", f.unattributed,
                  ("block_id", "ref_count", "evidence")),
            table("Ended requests still held at idle (request-id census)", census.get("held", []), _CENSUS_COLS),
            table("Per-request registries not empty at idle", reg.get("leftover", []), ("registry", "entries", "holds")),
            table("Bounded histories out of bounds", reg.get("over_bound", []), ("history", "size", "bound", "problem"))]
    errors = [(line, "red") for line in engine_errors.lines(f.engine_errors)]  # one line each; report.json has the traceback
    out.append(Section(lines=[trend_line(t) for t in f.trends] + errors + [_styled(x) for x in extra_lines(f)],
                       markdown=False))
    return out


def markdown_sections(f) -> list[Section]:
    """report.md's view: every table in full (up to its limit), "_none_" where empty."""
    d, reg = f.drain, f.registries or {}

    def md(title: str | None, rows: list[dict], cols: tuple[str, ...], text: str | None = None) -> Section:
        return Section(title, text=text, rows=rows, cols=cols, terminal=False)

    drain = (f"free {d.num_free_blocks} + cached (evictable) {d.num_cached_blocks} vs total {d.num_total_blocks} "
             f"blocks: mismatch {d.mismatch_blocks:+d} -> **{d.sign}** (deficit {d.deficit_blocks} blocks, excess "
             f"frees {d.excess_frees}, negative ref_counts {d.negative_ref_counts})\n")
    return [Section("Drain invariant (at quiescence)", text=drain, terminal=False),
            Section("Trend (troughs at idle points)", lines=[trend_line(t) for t in f.trends], terminal=False),
            Section("Coverage, zombie requests, registries", lines=extra_lines(f), terminal=False),
            md("Unattributed blocks (not free at idle, no ledger entry)", f.unattributed,
               ("block_id", "ref_count", "evidence")),
            md("Zombie requests (outlived their clients)", (f.zombies or {}).get("zombies", []),
               ("request_id", "client_action", "outlived_s", "outlived_steps", "tokens_after_leaving")),
            md("Per-request registries not empty at idle", reg.get("leftover", []) + reg.get("over_bound", []),
               ("registry", "history", "entries", "size", "bound", "holds")),
            md("Ended requests still held (request-id census)", (f.census or {}).get("held", []), _CENSUS_COLS),
            md("Leaked blocks by client action", f.by_action, ("action_kind", "blocks", "references", "requests")),
            md("Leaked blocks by allocation site", f.by_site, ("site", "blocks", "references", "requests")),
            md("Leaked blocks by owner request", f.by_request, _REQ_COLS),
            md("Blocks still held", f.leaked_blocks, ("block_id",) + _BLOCK_COLS),
            md("Ledger anomalies", f.anomalies, _ANOMALY_COLS),
            md("CPU-side state", f.cpu_state["orphan_block_tables"], _ORPHAN_COLS, text="Orphan block tables:\n"),
            md(None, f.cpu_state["leftover_requests"], _LEFTOVER_COLS, text="Per-request entries left behind:\n"),
            Section("Exceptions from the engine", text=engine_errors.markdown(f.engine_errors), terminal=False)]


def sections(run) -> list[Section]:
    """Every section of an in-process or vlite-serve run (``run``: its findings, samples, replay)."""
    return terminal_sections(run.findings) + markdown_sections(run.findings)


def report_json(run) -> dict:
    """The run's fields of report.json: the findings, the client's outcomes and requests, the idle points."""
    outcomes: dict[str, int] = {}
    for r in run.replay.requests:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {**run.findings.to_dict(), "client": {"outcomes": outcomes, "requests": [asdict(r) for r in run.replay.requests]},
            "idle_points": [asdict(p) for p in run.replay.idle_points]}


def _as_run(run, kind: str = "in-process") -> TargetRun:
    return TargetRun.of_run_result(kind, run)


def print_report(run, console=None) -> None:
    """The terminal report of an in-process or vlite-serve run (``render.print_run``)."""
    from rich.console import Console

    from vlite.diagnostics.report.render import print_run

    print_run(_as_run(run), InProcessView(run), console or Console())


def report_markdown(run, plots: list[str]) -> str:
    """report.md of an in-process or vlite-serve run (``render.run_markdown``)."""
    from vlite.diagnostics.report.render import run_markdown

    return run_markdown(_as_run(run), InProcessView(run), plots)


def write_report(run, out_dir):
    """Write the report directory of an in-process or vlite-serve run (``render.write_run_report``);
    returns ``out_dir``.

    Raises:
        OSError: the directory cannot be created or written.
    """
    from pathlib import Path

    from vlite.diagnostics.report.render import write_run_report

    write_run_report(_as_run(run), InProcessView(run), out_dir)
    return Path(out_dir)


class InProcessView:
    """An in-process or vlite-serve run (findings, samples, replay) as a ``RunDetail``."""

    title = _TITLE
    headline_first = True
    timing_first = False

    def __init__(self, run) -> None:
        self.run = run

    def sections(self) -> list[Section]:
        return sections(self.run)

    def to_json(self) -> dict:
        return report_json(self.run)

    def plots(self, out_dir) -> list[str]:
        from vlite.diagnostics.report.plots import write_plots

        return write_plots(self.run, out_dir)

    def extra_files(self) -> dict[str, str]:
        return {}
