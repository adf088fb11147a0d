"""``vlite leak-check --url ROUTER --replica URL --replica URL ...``: the fleet mode. Builds the
fleet target (``vlite/diagnostics/targets/fleet.FleetTarget``) from the options and runs it as
every target is run (``leak_check_target.run_target``): one verdict per replica and the router's;
under ``--report`` report.json, report.md, report.html, samples.csv and fleet.json.

Exit codes as for one server: 0 every replica CLEAN, 1 a replica LEAK / ZOMBIE or the router
LEAK, 2 a replica or the router cannot be reached, 3 INCONCLUSIVE, 130 INTERRUPTED.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console


def run_fleet(opts, console: Console, report: Path | None) -> int:
    """Run the fleet check ``opts`` (a ``FleetOptions``); print, write ``report``; the exit code."""
    from vlite.cli.leak_check_target import run_target
    from vlite.diagnostics.targets.base import TargetPlan
    from vlite.diagnostics.targets.fleet import FleetTarget

    return run_target(FleetTarget(opts), TargetPlan(), console, report)
