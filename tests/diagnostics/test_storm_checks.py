"""After an abort storm: the wedge probe (WEDGED) and the output canary (EMPTY-OUTPUT, OUTPUT-DRIFT).

The judges alone on hand-made measures, then real `vlite serve` processes (tiny random model, a
32-block pool that a 16-request storm fills): healthy (both checks pass), with the planted
``reclaim-on-admission`` (WEDGED, through the CLI) and ``empty-output-after-abort`` (EMPTY-OUTPUT,
through the black-box target). 127.0.0.1 only, bounded waits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_harness import ServerProcess, running

from vlite.diagnostics.checks.storm import judge_canary, judge_wedge, wedge_bound, worst
from vlite.diagnostics.targets.storm import storm_check

VLITE = str(Path(sys.executable).with_name("vlite"))
POOL = ("--num-blocks", "32")  # 16 storm prompts of about 25 tokens fill it (2 blocks each)


# -- the judges ------------------------------------------------------------------------------------
def test_wedge_bound_follows_the_measured_pace_with_a_floor_and_an_override():
    assert wedge_bound([0.01, 0.2, 0.05]) == 5.0  # 10 x 0.2 s is under the 5 s floor
    assert wedge_bound([0.9, 1.5]) == pytest.approx(15.0)  # a slow server: 10 x its slowest run
    assert wedge_bound([]) == 5.0
    assert wedge_bound([0.9, 1.5], override_s=2.5) == 2.5  # --wedge-timeout-s


def test_wedged_needs_a_healthy_health_and_no_completion():
    probe = {"health_status": 200, "completed": False, "status": "ReadTimeout", "latency_s": 5.0, "bound_s": 5.0}
    assert judge_wedge(probe)[0] == "WEDGED"
    assert judge_wedge(probe | {"completed": True, "status": 200, "latency_s": 0.1})[0] is None
    verdict, why = judge_wedge(probe | {"health_status": "ConnectError"})
    assert verdict is None and "down, not wedged" in why


def _run(text, tokens=None, status=200):
    return {"status": status, "text": text, "completion_tokens": tokens, "finish_reason": "length"}


def test_canary_verdicts():
    before = [_run(" one, two", 4), _run(" one, two", 4)]
    assert judge_canary(before, _run(" one, two", 4))[0] is None
    assert judge_canary(before, _run("", 0))[0] == "EMPTY-OUTPUT"
    assert judge_canary(before, _run("", None))[0] == "EMPTY-OUTPUT"  # no usage: no text is no token
    verdict, why = judge_canary(before, _run(" one, three", 4))
    assert verdict == "OUTPUT-DRIFT" and "' one, two' before" in why
    # not judged: a server that drifts between its two runs before, or gave nothing before, or failed after
    assert judge_canary([_run(" a", 1), _run(" b", 1)], _run(" c", 1))[0] is None
    assert judge_canary([_run("", 0), _run("", 0)], _run("", 0))[0] is None
    assert judge_canary(before, _run(None, status=503))[0] is None
    assert judge_canary(before, None)[0] is None
    assert worst([None, "OUTPUT-DRIFT", "WEDGED"]) == "WEDGED" and worst([None]) is None


def test_a_storm_verdict_replaces_clean_but_stays_beside_a_leak():
    from types import SimpleNamespace

    from vlite.diagnostics.targets.storm import apply_to

    wedged = {"verdict": "WEDGED", "summary": "WEDGED: /health answers 200 but ..."}
    clean = SimpleNamespace(verdict="CLEAN", summary="CLEAN: ...", notes=[])
    apply_to(clean, wedged)
    assert clean.verdict == "WEDGED" and clean.summary == wedged["summary"] and clean.storm is wedged
    leak = SimpleNamespace(verdict="LEAK", summary="LEAK: 3 blocks", notes=[])
    apply_to(leak, wedged)
    assert leak.verdict == "LEAK" and leak.summary == "LEAK: 3 blocks; after the abort storm: WEDGED: /health answers 200 but ..."
    zombie = SimpleNamespace(verdict="ZOMBIE", summary="ZOMBIE: x", notes=[])
    apply_to(zombie, {"verdict": "EMPTY-OUTPUT", "summary": "EMPTY-OUTPUT: y"})
    assert zombie.verdict == "EMPTY-OUTPUT" and zombie.notes == ["before the storm checks: ZOMBIE: x"]
    ok = SimpleNamespace(verdict="CLEAN", summary="CLEAN: ...", notes=[])
    apply_to(ok, {"verdict": None, "summary": None})
    assert ok.verdict == "CLEAN" and ok.summary == "CLEAN: ..."


def test_storm_max_tokens_fit_the_servers_context():
    from vlite.diagnostics.targets.storm import fit_max_tokens

    def client(models: dict | None) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(
            lambda req: httpx.Response(200, json=models) if models is not None else httpx.Response(404)))

    assert fit_max_tokens(client({"data": [{"id": "m", "max_model_len": 128}]}), "http://s") == 64
    assert fit_max_tokens(client({"data": [{"id": "m", "max_model_len": 4096}]}), "http://s") == 256
    assert fit_max_tokens(client({"data": [{"id": "m", "max_model_len": 40}]}), "http://s") == 16
    assert fit_max_tokens(client({"data": [{"id": "m"}]}), "http://s") == 256  # llama.cpp, SGLang: unknown
    assert fit_max_tokens(client(None), "http://s") == 256


# -- real servers --------------------------------------------------------------------------------------
@pytest.fixture
def healthy(tiny_model_dir, tmp_path):
    yield from running(ServerProcess(tiny_model_dir, tmp_path / "healthy.log", *POOL))


@pytest.fixture
def wedging(tiny_model_dir, tmp_path):
    yield from running(ServerProcess(tiny_model_dir, tmp_path / "wedging.log", *POOL,
                                     "--inject-fault", "reclaim-on-admission"))


@pytest.fixture
def emptying(tiny_model_dir, tmp_path):
    yield from running(ServerProcess(tiny_model_dir, tmp_path / "emptying.log", *POOL,
                                     "--inject-fault", "empty-output-after-abort"))


def test_a_healthy_server_passes_both_checks(healthy):
    s = storm_check(healthy.base_url, storm_requests=16)
    assert s["verdict"] is None, s
    assert s["storm"]["sent"] == 16 and s["storm"]["streamed"] >= 1
    assert s["wedge"]["completed"] and s["wedge"]["bound_s"] >= 5.0
    assert s["canary_after"]["completion_tokens"] == 16
    assert s["canary_after"]["text"] == s["before"]["canary"][-1]["text"]


def test_cli_reports_wedged_after_the_storm(wedging, tmp_path):
    res = subprocess.run([VLITE, "leak-check", "--url", wedging.base_url, "--blackbox", "--num-requests", "6",
                          "--abort-rate", "0", "--zombie-max-tokens", "0", "--storm-requests", "16",
                          "--drain-timeout", "10", "--report", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "verdict: WEDGED: /health answers 200 but a plain request did not complete within 5 s" in out, out
    assert "storm check: abort storm: 16 streamed requests sent at once" in out
    assert "After the abort storm" in (tmp_path / "r" / "report.md").read_text()
    # the server still answers /health: wedged, not dead
    assert httpx.get(wedging.base_url + "/health", timeout=5).status_code == 200


def test_blackbox_target_reports_empty_output_after_the_storm(emptying):
    from vlite.diagnostics.targets.base import TargetPlan
    from vlite.diagnostics.targets.blackbox import BlackboxTarget
    from vlite.diagnostics.targets.connection import connect
    from vlite.diagnostics.workload.sources import synthetic_workload

    specs = synthetic_workload(4, input_len=(8, 16), output_len=(4, 8), seed=3, prefix="eo")
    target = BlackboxTarget(connect(emptying.base_url), drain_timeout_s=10, bisect_budget_s=0, storm_requests=16)
    run = target.run(TargetPlan(specs=specs, max_concurrency=2, idle_every=2))
    assert run.verdict == "EMPTY-OUTPUT" and run.exit_code == 1, run.summary
    after = run.result.storm["canary_after"]
    assert after["status"] == 200 and after["completion_tokens"] == 0 and after["text"] == ""


def test_vlite_serve_target_reports_empty_output_after_the_storm(emptying):
    """``--url`` against vlite serve (the ledger target, not the black box) runs the storm checks too."""
    from vlite.diagnostics.targets.base import TargetPlan
    from vlite.diagnostics.targets.http import HttpTarget
    from vlite.diagnostics.workload.sources import synthetic_workload

    specs = synthetic_workload(4, input_len=(8, 16), output_len=(4, 8), seed=5, prefix="eh")
    run = HttpTarget(emptying.base_url, storm_requests=16).run(TargetPlan(specs=specs, max_concurrency=2, idle_every=2))
    assert run.verdict == "EMPTY-OUTPUT" and run.exit_code == 1, run.summary
    assert run.summary.startswith("EMPTY-OUTPUT: the greedy canary returned HTTP 200 with zero tokens")
    assert run.result.findings.storm["wedge"]["completed"]


def test_storm_options_need_url():
    from typer.testing import CliRunner

    from vlite.cli.main import app

    res = CliRunner().invoke(app, ["leak-check", "--storm-requests", "8"])
    assert res.exit_code == 2 and "--storm-requests and --wedge-timeout-s apply to a server's replay" in res.output
    res = CliRunner().invoke(app, ["leak-check", "--from-log", "x.log", "--wedge-timeout-s", "3"])
    assert res.exit_code == 2 and "add --url" in res.output


def test_a_run_that_never_drains_is_probed_at_once(tmp_path):
    """A fake vLLM whose gauges show work forever and which answers the 5 requests before the
    waves (3 probe runs, 2 canaries) but holds every later one 6 s, /health still 200: the run
    never drains (INCONCLUSIVE), so the wedge probe runs at once, no storm sent, and finds it WEDGED."""
    import json
    import threading

    from fake_http import QuietHandler, ServerPool

    from vlite.diagnostics.targets.base import TargetPlan
    from vlite.diagnostics.targets.blackbox import BlackboxTarget
    from vlite.diagnostics.targets.connection import connect
    from vlite.diagnostics.workload.sources import synthetic_workload

    busy = (Path(__file__).parent / "fixtures" / "vllm-0.32.0-cpu-busy.prom").read_text()
    posts = {"n": 0}
    lock = threading.Lock()

    class Stuck(QuietHandler):
        def do_GET(self):  # noqa: N802 - http.server's spelling
            self.reply(200, busy if self.path == "/metrics" else (b"" if self.path == "/health" else b"{}"))

        def do_POST(self):  # noqa: N802
            with lock:
                posts["n"] += 1
                n = posts["n"]
            if n > 5:
                threading.Event().wait(6.0)
            self.reply(200, json.dumps({"choices": [{"text": " one, two", "finish_reason": "length"}],
                                        "usage": {"completion_tokens": 4}}), "application/json")

    pool = ServerPool()
    try:
        url = pool.start(Stuck)
        specs = synthetic_workload(2, input_len=(4, 8), output_len=(2, 4), seed=1, prefix="st")
        target = BlackboxTarget(connect(url), drain_timeout_s=1, bisect_budget_s=0, storm_requests=16,
                                wedge_timeout_s=2.0)
        lines: list[str] = []
        run = target.run(TargetPlan(specs=specs, max_concurrency=2, idle_every=2, on_line=lines.append))
    finally:
        pool.close()
    assert run.verdict == "WEDGED", run.summary
    assert run.result.storm["storm"] is None and run.result.storm["wedge"]["bound_s"] == 2.0
    assert any("stopped draining after the waves' client aborts" in line for line in lines)
    assert any(n.startswith("before the storm checks: INCONCLUSIVE") for n in run.notes)
