"""RunResult: a finished in-process or vlite-serve run (``targets/inprocess.py``,
``targets/http.py``): the findings, the samples and the replay's results. The other targets
return their own results; every target's run reaches the command as a ``targets/base.TargetRun``."""

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
