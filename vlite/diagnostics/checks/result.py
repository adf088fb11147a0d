"""RunResult: a finished in-process or vlite-serve run (``targets/inprocess.py``,
``targets/http.py``): the findings, the samples and the replay's results. It is the detail of
such a run's ``targets/base.TargetRun`` (a ``RunDetail``: its sections, report.json fields and
plots come from ``report/report.py`` and ``report/plots.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from vlite.diagnostics.checks.detect import Findings
from vlite.diagnostics.workload.replay import ReplayResult


@dataclass
class RunResult:
    """A finished run: findings, samples (DataFrame), the client's results and run facts."""

    findings: Findings
    samples: pd.DataFrame
    replay: ReplayResult
    info: dict = field(default_factory=dict)

    title = "vlite leak-check report"
    headline_first = True
    timing_first = False

    # The report modules are imported when a report is made: they stand above the checks.
    def sections(self) -> list:
        """The report's sections (``report.report.sections``)."""
        from vlite.diagnostics.report.report import sections

        return sections(self)

    def to_json(self) -> dict:
        """report.json's fields of this run (``report.report.report_json``)."""
        from vlite.diagnostics.report.report import report_json

        return report_json(self)

    def plots(self, out_dir) -> list[str]:
        """Write blocks.png, memory.png, leaks_by_action.png and troughs.png into ``out_dir``."""
        from vlite.diagnostics.report.plots import write_plots

        return write_plots(self, out_dir)

    def extra_files(self) -> dict[str, str]:
        """None besides the common files."""
        return {}
