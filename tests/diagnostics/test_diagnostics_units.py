"""Units of the leak checker: workload sources, client actions, the drain invariant, the trend."""

from __future__ import annotations

import json
import random

import pytest

from vlite.diagnostics.checks.detect import drain_check, trough_trend
from vlite.diagnostics.checks.snapshot import Snapshot, from_debug_blocks
from vlite.diagnostics.workload.actions import ABORT_KINDS, ClientAction, plan_action
from vlite.diagnostics.workload.replay import IdlePoint
from vlite.diagnostics.workload.sources import WorkloadError, jsonl_workload, sharegpt_workload, synthetic_workload


def test_synthetic_workload_is_seeded_and_in_range():
    a = synthetic_workload(300, input_len=(16, 32), output_len=(8, 12), abort_rate=0.3, seed=7)
    b = synthetic_workload(300, input_len=(16, 32), output_len=(8, 12), abort_rate=0.3, seed=7)
    assert a == b
    assert all(16 <= s.prompt_len <= 32 and 8 <= s.max_tokens <= 12 for s in a)
    aborted = [s for s in a if s.action.is_abort]
    assert 0.2 < len(aborted) / len(a) < 0.4
    assert {s.action.kind for s in aborted} == set(ABORT_KINDS)  # "mix" draws every kind
    assert all(s.arrival_s == 0.0 for s in a)  # infinite rate: all at once


def test_poisson_arrivals_increase_at_the_given_rate():
    specs = synthetic_workload(400, request_rate=20.0, seed=1)
    times = [s.arrival_s for s in specs]
    assert times == sorted(times) and times[0] == 0.0
    assert 15.0 < len(times) / times[-1] < 25.0


def test_abort_mode_single_kind_and_k_below_max_tokens():
    rng = random.Random(0)
    actions = [plan_action(rng, 1.0, "disconnect-stream", 5) for _ in range(50)]
    assert all(a.kind == "disconnect-stream" and 1 <= a.after_tokens <= 4 for a in actions)
    assert actions[0].label == f"disconnect after {actions[0].after_tokens} chunks"
    with pytest.raises(ValueError):
        plan_action(rng, 0.5, "explode", 5)
    with pytest.raises(ValueError):
        plan_action(rng, 1.5, "mix", 5)


def test_client_action_parse():
    assert ClientAction.parse("client-timeout:0.25") == ClientAction("client-timeout", timeout_s=0.25)
    assert ClientAction.parse("abort-after-tokens:3").label == "abort after 3 tokens"
    assert not ClientAction.parse("client-timeout:1").streams
    with pytest.raises(ValueError):
        ClientAction.parse("complete:3")


def test_jsonl_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"arrival_s": 0.5, "prompt": "hello there", "max_tokens": 4, "client_action": "disconnect-stream:2"},
        {"arrival_s": 0.0, "prompt_len": 12, "max_tokens": 8, "stream": False, "client_action": "client-timeout:0.3",
         "request_id": "mine"},
    ]) + "\n")
    specs = jsonl_workload(path)
    assert [s.request_id for s in specs] == ["mine", "lc-00000"]  # sorted by arrival
    assert specs[0].prompt_len == 12 and not specs[0].stream and specs[0].action.timeout_s == 0.3
    assert specs[1].prompt == "hello there" and specs[1].action.after_tokens == 2


@pytest.mark.parametrize("line,msg", [('{"max_tokens": 3}', "prompt"), ("not json", "trace.jsonl, line 1"),
                                      ('{"prompt": "x", "stream": true, "client_action": "client-timeout"}',
                                       "contradicts")])
def test_jsonl_trace_errors_name_the_line(tmp_path, line, msg):
    path = tmp_path / "trace.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=msg):
        jsonl_workload(path)


def test_sharegpt_first_turn_is_prompt_second_is_output_length(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "one two three"},
                                      {"from": "gpt", "value": "w " * 10}]},
        {"id": "b", "conversations": [{"from": "human", "value": "only one turn"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "x y"}, {"from": "gpt", "value": "w " * 500}]},
    ]))
    specs = sharegpt_workload(path, 10, count_tokens=lambda t: len(t.split()), max_output_len=64)
    assert [(s.prompt, s.prompt_len, s.max_tokens) for s in specs] == [("one two three", 3, 10), ("x y", 2, 64)]


def _snap(free, cached, total, ref_counts=None, anomalies=()):
    return Snapshot(total, free, total - free - cached, cached, ref_counts=ref_counts, anomalies=list(anomalies))


def test_drain_invariant_sign():
    assert drain_check(_snap(10, 6, 16)).sign == "balanced"
    deficit = drain_check(_snap(10, 3, 16))
    assert (deficit.sign, deficit.deficit_blocks, deficit.mismatch_blocks) == ("deficit", 3, -3)
    excess = drain_check(_snap(16, 0, 16, ref_counts=[0] * 15 + [-1], anomalies=[{"kind": "double free"}]))
    assert (excess.sign, excess.excess_frees, excess.negative_ref_counts) == ("excess", 1, 1)
    both = drain_check(_snap(14, 0, 16, ref_counts=[-1, 0], anomalies=[{"kind": "double free"}]))
    assert both.sign == "deficit+excess"


def test_trend_slope_ci_and_r2():
    leak = [IdlePoint(0, n, 2 * n // 10, None) for n in range(0, 100, 10)]  # 0.2 blocks/request
    t = trough_trend(leak)
    assert t.slope == pytest.approx(0.2) and t.r2 == pytest.approx(1.0) and t.rising
    noisy = [IdlePoint(0, n, 5 + (n // 10) % 2, None) for n in range(0, 100, 10)]  # a sawtooth at baseline
    t = trough_trend(noisy)
    assert t.ci95[0] < 0 < t.ci95[1] and not t.rising
    assert trough_trend(leak[:2]).slope is None  # too few points for a fit


def test_debug_blocks_snapshot():
    data = {"num_total_blocks": 8, "num_free_blocks": 5, "num_used_blocks": 2, "num_cached_blocks": 1,
            "sequences": [{"seq_id": 3, "request_id": "r", "status": "finished", "block_table": [1, 2],
                           "origin": {"request_id": "r", "client_action": "disconnect after 2 chunks"}}],
            "ledger": [{"block_id": 1, "seq_id": 3, "request_id": "r", "site": "prefill", "step": 2, "age_s": 0.51234,
                        "origin": {"request_id": "r", "client_action": "disconnect after 2 chunks"},
                        "status": "finished", "finish_reason": "abort"}],
            "anomalies": [], "live_state": {"live_request_ids": [], "orphan_block_tables": [3]}}
    snap = from_debug_blocks(data)
    assert snap.ledger[0]["client_action"] == "disconnect after 2 chunks" and snap.ledger[0]["age_s"] == 0.512
    assert snap.owners[3]["request_id"] == "r" and snap.block_tables == {3: [1, 2]}
    assert drain_check(snap).deficit_blocks == 2
    assert snap.ref_counts is None  # an older server without ref_counts
    snap = from_debug_blocks(dict(data, ref_counts={"1": 1, "2": 1, "6": -1}))  # block 6 freed twice
    assert snap.ref_counts == [0, 1, 1, 0, 0, 0, -1, 0]
    check = drain_check(snap)
    assert check.negative_ref_counts == 1 and check.sign == "deficit+excess"


def test_labelled_values_keys_vlite_series_by_name_and_finish_reason():
    from vlite.diagnostics.readers.metrics_text import labelled_values

    text = ('vlite:num_free_blocks{model_name="m"} 12.0\n'
            'vlite:request_success_total{finished_reason="stop",model_name="m"} 3.0\n'
            'vlite:request_success_total{finished_reason="abort",model_name="m"} 1.0\n'
            'other:series{model_name="m"} 5.0\n')
    assert labelled_values(text) == {"vlite:num_free_blocks": 12.0, "vlite:request_success_total{stop}": 3.0,
                                     "vlite:request_success_total{abort}": 1.0}


def test_the_sampler_takes_no_sample_while_paused():
    # A scrape is work for the server: a probe inside it waiting for an idle moment needs none.
    import threading
    import time

    from vlite.diagnostics.readers.samplers import Sampler
    from vlite.diagnostics.targets.connection import NullProbe

    calls = []
    tick = threading.Event()

    def source():
        calls.append(time.monotonic())
        tick.set()
        return {}

    sampler = Sampler(source, NullProbe(), interval_s=0.01).start()
    try:
        assert tick.wait(5)
        with sampler.paused():
            time.sleep(0.05)  # a sample already under way may finish
            n = len(calls)
            time.sleep(0.2)
            assert len(calls) == n
        tick.clear()
        assert tick.wait(5)  # sampling goes on after the block
    finally:
        sampler.stop()
