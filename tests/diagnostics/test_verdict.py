"""One verdict type: each verdict's exit code and meaning, the run's exit code from several
verdicts, and verdicts that stay plain strings in report.json and in lookups by string."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlite.diagnostics.checks.verdict import EXIT_HEADLINE_NOT_EXERCISED, Verdict, exit_code, run_exit_code
from vlite.diagnostics.report.target_report import write_run_report
from vlite.diagnostics.targets.base import TargetPlan
from vlite.diagnostics.targets.from_log import LogTarget

FIX = Path(__file__).parent / "fixtures"


def test_each_verdict_has_its_exit_code_and_a_one_line_meaning():
    codes = {v.value: v.exit_code for v in Verdict}
    assert codes == {"CLEAN": 0, "LEAK": 1, "ZOMBIE": 1, "HOST-LEAK": 1, "WEDGED": 1, "EMPTY-OUTPUT": 1,
                     "OUTPUT-DRIFT": 1, "ENGINE-ERROR": 1, "INCONCLUSIVE": 3, "INTERRUPTED": 130}
    assert all(v.meaning and "\n" not in v.meaning for v in Verdict)
    assert [v for v in Verdict if v.is_finding] == [Verdict.LEAK, Verdict.ZOMBIE, Verdict.HOST_LEAK, Verdict.WEDGED,
                                                    Verdict.EMPTY_OUTPUT, Verdict.OUTPUT_DRIFT, Verdict.ENGINE_ERROR]
    assert exit_code("HOST-LEAK") == 1 and exit_code("a --scenario failed") == 1 and exit_code("CLEAN") == 0


@pytest.mark.parametrize("verdicts, not_exercised, code", [
    (["CLEAN", "CLEAN"], False, 0),
    ([Verdict.CLEAN], True, EXIT_HEADLINE_NOT_EXERCISED),
    (["CLEAN", "INCONCLUSIVE"], True, 3),
    (["INCONCLUSIVE", "HOST-LEAK", "CLEAN"], False, 1),
    (["LEAK", "INTERRUPTED"], False, 130),
    ([], False, 3),
])
def test_the_run_exit_code_combines_verdicts(verdicts, not_exercised, code):
    assert run_exit_code(verdicts, headline_not_exercised=not_exercised) == code


def test_a_verdict_is_its_string_in_text_json_and_lookups():
    v = Verdict.HOST_LEAK
    assert v == "HOST-LEAK" and f"{v}: x" == "HOST-LEAK: x" and str(v) == "HOST-LEAK"
    assert json.dumps({"verdict": v, v: [v]}, indent=2) == json.dumps({"verdict": "HOST-LEAK", "HOST-LEAK": ["HOST-LEAK"]},
                                                                      indent=2)
    assert {v: "red"}["HOST-LEAK"] == "red" and "EMPTY-OUTPUT" in {Verdict.EMPTY_OUTPUT}
    assert Verdict("OUTPUT-DRIFT") is Verdict.OUTPUT_DRIFT


@pytest.mark.parametrize("log, verdict", [("vllm-0.32.0-cpu-clean-run.log", "CLEAN"),
                                          ("vlite-serve-skip-free-on-abort.log", "LEAK")])
def test_report_json_writes_the_verdict_as_before(tmp_path, log, verdict):
    run = LogTarget(FIX / log).run(TargetPlan())
    assert run.verdict is Verdict(verdict)
    write_run_report(run, tmp_path)
    text = (tmp_path / "report.json").read_text()
    assert f'"verdict": "{verdict}"' in text and json.loads(text)["verdict"] == verdict
