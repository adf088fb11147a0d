"""The sections of a fleet's report (``vlite leak-check --url ROUTER --replica URL ...``): the
router, then one verdict line per replica with its reasons and the router's (``checks/fleet.lines``)."""

from __future__ import annotations

import json

from vlite.diagnostics.checks.fleet import lines
from vlite.diagnostics.targets.base import Section


def sections(doc: dict) -> list[Section]:
    """The sections of a fleet's judged ``doc`` (``checks.fleet.judge_fleet`` plus the run's
    record); none for a run stopped before a verdict (its probes are in report.json)."""
    if "replicas" not in doc:
        return []
    return [Section(text=f"router {doc['router_url']}\n", terminal=False), Section(lines=lines(doc))]


class FleetView:
    """A fleet's result (``doc``: its judged record) as a ``RunDetail``: fleet.json besides the
    common files, the record ``checks.fleet.rejudge`` and tests/interop/fleet.sh read."""

    title = "vlite leak-check: fleet"
    headline_first = False  # the probes were printed as they came; the verdict line ends the report
    timing_first = False

    def __init__(self, res) -> None:
        self.doc = res.doc

    def sections(self) -> list[Section]:
        return sections(self.doc)

    def to_json(self) -> dict:
        return self.doc

    def plots(self, out_dir) -> list[str]:
        return []

    def extra_files(self) -> dict[str, str]:
        return {"fleet.json": json.dumps(self.doc, indent=1, default=str)}
