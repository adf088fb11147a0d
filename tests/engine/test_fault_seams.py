"""Planted faults attach at construction, through subclasses built only when asked for: the
engine's scheduler, KV cache manager and serving loop carry no fault and no test-double bend."""

from __future__ import annotations

import inspect
import re

import pytest
from conftest import make_engine
from utils import BLOCK, make_scheduler, make_seq, run_step

from vlite.engine.config import CacheConfig, SchedulerConfig
from vlite.engine.core.fault_seams import SCHEDULER_FAULTS, FaultyKVCacheManager, FaultyScheduler, scheduler_factory
from vlite.engine.core.faults import FAULTS, FaultSet
from vlite.engine.core.kv_cache_manager import KVCacheManager
from vlite.engine.core.scheduler import Scheduler
from vlite.engine.serving.engine_loop import EngineLoop

HOT_PATHS = [KVCacheManager.free, KVCacheManager._release, KVCacheManager.allocate_slots, Scheduler.finish_sequence,
             Scheduler.schedule, Scheduler.update_from_output, Scheduler._preempt, Scheduler._append_token]


@pytest.mark.parametrize("fn", HOT_PATHS, ids=lambda f: f.__qualname__)
def test_the_hot_paths_name_no_fault(fn):
    src = inspect.getsource(fn)
    assert not re.search(r"\bfault|planted", src, re.IGNORECASE), src


def test_the_plain_classes_keep_no_fault_state_and_the_loop_no_test_double_bend():
    sched = make_scheduler()
    state = set(vars(sched)) | set(vars(sched.kv_cache_manager))
    assert not {n for n in state if re.search("fault|parked|orphan", n)}
    assert "hasattr" not in inspect.getsource(EngineLoop._maybe_census)


def test_an_engine_without_faults_builds_the_plain_classes(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=16)
    assert type(engine.scheduler) is Scheduler and type(engine.scheduler.kv_cache_manager) is KVCacheManager


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_an_engine_with_a_fault_builds_that_fault_s_seam(tiny_checkpoint, fault):
    engine = make_engine(tiny_checkpoint, num_blocks=16, faults=(fault,))
    sched = engine.scheduler
    if fault in SCHEDULER_FAULTS:
        assert type(sched) is FaultyScheduler and type(sched.kv_cache_manager) is FaultyKVCacheManager
        assert sched.kv_cache_manager.faults.active(fault)
    else:  # raise-in-step plants in the model runner's step input
        assert type(sched) is Scheduler and type(sched.kv_cache_manager) is KVCacheManager
        assert engine.model_runner.faults.active(fault)


def test_a_seam_is_recorded_as_the_engine_method_it_extends():
    # both releases of a double free name the engine's free path, as the leak report shows them
    sched = scheduler_factory(FaultSet(["double-free"]))(SchedulerConfig(), CacheConfig(block_size=BLOCK), 8)
    sched.add_sequence(make_seq("a", [1] * 6))
    run_step(sched)
    sched.abort("a")
    bm = sched.kv_cache_manager
    assert [a.kind for a in bm.ledger.anomalies()] == ["double free"]
    assert {r.code_path for r in bm.ledger.released} == {"Scheduler.finish_sequence -> KVCacheManager.free"}
    assert [f.code_path for f in bm.ledger.frees] == ["Scheduler.abort -> Scheduler.finish_sequence"]
