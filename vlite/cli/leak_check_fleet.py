"""``vlite leak-check --url ROUTER --replica URL --replica URL ...``: the fleet mode. Builds the
fleet check (``vlite/diagnostics/targets/fleet.py``) from the options, prints one verdict per
replica and the router's, writes ``fleet.json`` and ``fleet.md`` under ``--report``.

Exit codes as for one server: 0 every replica CLEAN, 1 a replica LEAK / ZOMBIE or the router
LEAK, 2 a replica or the router cannot be reached, 3 INCONCLUSIVE.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from vlite.cli import common


def run_fleet(opts, console: Console, report: Path | None) -> int:
    """Run the fleet check ``opts`` (a ``FleetOptions``); print, write ``report``; the exit code."""
    from vlite.diagnostics.checks.fleet import lines
    from vlite.diagnostics.targets.base import TargetError, exit_code
    from vlite.diagnostics.targets.fleet import FleetRun

    def say(line: str) -> None:
        console.print(escape(line), highlight=False)

    run = FleetRun(opts, on_line=say)
    try:
        result = run.run()
    except TargetError as exc:
        common.fail(str(exc))
    except KeyboardInterrupt:  # keep what was measured: the probes so far, unjudged
        say(f"verdict: INTERRUPTED - {len(run.probes)} probes measured (above), no verdict")
        if report is not None:
            report.mkdir(parents=True, exist_ok=True)
            (report / "fleet.json").write_text(json.dumps({"verdict": "INTERRUPTED", "probes": [
                vars(p) for p in run.probes]}, indent=1, default=str))
        return exit_code("INTERRUPTED")
    text = lines(result)
    for line in text:
        say(line)
    if report is not None:
        try:
            report.mkdir(parents=True, exist_ok=True)
            (report / "fleet.json").write_text(json.dumps(result, indent=1, default=str))
            (report / "fleet.md").write_text("# vlite leak-check: fleet\n\n" + f"router {result['router_url']}\n\n"
                                             + "\n".join(f"- {x}" for x in text) + f"\n\nverdict: {result['verdict']}\n")
        except OSError as exc:
            common.fail(f"cannot write the report to {report}: {exc}")
        say(f"report written to {report}/ (fleet.json, fleet.md)")
    per = ", ".join(f"{r['url']} {r['verdict']}" + (f" (hop {r['hop']})" if r["hop"] else "")
                    for r in result["replicas"])
    say(f"verdict: {result['verdict']} - {per}; router {result['router']['verdict'] or 'not reconciled'}")
    return exit_code(result["verdict"])
