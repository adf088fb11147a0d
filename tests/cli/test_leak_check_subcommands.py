"""`vlite leak-check` has one subcommand per mode; the older one-command spelling reaches the same
subcommand and the same verdict; bad values and another mode's flags are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
from typer.testing import CliRunner

from vlite.cli.leak_check.group import route
from vlite.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
DIAG = ROOT / "tests" / "diagnostics"
FIX = DIAG / "fixtures"
sys.path.insert(0, str(DIAG))  # the fake servers and recordings of the mode's own tests


def _invoke(*args):
    return CliRunner().invoke(app, ["leak-check", *map(str, args)], env={"COLUMNS": "200"})


def _one_error_line(res) -> str:
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.output
    return lines[0]


@pytest.mark.parametrize("old, new", [
    (["--num-requests", "120", "--report", "r"], ["replay", "--num-requests", "120", "--report", "r"]),
    ([], ["replay"]),
    (["--url", "U", "--num-requests", "4"], ["url", "--url", "U", "--num-requests", "4"]),
    (["--url", "U", "--blackbox"], ["blackbox", "--url", "U"]),
    (["--watch", "--url", "U", "--duration", "5"], ["watch", "--url", "U", "--duration", "5"]),
    (["--prometheus", "P", "--job", "vllm"], ["prometheus", "--prometheus", "P", "--job", "vllm"]),
    (["--from-log", "server.log", "--report", "r"], ["log", "server.log", "--report", "r"]),
    (["--from-log=server.log"], ["log", "server.log"]),
    (["--url", "R", "--replica", "A", "--replica", "B"], ["fleet", "--url", "R", "--replica", "A", "--replica", "B"]),
    (["--scenario", "all", "--model", "m"], ["scenario", "all", "--model", "m"]),
])
def test_the_older_spelling_is_routed_to_its_subcommand(old, new):
    assert route(old) == new


@pytest.mark.parametrize("args, says", [
    (["url", "--url", "http://127.0.0.1:9", "--storm-requests", "-1"], "--storm-requests -1 is out of range: it must be >= 0"),
    (["--url", "http://127.0.0.1:9", "--storm-requests", "-1"], "--storm-requests -1 is out of range: it must be >= 0"),
    (["--num-requests", "0"], "--num-requests 0 is out of range: it must be >= 1"),
    (["replay", "--abort-rate", "1.5"], "--abort-rate 1.5 is out of range: it must be between 0.0 and 1.0"),
])
def test_a_value_out_of_range_is_one_line(args, says):
    line = _one_error_line(_invoke(*args))
    assert says in line and "Usage:" not in line


@pytest.mark.parametrize("args, owner", [
    (["replay", "--url", "http://127.0.0.1:9"], "`vlite leak-check url`"),
    (["log", "x.log", "--storm-requests", "3"], "`vlite leak-check url`"),
    (["watch", "--url", "http://127.0.0.1:9", "--job", "vllm"], "`vlite leak-check prometheus`"),
    (["--url", "http://127.0.0.1:9", "--block-size", "32"], "`vlite leak-check replay` or `scenario`"),
])
def test_a_flag_of_another_mode_names_its_subcommand_in_one_line(args, owner):
    assert owner in _one_error_line(_invoke(*args))


def test_an_engine_flag_error_names_the_flag_before_the_heavy_imports():
    code = ("import sys\nfrom vlite.cli.main import app\n"
            "try:\n    app(['leak-check', '--block-size', '3', '--workload', 'synthetic'])\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules, "
            "'vlite.engine.llm_engine' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    assert res.stdout.strip().splitlines()[-1] == "exit 2 False False", res.stdout + res.stderr
    assert res.stderr.strip() == "error: --block-size must be a positive power of two, got 3"


def _same(old: list, new: list, code: int, words: str) -> None:
    a, b = _invoke(*old), _invoke(*new)
    assert a.exit_code == b.exit_code == code, a.output + "\n---\n" + b.output
    verdict = [ln for ln in a.output.splitlines() if ln.startswith("verdict:")]
    assert verdict and words in verdict[-1], a.output
    assert verdict == [ln for ln in b.output.splitlines() if ln.startswith("verdict:")]


def test_replay_gets_the_verdict_of_the_bare_command(tiny_model_dir):
    args = ["--model", tiny_model_dir, "--num-requests", 6, "--abort-rate", 1.0, "--abort-mode", "disconnect-stream",
            "--input-len", "8:24", "--output-len", "8:10", "--num-blocks", 64, "--inject-fault", "skip-free-on-abort"]
    a, b = _invoke(*args), _invoke("replay", *args)
    assert a.exit_code == b.exit_code == 1, a.output + b.output
    assert "LEAK:" in a.output and "LEAK:" in b.output


def test_scenario_gets_the_verdict_of_the_older_spelling(tiny_model_dir):
    fault = ["--model", tiny_model_dir, "--inject-fault", "skip-free-on-abort"]
    a = _invoke("--scenario", "disconnect-mid-stream", *fault)
    b = _invoke("scenario", "disconnect-mid-stream", *fault)
    assert a.exit_code == b.exit_code == 1 and "0/1 scenarios passed" in a.output + b.output, a.output + b.output
    assert "0/1 scenarios passed" in b.output


def test_log_gets_the_verdict_of_from_log():
    log = FIX / "logs" / "trtllm-kv-transfer-timeout.log"
    _same(["--from-log", log], ["log", log], 1, "LEAK")


@pytest.fixture
def busy_vllm():
    from fake_http import ServerPool
    from test_leak_blackbox import _Fake

    pool = ServerPool()
    page = (FIX / "vllm-0.32.0-cpu-busy.prom").read_text()  # 8 running, forever
    yield pool.start(type("H", (_Fake,), {"metrics": page}))
    pool.close()


@pytest.mark.parametrize("old, new", [(["--url"], ["url", "--url"]), (["--blackbox", "--url"], ["blackbox", "--url"])])
def test_url_and_blackbox_get_the_verdict_of_the_older_spelling(busy_vllm, old, new):
    rest = [busy_vllm, "--num-requests", 2, "--drain-timeout", 1, "--storm-requests", 0]
    _same([*old, *rest], [*new, *rest], 3, "INCONCLUSIVE")


def test_watch_gets_the_verdict_of_the_older_spelling(busy_vllm):
    rest = ["--url", busy_vllm, "--duration", 1, "--interval", 0.2]
    a, b = _invoke("--watch", *rest), _invoke("watch", *rest)
    assert a.exit_code == b.exit_code and "verdict:" in a.output and "verdict:" in b.output, a.output + b.output
    assert a.output.splitlines()[-1].split(" - ")[0] == b.output.splitlines()[-1].split(" - ")[0]


def test_prometheus_gets_the_verdict_of_the_older_spelling():
    from fake_http import QuietHandler, ServerPool
    from test_leak_prometheus import _recorded

    rec = _recorded("vlite-leak")

    class Handler(QuietHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path = urlparse(self.path).path
            body = next((c["body"] for c in rec["calls"] if c["path"] == path), {"status": "error"})
            self.reply(200 if body.get("status") == "success" else 404, json.dumps(body), "application/json")

    pool = ServerPool()
    try:
        url = pool.start(Handler)
        rest = ["--prometheus", url, "--job", "vlite-leak", "--since", rec["since"], "--interval", 1]
        _same(rest, ["prometheus", *rest], 1, "LEAK")
    finally:
        pool.close()


def test_fleet_gets_the_verdict_of_the_older_spelling():
    from fake_http import ServerPool
    from test_leak_fleet import _fleet

    pool = ServerPool()
    try:
        router, urls = _fleet(pool, drop_aborts=True)
        rest = ["--url", router, "--replica", urls[0], "--replica", urls[1], "--num-requests", 4,
                "--zombie-max-tokens", 100, "--zombie-threshold-s", 0.5, "--drain-timeout", 10,
                "--probes-per-replica", 1, "--storm-requests", 0]
        a, b = _invoke(*rest), _invoke("fleet", *rest)
    finally:
        pool.close()
    assert a.exit_code == b.exit_code == 1, a.output + b.output
    assert "verdict: ZOMBIE" in a.output and "verdict: ZOMBIE" in b.output


@pytest.mark.parametrize("args, words", [
    (["log"], "missing FILE: the server's log file"),
    (["--from-log"], "missing FILE: the server's log file"),
    (["scenario"], "missing NAME: all, or one of: abort-waiting"),
    (["blackbx", "--url", "http://127.0.0.1:9"], "no subcommand 'blackbx'; did you mean blackbox?"),
    (["nope"], "no subcommand 'nope' (subcommands: replay, url, blackbox"),
])
def test_a_missing_argument_or_an_unknown_subcommand_is_one_line_that_names_it(args, words):
    res = _invoke(*args)
    assert res.exit_code == 2 and words in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_one_line_option_help_is_not_cut_at_an_abbreviation():
    res = CliRunner().invoke(app, ["leak-check", "prometheus", "--help"], env={"COLUMNS": "100"})
    assert "How far back, e.g. 90s" in res.output, res.output


@pytest.mark.parametrize("mode", ["url", "blackbox", "watch"])
def test_an_unknown_server_kind_is_one_line_before_any_connection(mode, monkeypatch):
    import vlite.diagnostics.targets.connection as connection

    def no_connection(*a, **k):
        raise AssertionError("connected before checking --server-kind")

    monkeypatch.setattr(connection, "connect", no_connection)
    line = _one_error_line(_invoke(mode, "--url", "http://127.0.0.1:9", "--server-kind", "vllm2"))
    assert "unknown --server-kind 'vllm2'; choose auto or one of: vlite, vllm" in line
