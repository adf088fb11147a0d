"""The sections of a fleet's report (``vlite leak-check --url ROUTER --replica URL ...``): the
router, then one verdict line per replica with its reasons and the router's (``checks/fleet.lines``)."""

from __future__ import annotations

from vlite.diagnostics.checks.fleet import lines
from vlite.diagnostics.targets.base import Section


def sections(doc: dict) -> list[Section]:
    """The sections of a fleet's judged ``doc`` (``checks.fleet.judge_fleet`` plus the run's
    record); none for a run stopped before a verdict (its probes are in report.json)."""
    if "replicas" not in doc:
        return []
    return [Section(text=f"router {doc['router_url']}\n", terminal=False), Section(lines=lines(doc))]
