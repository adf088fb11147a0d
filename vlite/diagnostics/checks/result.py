"""RunResult: a finished in-process or vlite-serve run (``targets/inprocess.py``,
``targets/http.py``): the findings, the samples and the replay's results. It is the detail of
such a run's ``targets/base.TargetRun``; its report (``report/report.py``) reads it through a
``RunDetail`` view."""

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

