"""One result type and one reporter family: every mode's run is a ``TargetRun`` whose detail
gives only sections, report.json fields, plots and extra files (``targets/base.RunDetail``);
``report/target_report.py`` renders any of them, and the fleet is a target like the others."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
from rich.console import Console

from vlite.diagnostics.report.target_report import print_run, print_run_verdict, write_run_report
from vlite.diagnostics.targets.base import LeakCheckTarget, RunDetail, Section, TargetPlan, TargetRun

FIX = Path(__file__).parent / "fixtures"
REPORT = Path(__file__).parents[2] / "vlite" / "diagnostics" / "report"


class _Detail:
    """A mode no report knows: only the ``RunDetail`` interface."""

    title = "a new mode"
    headline_first = True
    timing_first = False

    def sections(self) -> list[Section]:
        return [Section(lines=["only on the terminal"], markdown=False),
                Section("Widgets", rows=[{"widget": "w1", "held": 3}], cols=("widget", "held"), terminal=False),
                Section("Both", lines=[("a styled line", "yellow")])]

    def to_json(self) -> dict:
        return {"widgets": {"w1": 3}}

    def plots(self, out_dir) -> list[str]:
        return []

    def extra_files(self) -> dict[str, str]:
        return {"widgets.txt": "w1 3\n"}


def test_a_detail_that_only_has_the_interface_is_printed_and_written(tmp_path):
    detail = _Detail()
    assert isinstance(detail, RunDetail)
    run = TargetRun("new", "LEAK", "LEAK: 3 widgets held", detail, pd.DataFrame({"t_s": [0.0]}), {"url": "u"},
                    ["a note"])
    console = Console(record=True, width=200)
    print_run(run, console, timing="TIMING")
    print_run_verdict(run, console, prefix="verdict: ")
    text = console.export_text()
    assert text.splitlines() == ["LEAK: 3 widgets held", "only on the terminal", "a styled line", "note: a note",
                                 "verdict: LEAK: 3 widgets held"]
    files = write_run_report(run, tmp_path)
    assert files == "report.json, report.md, report.html, samples.csv, widgets.txt"
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["kind"] == "new" and doc["verdict"] == "LEAK" and doc["exit_code"] == 1
    assert doc["widgets"] == {"w1": 3} and doc["run"] == {"url": "u"} and doc["notes"] == ["a note"]
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# a new mode\n") and "## Widgets" in md and "| w1 | 3 |" in md
    assert "only on the terminal" not in md and "- a styled line" in md and "- a note" in md
    assert "| w1 | 3 |" not in text and (tmp_path / "widgets.txt").read_text() == "w1 3\n"
    assert "Widgets" in (tmp_path / "report.html").read_text()


def test_no_report_module_tells_result_types_apart():
    for path in REPORT.glob("*.py"):
        src = path.read_text()
        assert not re.search(r"\b(RunResult|BlackboxResult|WatchResult|FleetResult)\b", src), path.name
        # an isinstance in report/ asks for the interface or a plain value, never for a result type
        assert set(re.findall(r"isinstance\([^,]+, (\w+)\)", src)) <= {"RunDetail", "tuple", "float", "int", "str", "dict", "list"}, path.name


def test_fleet_target_runs_through_the_common_reporter(tmp_path, monkeypatch):
    from vlite.cli.leak_check_target import run_target
    from vlite.diagnostics.targets.fleet import FleetOptions, FleetRun, FleetTarget

    doc = json.loads((FIX / "fleet-live-drop-aborts.json").read_text())
    monkeypatch.setattr(FleetRun, "run", lambda self: doc)  # the recorded live fleet, not a network
    target = FleetTarget(FleetOptions(doc["router_url"], [r["url"] for r in doc["replicas"]]))
    assert isinstance(target, LeakCheckTarget) and target.kind == "fleet" and target.interruptible is None
    console = Console(record=True, width=300)
    code = run_target(target, TargetPlan(), console, tmp_path / "rep")
    out = console.export_text()
    assert code == (1 if doc["verdict"] in ("LEAK", "ZOMBIE") else 0 if doc["verdict"] == "CLEAN" else 3)
    assert out.splitlines()[-1].startswith(f"verdict: {doc['verdict']} - ")
    assert "report.json, report.md, report.html, samples.csv, fleet.json" in out
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["kind"] == "fleet" and report["verdict"] == doc["verdict"] and report["replicas"] == doc["replicas"]
    assert json.loads((tmp_path / "rep" / "fleet.json").read_text()) == doc
    assert f"router {doc['router_url']}" in (tmp_path / "rep" / "report.md").read_text()


def test_a_ctrl_c_during_a_fleet_run_keeps_its_probes(tmp_path, monkeypatch):
    from vlite.cli.leak_check_target import run_target
    from vlite.diagnostics.targets.fleet import FleetOptions, FleetRun, FleetTarget

    def stopped(self):
        self.probes.append("p")
        raise KeyboardInterrupt

    monkeypatch.setattr(FleetRun, "run", stopped)
    monkeypatch.setattr("vlite.diagnostics.targets.fleet.asdict", lambda p: {"probe": p})
    console = Console(record=True, width=300)
    code = run_target(FleetTarget(FleetOptions("http://r", ["http://a"])), TargetPlan(), console, tmp_path)
    assert code == 130 and "verdict: INTERRUPTED - 1 probes measured (above), no verdict" in console.export_text()
    assert json.loads((tmp_path / "fleet.json").read_text()) == {"verdict": "INTERRUPTED", "probes": [{"probe": "p"}]}
