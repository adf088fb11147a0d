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
    """The whole help of ``command`` (a leak-check subcommand's ``--help-all``), unwrapped."""
    flag = "--help-all" if command[:1] == ("leak-check",) else "--help"
    res = CliRunner().invoke(app, [*command, flag], env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    # undo click's wrapping: "abort-\n    waiting" -> "abort-waiting"
    return re.sub(r"-\s+", "-", re.sub(r"\s+", " ", res.output))


def _option_help(text: str, option: str) -> str:
    start = text.index(option + " <")  # where the option is listed, not where another's help names it
    nxt = re.search(r" -{1,2}[a-z][a-z-]* [<\[]| -[a-z], --", text[start + len(option) + 1:])
    return text[start:start + len(option) + 1 + (nxt.start() if nxt else len(text))]


@pytest.mark.parametrize("command", [("leak-check", "replay"), ("leak-check", "scenario"), ("serve",)])
def test_inject_fault_help_lists_every_fault(command):
    from vlite.engine.core.faults import FAULTS

    text = _option_help(_help(*command), "--inject-fault")
    for name in FAULTS:
        assert name in text, name


def test_scenario_help_lists_every_scenario():
    from vlite.cli.leak_check import SCENARIO_NAMES
    from vlite.diagnostics.scenarios import SCENARIOS

    assert list(SCENARIO_NAMES) == list(SCENARIOS)  # the help's copy of the names is the registry's
    text = _help("leak-check", "scenario")
    for name in SCENARIOS:
        assert name in text, name


def test_leak_check_help_says_what_num_requests_and_the_all_paths_pool_size():
    text = _help("leak-check", "replay")
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


def _raw_help(*command: str) -> str:  # as printed, at 100 columns
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    return res.output


SUBCOMMANDS = ("replay", "url", "blackbox", "watch", "prometheus", "log", "fleet", "scenario")


def _headings(text: str) -> list[str]:
    return [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]


def test_each_subcommand_has_its_own_options_in_sections():
    from vlite.cli.leak_check import options as o

    replay = _raw_help("leak-check", "replay")
    assert _headings(replay) == [o.PANEL_WORKLOAD, o.PANEL_INPROC, o.PANEL_ENGINE, "Options"], replay
    assert "--url" not in replay.split() and "--block-size" in replay
    url = _raw_help("leak-check", "url")
    assert _headings(url) == [o.PANEL_WORKLOAD, o.PANEL_SERVER, "Options"], url
    assert {"--url", "--api-key", "--drain-timeout", "--storm-requests"} <= set(url.split())
    assert "--block-size" not in url and "--from-log" not in url
    assert {"--duration", "--server-log"} <= set(_raw_help("leak-check", "watch").split())
    assert {"--job", "--since", "--instance-label"} <= set(_raw_help("leak-check", "prometheus").split())
    assert {"--replica", "--router-metrics"} <= set(_raw_help("leak-check", "fleet").split())
    assert "FILE" in _raw_help("leak-check", "log")


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_each_subcommand_help_fits_in_40_lines(sub):
    assert len(_raw_help("leak-check", sub).splitlines()) <= 40


def test_leak_check_help_lists_subcommands_verdicts_exit_codes_and_an_example_per_subcommand():
    text = _raw_help("leak-check")
    commands = text[text.index("Commands:"):text.index("Verdicts and exit codes:")]
    assert [line.split()[0] for line in commands.splitlines()[1:] if line.strip()] == list(SUBCOMMANDS)
    epilog = text[text.index("Verdicts and exit codes:"):]
    for verdict in ("CLEAN", "LEAK", "ZOMBIE", "HOST-LEAK", "WEDGED", "INCONCLUSIVE", "INTERRUPTED"):
        assert f" {verdict} " in epilog, verdict
    for code in ("0", "1", "2", "3", "4", "130"):
        assert re.search(rf"^\s+{code}\s", epilog, re.M), code
    examples = [line.split("#")[0].split() for line in epilog.splitlines()
                if line.strip().startswith("vlite leak-check")]
    assert ["vlite", "leak-check"] in examples  # the bare command
    for sub in SUBCOMMANDS[1:]:
        assert any(e[2:3] == [sub] for e in examples), sub


def _function_bodies_over(limit: int):
    """Functions in vlite/cli whose body (after the docstring) is over ``limit`` lines."""
    import ast

    for path in sorted((ROOT / "vlite" / "cli").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
                if node.end_lineno - body[0].lineno + 1 > limit:
                    yield f"{path.relative_to(ROOT)}:{node.name}"


def test_no_function_body_in_the_cli_is_over_80_lines_and_no_file_over_600():
    long = [str(p.relative_to(ROOT)) for p in (ROOT / "vlite" / "cli").rglob("*.py")
            if len(p.read_text().splitlines()) > 600]
    assert list(_function_bodies_over(80)) + long == []


def test_leak_check_defaults_agree_in_help_readme_and_docs():
    text = _help("leak-check", "replay")
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
