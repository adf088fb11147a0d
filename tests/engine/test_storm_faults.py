"""The planted faults of the abort-storm checks, in the scheduler alone (no model): a fake runner
output advances the sequences. ``reclaim-on-admission`` wedges once aborts park half the pool (a
single abort is reclaimed at the next admission); ``empty-output-after-abort`` ends the requests
admitted after an abort with no token."""

from __future__ import annotations

from utils import BLOCK, fake_result, make_seq

from vlite.engine.config import CacheConfig, SchedulerConfig
from vlite.engine.core.fault_seams import scheduler_factory
from vlite.engine.core.faults import FaultSet
from vlite.engine.core.scheduler import Scheduler
from vlite.engine.core.sequence import FinishReason


def _scheduler(fault: str | None, num_blocks: int = 8) -> Scheduler:
    make = scheduler_factory(FaultSet([fault] if fault else []))
    return make(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), CacheConfig(block_size=BLOCK), num_blocks)


def _step(sched: Scheduler):
    out = sched.schedule()
    sched.update_from_output(out, fake_result(out, 7))
    return out


def _run_then_abort(sched: Scheduler, names: str) -> None:
    """Admit one 8-token prompt (2 blocks; a prompt of its own, so that no prefix-cache hit
    shares a block) per name, step once, abort them all."""
    for n in names:
        sched.add_sequence(make_seq(n, [ord(n)] * 8, 64))
    _step(sched)
    for n in names:
        sched.abort(n)


def test_reclaim_on_admission_wedges_after_a_storm_but_not_after_one_abort():
    sched = _scheduler("reclaim-on-admission")
    kv = sched.kv_cache_manager
    _run_then_abort(sched, "a")  # one abort: 2 blocks parked
    assert kv.num_used_blocks == 2
    sched.add_sequence(make_seq("b", [2] * 4, 4))
    out = _step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["b"]  # admitted, and its admission reclaimed a's blocks
    sched.abort("b")
    sched.add_sequence(make_seq("c", [2] * 4, 4))
    _step(sched)
    sched.finish_sequence(sched.running[0], FinishReason.STOP)  # reclaims b
    assert kv.num_used_blocks == 0

    _run_then_abort(sched, "defg")  # the storm: 8 blocks parked, the whole pool
    sched.add_sequence(make_seq("h", [3] * 4, 4))  # needs 1 block
    for _ in range(3):
        assert not sched.schedule().scheduled  # nothing is ever admitted again: wedged
    assert [s.request_id for s in sched.waiting] == ["h"] and kv.num_used_blocks == 8


def test_without_the_fault_the_same_storm_frees_the_pool():
    sched = _scheduler(None)
    _run_then_abort(sched, "defg")
    sched.add_sequence(make_seq("h", [3] * 4, 4))
    assert [s.seq.request_id for s in sched.schedule().scheduled] == ["h"]


def test_empty_output_after_abort_ends_the_next_request_with_no_token():
    sched = _scheduler("empty-output-after-abort")
    _run_then_abort(sched, "a")  # 2 blocks released by an abort
    b = make_seq("b", [2] * 4, 4)
    sched.add_sequence(b)
    _step(sched)
    assert b.finish_reason is FinishReason.STOP and b.num_output_tokens == 0  # HTTP 200, zero tokens
    c = make_seq("c", [2] * 4, 4)  # b took 1 of the 2 orphaned blocks: c reuses the other
    sched.add_sequence(c)
    _step(sched)
    assert c.num_output_tokens == 0
    d = make_seq("d", [2] * 4, 4)  # none left: d is served
    sched.add_sequence(d)
    _step(sched)
    assert d.num_output_tokens == 1 and d.finish_reason is None
