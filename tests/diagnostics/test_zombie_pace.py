"""Zombies judged in the server's own pace: a healthy `vlite serve` whose engine
steps take longer than the old 1 s wall-clock bound stays CLEAN over --url (the abort waits for the
running step, so the blocks come back >1 s after the disconnect, but within a step); a planted
zombie under the same slowness is still ZOMBIE, counted in engine steps. 127.0.0.1, bounded waits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import serve_harness
from report_words import assert_no_none, run_result_text
from serve_harness import ServerProcess, running

from vlite.diagnostics.checks.pace import histogram_quantile, step_at
from vlite.diagnostics.checks.zombie import lines, rule, wall_clock_bound, zombie_check
from vlite.diagnostics.targets.http import run_http
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.replay import RequestResult
from vlite.diagnostics.workload.sources import synthetic_workload, with_action

ZOMBIE_SERVE = str(Path(__file__).with_name("zombie_serve.py"))
STEP_S = 1.3  # every engine step: longer than the old 1 s bound, as on a loaded 2-core machine


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir, tmp_path_factory):
    """A `vlite serve --enable-debug-endpoints` whose steps take STEP_S, with the planted zombie of
    zombie_serve.py (a client that leaves before its first token is never aborted)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(serve_harness, "VLITE", [sys.executable, ZOMBIE_SERVE])
    srv = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("slow") / "serve.log", "--num-blocks", "96",
                        "--enable-debug-endpoints", env={"VLITE_TEST_STEP_DELAY_S": str(STEP_S)})
    mp.undo()
    yield from running(srv)


def _left(rid, t, step=None):
    return RequestResult(rid, "disconnect-stream", "disconnect after 2 chunks", 0.0, outcome="aborted", abort_time=t,
                         abort_step=step)


def test_step_at_reads_the_first_sample_at_or_after_the_disconnect():
    timeline = [(9.9, 100), (10.05, 100), (10.8, 101), (11.9, 102)]
    assert step_at(timeline, 10.0) == 100 and step_at(timeline, 10.05) == 100 and step_at(timeline, 10.1) == 101
    assert step_at(timeline, 12.0) is None and step_at([], 1.0) is None


def test_a_release_one_slow_step_after_the_disconnect_is_clean_in_steps():
    # the client left at 10.0 s, during step 101; the abort landed when that 1.6 s step ended
    hist = {"slow": {"finished": True, "finished_time": 11.6, "finished_step": 101, "released_time": 11.6,
                     "released_step": 101, "num_output_tokens": 3},
            "zombie": {"finished": True, "finished_time": 40.0, "finished_step": 120, "released_time": 40.0,
                       "released_step": 120, "num_output_tokens": 24}}
    timeline = [(9.9, 100), (10.05, 100), (10.8, 101), (11.9, 102)]
    z = zombie_check([_left("slow", 10.0), _left("zombie", 10.0)], hist, step_timeline=timeline)
    rows = {r["request_id"]: r for r in z["requests"]}
    assert rows["slow"]["outlived_s"] == 1.6 and rows["slow"]["outlived_steps"] == 1 and not rows["slow"]["zombie"]
    assert rows["zombie"]["outlived_steps"] == 20 and [r["request_id"] for r in z["zombies"]] == ["zombie"]
    assert z["step_source"] == "sampled"
    # a fast engine: 9 steps ran before the HTTP layer noticed the disconnect, 0.3 s: no zombie
    fast = {"finished": True, "finished_time": 10.3, "finished_step": 109, "released_time": 10.3,
            "released_step": 109, "num_output_tokens": 12}
    assert zombie_check([_left("fast", 10.0)], {"fast": fast}, step_timeline=timeline)["zombies"] == []
    text = "\n".join(lines(z))
    assert "--zombie-threshold-steps" in text and "more than 2 engine steps" in text and "at least" in text
    assert "ZOMBIE zombie (disconnect after 2 chunks): outlived its client by 30.0 s, 20 engine steps" in text
    assert_no_none(text)


def test_where_no_step_is_known_the_wall_clock_bound_scales_with_the_measured_itl():
    assert wall_clock_bound(1.0, 2, None) == 1.0 and wall_clock_bound(1.0, 2, 0.1) == 1.0
    assert wall_clock_bound(1.0, 2, 0.75) == pytest.approx(2.25)
    hist = {"a": {"finished": True, "finished_time": 12.0, "released_time": 12.0, "num_output_tokens": 3}}
    assert zombie_check([_left("a", 10.0)], hist)["zombies"]  # 2 s > 1 s with no pace measured
    z = zombie_check([_left("a", 10.0)], hist, step_time_s=0.75)  # 2 s < 3 steps of 0.75 s
    assert z["zombies"] == [] and z["bound_s"] == 2.25
    text = "\n".join(lines(z))
    assert "2.25 s = max(--zombie-threshold-s 1 s, 3 x the p99 inter-token latency 0.75 s)" in text, text
    assert "no engine step known" in text
    # the running gauge in steps, where the server counts them: 1 step of 3 s is no zombie
    assert zombie_check([], {}, gauge_lag_s=3.0, gauge_lag_steps=1)["zombies"] == []
    assert zombie_check([], {}, gauge_lag_s=3.0, gauge_lag_steps=9)["zombies"][0]["outlived_steps"] == 9
    assert zombie_check([], {}, gauge_lag_s=0.4, gauge_lag_steps=9)["zombies"] == []


def test_over_http_the_time_to_notice_a_disconnect_scales_with_the_servers_pace():
    """A loaded server released a request cut in prefill 3 steps and 1.2 s after the disconnect,
    with a p99 inter-token latency of 0.75 s: its event loop noticed the disconnect as slowly as
    it ran steps. Within max(1 s, 3 x 0.75 s) that is no zombie; the same 1.2 s on a fast server
    (no pace measured, or a fast one) is."""
    hist = {"a": {"finished": True, "finished_time": 11.2, "finished_step": 103, "released_time": 11.2,
                  "released_step": 103, "num_output_tokens": 3}}
    timeline = [(9.9, 100), (10.05, 100), (11.5, 104)]
    left = [_left("a", 10.0)]
    assert zombie_check(left, hist, step_timeline=timeline, step_time_s=0.75)["zombies"] == []
    assert zombie_check(left, hist, step_timeline=timeline)["zombies"]
    assert zombie_check(left, hist, step_timeline=timeline, step_time_s=0.05)["zombies"]
    text = rule(zombie_check(left, hist, step_timeline=timeline, step_time_s=0.75))
    assert ("more than 2 engine steps (--zombie-threshold-steps) after the step the client left in and by more than "
            "2.25 s = max(--zombie-threshold-s 1 s, 3 x the p99 inter-token latency 0.75 s) (the server noticing the "
            "disconnect)") in text, text


def test_histogram_quantile_of_the_run_is_the_bucket_bound_holding_it():
    before = {0.1: 5.0, 0.5: 5.0, 1.0: 5.0, float("inf"): 5.0}
    after = {0.1: 95.0, 0.5: 104.0, 1.0: 105.0, float("inf"): 105.0}
    assert histogram_quantile(before, after, 0.99) == 0.5 and histogram_quantile(before, after, 0.5) == 0.1
    assert histogram_quantile(after, after, 0.99) is None


def test_zombie_lines_say_what_was_not_measured_without_none():
    assert lines(zombie_check([], {})) == [
        "zombie requests: no client left early in this run: nothing to measure (--abort-rate)"]
    text = "\n".join(lines(zombie_check([_left("x", 1.0)], {})))
    assert "1 request whose client left, none measurable" in text
    assert_no_none(text)


def _specs(kind: str, n: int, out: int, prefix: str):
    specs = synthetic_workload(n, input_len=(8, 16), output_len=(out, out), seed=3, prefix=prefix)
    action = ClientAction("disconnect-stream", after_tokens=2) if kind == "disconnect-stream" else ClientAction(kind)
    return [with_action(s, action) if i % 2 else s for i, s in enumerate(specs)]


def test_slow_healthy_server_is_clean_and_a_planted_zombie_is_still_zombie(slow_server):
    # healthy path: mid-stream disconnects, released when the running 1.3 s step ends
    run = run_http(slow_server.base_url, _specs("disconnect-stream", 4, 6, "pace"), max_concurrency=4,
                   sample_interval_s=0.1)
    f, z = run.findings, run.findings.zombies
    rows = z["requests"]
    assert len(rows) == 2 and z["step_source"] == "sampled", z
    # the old 1 s wall-clock bound would have called these zombies
    assert max(r["outlived_s"] for r in rows) > 1.0, rows
    assert all(r["outlived_steps"] <= 2 for r in rows) and z["zombies"] == [], rows
    assert f.verdict == "CLEAN", f.summary()
    assert_no_none(run_result_text(run))
    # the planted zombie: the client left before the first token and the request decoded on to
    # max_tokens (12 steps of 1.3 s): ZOMBIE, counted in engine steps
    run = run_http(slow_server.base_url, _specs("abort-prefill", 2, 12, "paz"), max_concurrency=2,
                   sample_interval_s=0.1)
    f, z = run.findings, run.findings.zombies
    assert f.verdict == "ZOMBIE", f.summary()
    assert [r["request_id"] for r in z["zombies"]] == ["paz-00001"], z["requests"]
    assert z["zombies"][0]["outlived_steps"] > 6, z["zombies"]
    text = run_result_text(run)
    assert "--zombie-threshold-steps" in text and "ZOMBIE paz-00001" in text
    assert_no_none(text)
    assert "planted zombie" in slow_server.log()
