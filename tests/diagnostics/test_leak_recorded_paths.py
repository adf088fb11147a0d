"""Leak reports name the path the engine recorded, not a guess: the finish
path a sequence took, whether its release raised or never ran, and both sites of a double free."""

from __future__ import annotations

import types

from conftest import make_engine

from vlite.diagnostics.targets.inprocess import run_in_process
from vlite.diagnostics.workload.all_paths import all_paths_workload
from vlite.diagnostics.workload.sources import synthetic_workload


def _aborting():
    return synthetic_workload(14, input_len=(8, 30), output_len=(6, 12), abort_rate=0.5, abort_mode="mix", seed=5)


def test_a_release_that_raised_is_named_with_the_recorded_finish_path_and_exception(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=128, faults=("skip-free-on-abort",))
    f = run_in_process(engine, _aborting(), max_concurrency=8, sample_interval_s=0.05).findings
    assert f.verdict == "LEAK" and f.by_request
    for row in f.by_request:
        assert row["suspected_path"].startswith("sequence finished by abort in "), row
        assert "its release raised before the blocks were freed (PlantedFault" in row["suspected_path"]


def test_a_stop_string_finish_that_skips_the_free_is_named_as_no_release_recorded(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=256)
    bm = engine.scheduler.kv_cache_manager
    free = bm.free

    def free_but_not_after_a_stop_string(self, seq):  # the defect: the free path never runs
        return 0 if isinstance(seq.stop_reason, str) else free(seq)

    bm.free = types.MethodType(free_but_not_after_a_stop_string, bm)
    specs = all_paths_workload(14, abort_rate=0.0, seed=2)
    f = run_in_process(engine, specs, max_concurrency=8, sample_interval_s=0.05).findings
    assert f.verdict == "LEAK"
    stop_string = {s.request_id for s in specs if s.stop_string_at is not None}
    rows = {r["request_id"]: r for r in f.by_request}
    assert rows and set(rows) <= stop_string
    for row in rows.values():
        assert row["suspected_path"].startswith("sequence finished by stop:stop_string; no release recorded for its"), row
        assert "(the free path never ran for it)" in row["suspected_path"]


def test_a_double_free_names_both_release_sites(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=128, faults=("double-free",))
    f = run_in_process(engine, _aborting(), max_concurrency=8, sample_interval_s=0.05).findings
    assert f.verdict == "LEAK" and f.anomalies
    sites = f.anomalies[0]["release_sites"]
    assert len(sites) == 2
    assert all(s.startswith("Scheduler.finish_sequence -> KVCacheManager.free: seq ") for s in sites)
    assert "released by Scheduler.finish_sequence -> KVCacheManager.free" in f.summary()
    assert " and again by " in f.summary()
    # the anomaly list is reported as such, not again by the census
    assert not any("_anomalies" in h["path"] for h in f.census["held"])


def test_clean_runs_record_a_finish_path_for_every_sequence(tiny_checkpoint):
    from vlite.engine import EngineView

    engine = make_engine(tiny_checkpoint, num_blocks=128)
    specs = _aborting()
    f = run_in_process(engine, specs, max_concurrency=8, sample_interval_s=0.05).findings
    assert f.verdict == "CLEAN", f.summary()
    view = EngineView(engine)
    paths = [view.request_record(fr.seq_id).finish_path for fr in view.frees()
             if view.request_record(fr.seq_id) is not None]
    assert paths and all(paths)
    assert any(p.startswith("abort in ") for p in paths) and "length" in paths
    assert all(fr.code_path.endswith("-> Scheduler.finish_sequence") or "_preempt" in fr.code_path
               for fr in view.frees()), {fr.code_path for fr in view.frees()}
