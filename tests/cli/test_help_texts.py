"""Help lists every choice and says what the defaults size (issue 35)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlite.cli import common
from vlite.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def _help(*command: str) -> str:
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    # undo click's wrapping: "abort-\n    waiting" -> "abort-waiting"
    return re.sub(r"-\s+", "-", re.sub(r"\s+", " ", res.output))


def _option_help(text: str, option: str) -> str:
    start = text.index(option + " <")  # where the option is listed, not where another's help names it
    nxt = re.search(r" -{1,2}[a-z][a-z-]* [<\[]| -[a-z], --", text[start + len(option) + 1:])
    return text[start:start + len(option) + 1 + (nxt.start() if nxt else len(text))]


@pytest.mark.parametrize("command", [("leak-check",), ("serve",)])
def test_inject_fault_help_lists_every_fault(command):
    from vlite.engine.core.faults import FAULTS

    text = _option_help(_help(*command), "--inject-fault")
    for name in FAULTS:
        assert name in text, name


def test_scenario_help_lists_every_scenario():
    from vlite.cli.leak_check import SCENARIO_NAMES
    from vlite.diagnostics.scenarios import SCENARIOS

    assert list(SCENARIO_NAMES) == list(SCENARIOS)  # the help's copy of the names is the registry's
    text = _option_help(_help("leak-check"), "--scenario")
    for name in SCENARIOS:
        assert name in text, name


def test_leak_check_help_says_what_num_requests_and_the_all_paths_pool_size():
    text = _help("leak-check")
    assert "all-paths (default)" in _option_help(text, "--num-requests")
    assert "all-paths KV pool" in _option_help(text, "--num-requests")
    kv = _option_help(text, "--kv-cache-memory-bytes")
    assert "default 1 GiB" in kv and "deliberately small KV pool" in kv and "preemption" in kv
    assert "deliberately small KV pool" in _option_help(text, "--workload")


def test_pluralisation():
    assert common.plural(1, "request") == "1 request"
    assert common.plural(0, "request") == "0 requests" and common.plural(2, "sample") == "2 samples"


def test_mutants_help_ends_its_sentences():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "leak_check" / "mutants.py"), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    description = " ".join(res.stdout.split("\n\n")[1].split())
    assert description.endswith("catch.") and "count how many" in description
    assert "free-skips-first-block" in res.stdout  # --only lists the mutants
