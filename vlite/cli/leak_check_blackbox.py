"""The black-box and ``--from-log`` paths of ``vlite leak-check`` (kept apart from the in-process
and vlite-over-HTTP paths in ``leak_check.py``).

Exit codes: 0 CLEAN, 1 LEAK, 2 usage error (one line on stderr), 3 INCONCLUSIVE.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from vlite.cli import common


def connect_or_fail(url: str, server_kind: str, api_key: str | None):
    """Connect to ``url`` and detect its kind; a one-line error and exit 2 when that fails."""
    from vlite.diagnostics.targets.blackbox import connect
    from vlite.diagnostics.targets.http import TargetError

    try:
        return connect(url, server_kind, api_key)
    except TargetError as exc:
        common.fail(str(exc))


def _finish(res, console: Console, report: Path | None) -> int:
    from vlite.diagnostics.report.blackbox_report import print_blackbox, print_blackbox_verdict, write_blackbox_report

    print_blackbox(res, console)
    if report is not None:
        try:
            write_blackbox_report(res, report)
        except OSError as exc:
            common.fail(f"cannot write the report to {report}: {exc}")
        extra = ", reproducer.jsonl" if res.reproducer else ""
        console.print(f"report written to {report}/ (report.json, report.md, report.html, samples.csv{extra}, *.png)",
                      highlight=False)
    print_blackbox_verdict(res, console, prefix="verdict: ")  # again, last, where a scrolled terminal shows it
    return res.exit_code


def run_blackbox_cli(conn, url: str, specs, workload: str, console: Console, report: Path | None, info: dict, *,
                     seed: int, abort_rate: float, abort_mode: str, idle_every: int | None, max_concurrency: int,
                     interval_s: float, drain_timeout: float, bisect_budget: float, server_pid: int | None,
                     t_start: float, zombie_max_tokens: int = 0, zombie_threshold_s: float = 1.0) -> int:
    """Design the waves, run the black-box check, print and write the report; returns the exit code."""
    from vlite.diagnostics.targets.blackbox import design_waves, run_blackbox, split_waves
    from vlite.diagnostics.workload.actions import ABORT_KINDS

    if workload.endswith(".jsonl"):
        waves = split_waves(specs, idle_every if idle_every is not None else max(1, -(-len(specs) // 8)))
    else:
        num_waves = -(-len(specs) // idle_every) if idle_every else min(10, len(specs))
        kinds = ABORT_KINDS if abort_mode == "mix" else (abort_mode,)
        waves = design_waves(specs, num_waves, seed, abort_rate, kinds)
    first = conn.state()
    pool = f", pool {first.kv_total:g} {first.unit}" if first.kv_total else ""
    bs = f", block_size {first.block_size} tokens" if first.block_size else ""
    console.print(f"leak-check (black-box): {common.plural(len(specs), 'request')} in {common.plural(len(waves), 'wave')} against {conn.adapter.kind} "
                  f"at {conn.base}{bs}{pool}", highlight=False)
    info = dict(info, idle_every=len(waves[0]) if waves else 0)
    res = run_blackbox(conn, waves, max_concurrency=max_concurrency, drain_timeout_s=drain_timeout,
                       bisect_budget_s=bisect_budget, sample_interval_s=interval_s, server_pid=server_pid, url=url,
                       seed=seed, info=info)
    if zombie_max_tokens and res.verdict != "INCONCLUSIVE":
        from vlite.diagnostics.targets.zombie_blackbox import apply_to, zombie_check_blackbox

        console.print(f"zombie check: one early-leaving request per client action, max_tokens {zombie_max_tokens}",
                      highlight=False)
        apply_to(res, zombie_check_blackbox(conn, max_tokens=zombie_max_tokens, threshold_s=zombie_threshold_s,
                                            drain_timeout_s=drain_timeout))
    res.info["total_s"] = round(time.time() - t_start, 2)
    console.print(f"{common.plural(len(specs), 'request')} in {common.seconds(res.info.get('replay_s'))} "
                  f"({common.seconds(res.info['total_s'])} in all); "
                  f"{common.plural(len(res.samples), 'sample')}", highlight=False)
    return _finish(res, console, report)


def run_from_log(path: Path, console: Console, report: Path | None) -> int:
    """``--from-log``: read the stats lines, decide, print and write the report; returns the exit code."""
    from vlite.diagnostics.targets.from_log import LogError, analyze_log

    try:
        res = analyze_log(path)
    except LogError as exc:
        common.fail(str(exc))
    console.print(f"leak-check --from-log {path}: {res.info['stats_lines']} stats lines "
                  f"({res.info['unparsable_lines']} unparsable, {res.info['other_lines']} other lines)",
                  highlight=False)
    return _finish(res, console, report)
