"""Help lists every choice and says what the defaults size."""

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


def _raw_help(*command: str) -> str:
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    return res.output


def test_leak_check_help_groups_options_by_mode():
    # not one flat list mixing the in-process, --url, --watch, --prometheus and --from-log options
    from vlite.cli import leak_check as lc

    text = _raw_help("leak-check")
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    panels = [lc.PANEL_WORKLOAD, lc.PANEL_INPROC, lc.PANEL_ENGINE, lc.PANEL_URL, lc.PANEL_FLEET, lc.PANEL_WATCH,
              lc.PANEL_PROM, lc.PANEL_LOG, lc.PANEL_REPORT]
    assert headings == panels + ["Options"], headings

    def section(title: str) -> str:
        start = text.index(title + ":\n")
        rest = [text.index(t + ":\n") for t in panels + ["Options"] if text.index(t + ":\n") > start]
        return text[start:min(rest) if rest else len(text)]

    assert "--abort-rate" in section(lc.PANEL_WORKLOAD) and "--num-requests" in section(lc.PANEL_WORKLOAD)
    assert "--scenario" in section(lc.PANEL_INPROC) and "--block-size" in section(lc.PANEL_ENGINE)
    assert {"--url", "--blackbox", "--api-key", "--drain-timeout"} <= set(section(lc.PANEL_URL).split())
    assert "--duration" in section(lc.PANEL_WATCH) and "--job" in section(lc.PANEL_PROM)
    assert "--from-log" in section(lc.PANEL_LOG) and "--report" in section(lc.PANEL_REPORT)
    assert "--url" not in section(lc.PANEL_INPROC).split()
    assert {"--replica", "--router-metrics"} <= set(section(lc.PANEL_FLEET).split())


def test_leak_check_help_ends_with_verdicts_exit_codes_and_an_example_per_mode():
    text = _raw_help("leak-check")
    epilog = text[text.index("Verdicts and exit codes:"):]
    for verdict in ("CLEAN", "LEAK", "ZOMBIE", "HOST-LEAK", "INCONCLUSIVE", "INTERRUPTED"):
        assert f" {verdict} " in epilog, verdict
    for code in ("0", "1", "2", "3", "4", "130"):
        assert re.search(rf"^\s+{code}\s", epilog, re.M), code
    examples = [line.strip() for line in epilog.splitlines() if line.strip().startswith("vlite leak-check")]
    for mode in ("--scenario", "--url", "--blackbox", "--watch", "--prometheus", "--from-log", "--report"):
        assert any(mode in e for e in examples), mode
    assert "vlite leak-check" in [e.split("#")[0].strip() for e in examples]  # the bare command


def test_leak_check_defaults_agree_in_help_readme_and_docs():
    text = _help("leak-check")
    assert "[default: 60;" in _option_help(text, "--num-requests")
    assert "[default: 0.3;" in _option_help(text, "--abort-rate")
    for doc in ("README.md", "docs/leak-check/replay.md"):
        assert "`vlite leak-check` alone runs 60 requests, 30% of them aborted" in " ".join(
            (ROOT / doc).read_text().split()), doc


def test_serve_help_has_vllms_access_log_flags():
    text = _help("serve")
    opt = _option_help(text, "--disable-access-log-for-endpoints")
    assert "[default: /health,/metrics]" in opt and "vLLM" in opt
    assert "--disable-uvicorn-access-log" in text
