"""Zombie requests found from outside: a `vlite serve` with planted zombies in three windows
(tests/diagnostics/zombie_serve.py: a streaming client that disconnects before the first token, a
client that leaves while its request is admitted, a multi-prompt request refused for one prompt)
is ZOMBIE, each named by its client action and request id, with a reproducer; the unpatched
server is CLEAN. Only /metrics is read. 127.0.0.1 only, bounded waits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import serve_harness
from report_words import assert_no_none
from serve_harness import ServerProcess, running

from vlite.diagnostics.targets.connection import connect
from vlite.diagnostics.targets.zombie_blackbox import (
    _measure,
    _Scrape,
    judge,
    lines,
    reproducer,
    rule,
    zombie_check_blackbox,
    zombie_summary,
)

ZOMBIE_SERVE = str(Path(__file__).with_name("zombie_serve.py"))


@pytest.fixture(scope="module")
def zombie_server(tiny_model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve_harness, "VLITE", [sys.executable, ZOMBIE_SERVE])
        srv = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("zombie") / "zombie.log", "--num-blocks", "128",
                            env={"VLITE_TEST_PLANT_ZOMBIE": "first-token,admission,refused"})
    yield from running(srv)


@pytest.fixture
def clean_server(tiny_model_dir, tmp_path):
    srv = ServerProcess(tiny_model_dir, tmp_path / "clean.log", "--num-blocks", "128")
    yield from running(srv)


ALL_KINDS = {"abort-waiting", "abort-prefill", "disconnect-stream", "client-timeout", "refused"}


def test_planted_zombies_in_every_window_are_found_from_outside(zombie_server):
    conn = connect(zombie_server.base_url)
    z = zombie_check_blackbox(conn, max_tokens=400, drain_timeout_s=60)
    by_kind = {a["kind"]: a for a in z["actions"]}
    assert set(by_kind) == ALL_KINDS, z["requests"]
    # each planted window: the request decoded on to max_tokens after its client left (or after
    # its client was refused), and the server never counted an abort
    for kind in ("abort-waiting", "abort-prefill", "refused"):
        a = by_kind[kind]
        assert a["zombies"] == 1 and a["tokens_after_leaving"] > 200, (kind, z["requests"])
        assert a["steps_after_leaving"] == a["tokens_after_leaving"] and not a["steps_estimated"]
        assert a["request_id"].startswith(f"vlite-zombie-{kind}-")
    assert by_kind["abort-prefill"]["aborts_counted"] == 0 and by_kind["abort-waiting"]["aborts_counted"] == 0
    assert by_kind["refused"]["aborts_counted"] is None  # a refusal is not the client's abort
    # the other client actions are aborted as usual: only the planted paths are zombies
    assert by_kind["disconnect-stream"]["zombies"] == 0 and by_kind["client-timeout"]["zombies"] == 0, (z["actions"], z["reference"])
    assert by_kind["disconnect-stream"]["aborts_counted"] == 1
    assert sorted(a["kind"] for a in z["zombies"]) == ["abort-prefill", "abort-waiting", "refused"]
    assert z["client_aborts"] == 4 and z["server_aborts"] == 2
    refused = next(r for r in z["requests"] if r["kind"] == "refused")
    assert refused["answer"].startswith("HTTP 400"), refused
    summary = zombie_summary(z)
    worst = max(z["zombies"], key=lambda a: a["tokens_after_leaving"])
    assert summary.startswith(f"ZOMBIE: {worst['client_action']}: request {worst['request_id']}: after the client "
                              f"left the server generated {worst['tokens_after_leaving']} tokens"), summary
    assert f", {worst['steps_after_leaving']} steps (max_tokens 400)" in summary
    assert "also: " in summary
    reproducers = {a["kind"]: a["reproducer"] for a in z["zombies"]}
    assert "httpx.stream('POST'" in reproducers["abort-prefill"]
    assert "read=0.01" in reproducers["abort-waiting"] and '"prompt": ["' in reproducers["refused"]
    assert all(zombie_server.base_url in r for r in reproducers.values())
    assert "planted zombie" in zombie_server.log()
    text = "\n".join(lines(z))
    assert f"ZOMBIE: refused (HTTP 400) for one prompt of two: 1 request(s) of max_tokens 400 ({refused['request_id']})" in text


def test_unpatched_server_is_clean(clean_server):
    z = zombie_check_blackbox(connect(clean_server.base_url), max_tokens=400, drain_timeout_s=60)
    assert {a["kind"] for a in z["actions"]} == ALL_KINDS and z["zombies"] == [], z["requests"]
    assert z["threshold_tokens"] == 100 and all(a["tokens_after_leaving"] <= 100 for a in z["actions"]), z["actions"]
    by_kind = {a["kind"]: a for a in z["actions"]}
    # every abort of an admitted request counted; a client that left during admission may have
    # been cancelled before the engine saw its request: nothing to abort, nothing counted
    assert [by_kind[k]["aborts_counted"] for k in ("abort-prefill", "disconnect-stream", "client-timeout")] == [1, 1, 1]
    assert by_kind["abort-waiting"]["aborts_counted"] in (0, 1) and by_kind["refused"]["aborts_counted"] is None
    assert z["client_aborts"] == 4 and z["server_aborts"] in (3, 4)
    assert zombie_summary(z) is None
    # the server's pace, from the reference request's chunks, scales the running bound
    assert z["itl_p99_s"] > 0 and z["running_bound_s"] >= max(1.0, 3 * z["itl_p99_s"])
    text = "\n".join(lines(z))
    assert "--zombie-threshold-s" in text and "p99 inter-token latency" in text
    assert_no_none(text)


def test_measure_reads_tokens_time_and_abort_counter_from_scrapes():
    before = _Scrape(0.0, 0, 0, 100.0, 5.0)
    rows = [_Scrape(0.9, 1, 0, 104.0, 5.0), _Scrape(1.1, 1, 0, 110.0, 5.0), _Scrape(1.5, 1, 0, 150.0, 5.0),
            _Scrape(2.0, 0, 0, 160.0, 5.0), _Scrape(2.5, 0, 0, 160.0, 5.0)]
    m = _measure(rows, before, left=1.0)
    assert m == {"running_s": 1.0, "generating_s": 1.0, "tokens_after_leaving": 50, "abort_counted": 0}
    # a server with no counters: only the running gauge
    bare = [_Scrape(t, r, 0, None, None) for t, r in ((1.2, 1), (1.4, 0))]
    assert _measure(bare, _Scrape(0, 0, 0, None, None), 1.0) == {
        "running_s": 0.4, "generating_s": 0.0, "tokens_after_leaving": None, "abort_counted": None}


def test_reproducers_name_the_client_action():
    r = reproducer("disconnect-stream", "http://h:1", 300)
    assert "| head -n 4" in r and '"max_tokens": 300' in r and "/metrics" in r
    assert "--max-time 1.0" in reproducer("client-timeout", "http://h:1", 300)
    with pytest.raises(ValueError, match="unknown zombie client action"):
        zombie_check_blackbox(None, kinds=("nope",))


def test_cli_blackbox_says_zombie_with_the_reproducer_in_the_report(zombie_server, tmp_path):
    import json
    import subprocess

    vlite = str(Path(sys.executable).with_name("vlite"))
    p = subprocess.run([vlite, "leak-check", "--url", zombie_server.base_url, "--blackbox", "--workload", "synthetic",
                        "--num-requests", "8", "--abort-rate", "0", "--idle-every", "4", "--drain-timeout", "30",
                        "--zombie-max-tokens", "400", "--report", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "verdict: ZOMBIE: " in p.stdout, p.stdout
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["verdict"] == "ZOMBIE"
    assert sorted(a["kind"] for a in rep["zombies"]["zombies"]) == ["abort-prefill", "abort-waiting", "refused"]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Zombie requests" in md and "Reproducer (disconnect before the first token)" in md
    assert "Reproducer (refused (HTTP 400) for one prompt of two)" in md
    print(p.stdout)


def test_judge_tokens_running_time_and_a_stale_gauge():
    m = {"tokens_after_leaving": 359, "running_s": 0.6}
    assert judge(m, 10.0, None, 16, 1.0) == (False, True)  # vlite's planted zombie: tokens
    # vLLM 0.32 with aborts dropped: its token counter misses the zombie's tokens; the running gauge does not
    assert judge({"tokens_after_leaving": 1, "running_s": 9.1}, 10.0, 13.2, 16, 1.0) == (False, True)
    # a stale gauge: it read 0 right after the 1-token probe (at 13.2 s) made the engine step
    assert judge({"tokens_after_leaving": 1, "running_s": 3.4}, 10.0, 13.2, 16, 1.0) == (True, False)
    assert judge({"tokens_after_leaving": 0, "running_s": 0.09}, 10.0, None, 16, 1.0) == (False, False)
    assert judge({"tokens_after_leaving": 0, "running_s": None}, 10.0, 13.0, 16, 1.0) == (False, True)  # stuck
    assert judge({"tokens_after_leaving": None, "running_s": 2.0}, 10.0, None, 16, 1.0) == (False, True)


def test_the_running_bound_is_named_with_the_measured_pace_and_no_none():
    z = {"threshold_tokens": 128, "threshold_s": 1.0, "threshold_steps": 2, "itl_p99_s": 0.75,
         "running_bound_s": 60.0, "reference": {"ttft_s": 0.8, "full_s": 120.0}, "max_tokens": 512,
         "actions": [{"client_action": "disconnect mid-stream", "requests": 1, "zombies": 0,
                      "tokens_after_leaving": None, "generating_s": 0.0, "running_s": 1.9, "still_running": False,
                      "aborts_counted": None}], "server_aborts": None, "notes": []}
    assert rule(z) == ("a request is a ZOMBIE when the server generated more than 128 tokens after its client left "
                       "(a quarter of max_tokens, --zombie-max-tokens), or kept it running more than 60 s = "
                       "max(--zombie-threshold-s 1 s, 3 x the p99 inter-token latency 0.75 s, half a complete "
                       "request's 120 s)")
    text = "\n".join(lines(z))
    assert "tokens generated: not counted by this server" in text
    assert_no_none(text)


def test_steps_after_leaving_are_the_tokens_counted_else_estimated_from_the_pace():
    from vlite.diagnostics.targets.zombie_blackbox import steps_after_leaving

    # one request alone on the server: one token per decode step
    assert steps_after_leaving({"tokens_after_leaving": 359, "running_s": 0.6}, 0.002, 60) == {
        "steps_after_leaving": 359, "steps_estimated": False}
    # vLLM does not count the tokens of a request its API server dropped: running time over the pace
    assert steps_after_leaving({"tokens_after_leaving": 1, "running_s": 9.0}, 0.03, 60) == {
        "steps_after_leaving": 300, "steps_estimated": True}
    # still running when the check gave up: at least the drain timeout's worth
    assert steps_after_leaving({"tokens_after_leaving": None, "running_s": None}, 0.5, 60)["steps_after_leaving"] == 120
    # never more than max_tokens: vLLM's running gauge, refreshed only when the engine steps, reads late
    # (measured: 17.4 s at a 57.6 ms median ITL for a request of max_tokens 256)
    assert steps_after_leaving({"tokens_after_leaving": 1, "running_s": 17.407}, 0.0576, 120, 256)[
        "steps_after_leaving"] == 256
    assert steps_after_leaving({"tokens_after_leaving": 0, "running_s": 2.0}, None, 60) == {
        "steps_after_leaving": None, "steps_estimated": None}
