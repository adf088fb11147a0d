"""The HTTP target against a real `vlite serve` subprocess (127.0.0.1 only, a free port, bounded waits):
clients that really disconnect mid-stream leak blocks under the planted fault, and only theirs."""

from __future__ import annotations

import pytest
from report_words import assert_no_none, run_result_text

from vlite.diagnostics.targets.http import run_http
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.sources import synthetic_workload, with_action


@pytest.fixture
def serve(vlite_serve):
    return lambda *extra: vlite_serve("--enable-debug-endpoints", *extra)


def _workload():
    # 48-64 output tokens: a disconnect after 2 chunks must land while the request still runs (with
    # 12-16 the tiny model could finish a request before the server saw its client go, and the
    # request then ends "finished", not "aborted": a fresh clone's run did that once)
    specs = synthetic_workload(8, input_len=(8, 24), output_len=(48, 64), seed=5, prefix="http")
    return [with_action(s, ClientAction("disconnect-stream", after_tokens=2)) if i % 2 else s
            for i, s in enumerate(specs)]


def test_http_target_finds_a_planted_disconnect_leak(serve):
    url = serve("--inject-fault", "skip-free-on-abort")
    specs = _workload()
    run = run_http(url, specs, max_concurrency=8, idle_every=4, sample_interval_s=0.05)
    f = run.findings
    disconnected = {s.request_id for s in specs if s.action.is_abort}
    assert f.leak and f.drain.sign == "deficit", f.summary()
    assert {b["request_id"] for b in f.leaked_blocks} == disconnected
    assert all(b["client_action"] == "disconnect after 2 chunks" for b in f.leaked_blocks)
    assert {g["action_kind"] for g in f.by_action} == {"disconnect-stream"}
    outcomes = {r.request_id: r.outcome for r in run.replay.requests}
    assert all(outcomes[s.request_id] == ("aborted" if s.request_id in disconnected else "finished") for s in specs)
    assert run.info["debug_endpoints"] and not run.samples.empty
    assert_no_none(run_result_text(run))


def test_http_target_clean_server_is_clean(serve):
    url = serve()
    run = run_http(url, _workload(), max_concurrency=8, idle_every=4, sample_interval_s=0.05)
    assert not run.findings.leak, run.findings.summary()
    assert run.findings.drain.mismatch_blocks == 0
    assert_no_none(run_result_text(run))


def test_http_all_paths_workload_is_clean_with_coverage_registries_and_zombie_timing(serve):
    # Every kind of request over HTTP (shared prefixes, n > 1, beam search, chat, calibrated stop
    # tokens and strings), a third of them aborted: CLEAN, and the report says what ran.
    from vlite.diagnostics.workload.all_paths import all_paths_workload

    url = serve()
    specs = all_paths_workload(14, input_len=(8, 24), output_len=(8, 14), abort_rate=0.4, seed=1, in_process=False)
    assert not any(s.action.kind in ("abort-preempted", "abort-resumed") for s in specs)
    run = run_http(url, specs, max_concurrency=8, idle_every=7, sample_interval_s=0.05)
    f = run.findings
    assert not f.leak and f.verdict == "CLEAN", (f.summary(), (f.zombies or {}).get("zombies"))
    cov = f.coverage
    assert cov["forks"] > 0 and cov["beam_prunes"] > 0 and cov["prefix_hit_tokens"] > 0
    assert cov["finish_reasons"].get("stop:stop_string", 0) + cov["finish_reasons"].get("stop:stop_token", 0) > 0
    assert "fork" not in cov["not_exercised"] and "EOS finish" in cov["not_exercised"]  # a random model
    assert {"async.live", "server.metrics_last_token", "scheduler.requests"} <= set(f.registries["checked"])
    assert f.registries["leftover"] == [] and f.unattributed == []
    aborted = [r for r in run.replay.requests if r.outcome == "aborted"]
    assert aborted and f.zombies["distribution"]["n"] >= 1 and f.zombies["zombies"] == []
    # judged in the server's engine steps (its step counter sampled at the disconnect), and the
    # report names no check that did not run and prints no None
    assert f.zombies["step_source"] == "sampled" and f.zombies["distribution"]["max_steps"] is not None
    text = run_result_text(run)
    assert_no_none(text)
    # a server on this host: its processes' anonymous memory, each by role
    assert "host-memory check" in text and set(run.info["processes"]) >= {"api_server", "engine_core"}
    assert set(f.host_memory["kind_growth"]["processes"]) == set(run.info["processes"])
