"""The in-process leak check's request-id census: a per-request map nobody registered is a
LEAK, named by its path and the requests (and client actions) it holds; a clean run is CLEAN."""

from __future__ import annotations

import types

from conftest import make_engine

from vlite.diagnostics.targets.inprocess import run_in_process
from vlite.diagnostics.workload.sources import synthetic_workload


def _specs():
    return synthetic_workload(10, input_len=(8, 30), output_len=(4, 10), abort_rate=0.4, abort_mode="mix", seed=5)


def _plant_holdback(engine):
    """Plant: the output processor keeps each finished request's last output in a map of its own
    (like a stop-string hold-back kept after the finish), never removed and never registered."""
    processor = engine.output_processor
    processor.holdback_by_request = {}
    original = processor.make_output

    def make_output(self, req):
        out = original(req)
        if out.finished:
            self.holdback_by_request[req.request_id] = out
        return out

    processor.make_output = types.MethodType(make_output, processor)


def test_an_unregistered_map_of_finished_requests_is_a_leak_named_by_its_path(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=128)
    _plant_holdback(engine)
    specs = _specs()
    run = run_in_process(engine, specs, max_concurrency=8, sample_interval_s=0.05)
    f = run.findings
    assert f.drain.ok and not f.leaked_blocks  # blocks are fine: only the census sees this
    assert f.leak and f.verdict == "LEAK"
    held = {h["path"]: h for h in f.census["held"]}
    assert set(held) == {"engine.output_processor.holdback_by_request"}
    entry = held["engine.output_processor.holdback_by_request"]
    finished = {r.request_id for r in run.replay.requests if r.outcome == "finished"}
    assert entry["kind"] == "key+value" and set(entry["request_ids"]) == finished
    actions = {r.request_id: r.action_label for r in run.replay.requests if r.request_id in finished}
    assert entry["client_actions"] == sorted(set(actions.values()))
    assert "engine.output_processor.holdback_by_request" in f.summary()


def test_the_census_runs_on_a_clean_run_and_finds_nothing(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=128)
    run = run_in_process(engine, _specs(), max_concurrency=8, sample_interval_s=0.05)
    f = run.findings
    assert f.verdict == "CLEAN", f.summary()
    assert f.census["held"] == [] and f.census["objects_visited"] > 50 and not f.census["truncated"]
