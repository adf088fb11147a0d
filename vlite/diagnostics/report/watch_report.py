"""Report of a passive watch (``--watch``) or a Prometheus range (``--prometheus``): report.md,
report.html (one file), samples.csv and report.json, rewritten at each idle point so that the
directory is current while the watch runs."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from vlite.diagnostics.checks.verdict import Verdict
from vlite.diagnostics.report.writer import md_table, write_report_dir
from vlite.diagnostics.targets.watch import WatchResult

_COLOR = {Verdict.CLEAN: "green", Verdict.INCONCLUSIVE: "yellow"}  # every other verdict red


def print_watch(res: WatchResult, console: Console) -> None:
    """A fleet's verdict per replica, then the notes (the idle points and alerts were printed as they came)."""
    for row in res.instances or []:
        color = _COLOR.get(row["verdict"], "red")
        console.print(f"replica {escape(row['instance'])}: [{color}]{escape(row['summary'])}[/]", highlight=False)
    for n in res.notes:
        console.print(f"[yellow]note:[/] {escape(n)}", highlight=False)


def print_watch_verdict(res: WatchResult, console: Console, prefix: str = "") -> None:
    """The one-line verdict (CLEAN green, INCONCLUSIVE yellow, any flag red)."""
    console.print(f"[bold {_COLOR.get(res.verdict, 'red')}]{escape(prefix + res.summary)}[/]", highlight=False)


def report_markdown(res: WatchResult) -> str:
    """report.md of a watch (or a Prometheus range)."""
    pts = [asdict(p) for p in res.idle_points]
    for p in pts:
        p["time"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(p["time"]))
    alerts = [asdict(a) | {"time": time.strftime("%H:%M:%S", time.localtime(a.time))} for a in res.alerts]
    out = [f"# vlite leak-check --watch report ({res.server_kind})\n",
           f"**{res.verdict}**: {res.summary.split(': ', 1)[-1]}\n", "## Run\n",
           md_table([{"key": k, "value": v} for k, v in res.info.items()], ("key", "value"), 100),
           *(["\n## Replicas (a verdict each)\n",
               md_table(res.instances, ("instance", "verdict", "idle_points", "kv_total", "summary"), 200)]
             if res.instances else []),
           "\n## Alerts\n", md_table(alerts, ("flag", "time", "idle_point", "message")) if alerts else "_none_\n",
           "\n## Natural idle points (running == waiting == 0)\n",
           md_table(pts, ("index", "time", "kv_used", "requests_served", "memory_bytes", "uncounted"), 200)]
    if res.memory_test:
        m = res.memory_test
        source = f" ({m['source']})" if m.get("source") else ""
        slope = ("not fitted" if m.get("late_slope") is None else
                 f"{m['late_slope'] / 1024:.1f} KiB/request (95% CI {m['late_ci95'][0] / 1024:.1f} .. "
                 f"{m['late_ci95'][1] / 1024:.1f})")
        state = ("keeps growing" if m["keeps_growing"] else
                 "inconclusive (the CI straddles the threshold)" if m.get("inconclusive") else
                 "levelled off (warm-up)" if m["warm_up"] else "below the threshold")
        out.append(f"\nHost memory{source}: plateau test over {m['n']} idle points: late-half slope {slope}: "
                   f"{state}\n")
    out += ["\n## Notes\n", "\n".join(f"- {n}" for n in res.notes) or "_none_", ""]
    return "\n".join(out)


def write_watch_report(res: WatchResult, out_dir: Path) -> Path:
    """Write report.md, report.html, samples.csv and report.json into ``out_dir`` (created); called
    at each idle point, so the report stays current.

    Raises:
        OSError: the directory cannot be created or written.
    """
    body = {"verdict": res.verdict, "summary": res.summary, "server_kind": res.server_kind, "unit": res.unit,
            "run": res.info, "alerts": [asdict(a) for a in res.alerts],
            "idle_points": [asdict(p) for p in res.idle_points], "memory_test": res.memory_test, "notes": res.notes,
            "instances": res.instances}
    return write_report_dir(out_dir, body, res.samples, lambda d: [], lambda plots: report_markdown(res),
                            f"vlite leak-check --watch: {res.verdict}")
