"""The scheduler without a model: a fake runner output advances the sequences.

Covers the token budget and chunked prefill, decode-before-prefill order, recompute
preemption (victim order, blocks freed, requeued at the front), prefix-hit accounting,
the beam-search deadlock escape and the one free path from every state.
"""

from __future__ import annotations

import pytest
from utils import fake_result, held_blocks, make_scheduler, make_seq

from vlite.engine.core.sched_output import SchedulerOutput
from vlite.engine.core.scheduler import Scheduler
from vlite.engine.core.sequence import FinishReason, SequenceStatus


def fake_runner_step(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """Book the step through the scheduler's own ``update_from_output`` with a fake runner output."""
    sched.update_from_output(out, fake_result(out, token))


def test_chunked_prefill_spends_the_token_budget_and_samples_only_on_the_last_chunk():
    sched = make_scheduler(budget=16)
    seq = make_seq("a", list(range(1, 41)))  # 40 prompt tokens
    sched.add_sequence(seq)
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        assert out.num_batched_tokens <= 16
        chunks.append([(s.num_new_tokens, s.sample) for s in out.scheduled])
        fake_runner_step(sched, out)
    assert chunks == [[(16, False)], [(16, False)], [(8, True)]]
    assert seq.num_output_tokens == 1
    # the next step is a 1-token decode that needs no new block until position 44
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens, s.sample) for s in out.scheduled] == [(seq, 1, True)]
    assert len(sched.kv_cache_manager.get_block_table(seq.seq_id)) == 11  # ceil(41 / 4)


def test_decodes_come_before_prefills_and_waiting_joins_in_arrival_order_within_max_num_seqs():
    sched = make_scheduler(budget=64, max_num_seqs=2)
    a, b, c = make_seq("a", [1] * 6), make_seq("b", [2] * 6), make_seq("c", [3] * 6)
    for s in (a, b, c):
        sched.add_sequence(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a, b]  # c waits: max_num_seqs = 2
    assert list(sched.waiting) == [c]
    fake_runner_step(sched, out)
    sched.finish_sequence(a, FinishReason.STOP)
    out = sched.schedule()
    # b's decode first, then c's prefill
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 1), (c, 6)]


def test_preemption_takes_the_latest_arrival_frees_its_blocks_and_requeues_it_first():
    # 6 blocks of 4 tokens: a and b each take 2 blocks for their 8-token prompts; growth forces preemption
    sched = make_scheduler(num_blocks=6, budget=64)
    a, b, c = make_seq("a", [1] * 8, 32), make_seq("b", [2] * 8, 32), make_seq("c", [3] * 8, 32)
    for s in (a, b):
        sched.add_sequence(s)
    fake_runner_step(sched, sched.schedule())  # both prefilled: 4 blocks held, each holds 9 tokens
    sched.add_sequence(c)
    out = sched.schedule()  # a and b each need a 3rd block (2 left); c cannot join
    assert [s.seq for s in out.scheduled] == [a, b] and not out.preempted
    assert list(sched.waiting) == [c]
    fake_runner_step(sched, out)
    for _ in range(3):  # decode to 12 tokens each: still 3 blocks
        fake_runner_step(sched, sched.schedule())
    assert held_blocks(sched) == 6
    out = sched.schedule()  # a needs a 4th block: none free -> b (latest arrival) is preempted
    assert out.preempted == [b]
    assert [s.seq for s in out.scheduled] == [a]
    assert b.status is SequenceStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.stats.num_preemptions_total == 1
    assert list(sched.waiting) == [b, c]  # front of the queue, ahead of the newer c
    assert sched.kv_cache_manager.get_block_table(b.seq_id) == []
    assert held_blocks(sched) == 4  # a's 4 blocks; b's 3 went back to the free list
    # nothing new joins in a step that preempted
    assert c.status is SequenceStatus.WAITING


def test_preempted_sequence_is_recomputed_with_its_generated_tokens():
    sched = make_scheduler(num_blocks=4, budget=64)
    a, b = make_seq("a", [1] * 8, 32), make_seq("b", [2] * 8, 32)
    sched.add_sequence(a)
    sched.add_sequence(b)
    fake_runner_step(sched, sched.schedule())  # 8 prompt tokens each: 2 blocks each, pool full
    out = sched.schedule()  # a's decode writes position 8, a 3rd block: b is preempted
    assert out.preempted == [b]
    fake_runner_step(sched, out)
    sched.finish_sequence(a, FinishReason.LENGTH)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens, s.sample) for s in out.scheduled] == [(b, 9, True)]  # prompt + its 1 output


def test_prefix_hits_are_counted_and_skip_the_cached_tokens():
    sched = make_scheduler(num_blocks=16, budget=64, prefix_caching=True)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks + 1
    a = make_seq("a", prompt)
    sched.add_sequence(a)
    fake_runner_step(sched, sched.schedule())
    sched.finish_sequence(a, FinishReason.STOP)
    bm = sched.kv_cache_manager
    assert bm.num_cached_blocks == 3 and held_blocks(sched) == 0  # cached blocks are free, not held
    b = make_seq("b", prompt[:12] + [99])  # same 3 full blocks, different last token
    sched.add_sequence(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 1)]
    assert b.num_computed_tokens == 12
    assert bm.prefix_cache_queries == 13 + 13 and bm.prefix_cache_hits == 12
    # a prompt whose last token ends a cached block still computes that block (its logits are needed)
    c = make_seq("c", prompt[:12])
    sched.add_sequence(c)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled][-1] == ("c", 4)
    assert bm.prefix_cache_hits == 12 + 8


def test_beam_deadlock_escape_preempts_all_running_and_groups_siblings():
    sched = make_scheduler(num_blocks=8, budget=64)
    a = make_seq("a", [1] * 4)
    sched.add_sequence(a)
    out = sched.schedule()
    fake_runner_step(sched, out)
    # a's beams (forks) wait for logits: every running sequence has nothing to run this step
    child = a.fork(1)
    sched.kv_cache_manager.fork(a, child)
    sched.add_forked(child)
    a.num_computed_tokens = child.num_computed_tokens = a.num_tokens
    w1, w2 = make_seq("w", [2] * 40), make_seq("x", [3] * 4)
    sched.add_sequence(w1)
    sched.add_sequence(w2)
    # w (40 tokens = 10 blocks) can never fit while a's 2 beams hold blocks: without the escape, no progress
    out = sched.schedule()
    assert set(out.preempted) == {a, child} and not sched.running
    assert held_blocks(sched) == 0
    order = [s.request_id for s in sched.waiting]
    assert order[:2] == ["a", "a"] and sorted(order[2:]) == ["w", "x"]  # siblings side by side


@pytest.mark.parametrize("state", ["waiting", "mid-prefill", "running", "preempted"])
def test_abort_in_every_state_goes_through_the_one_free_path(state):
    sched = make_scheduler(num_blocks=6, budget=8)
    a, b = make_seq("a", [1] * 12, 32), make_seq("b", [2] * 4, 32)
    sched.add_sequence(b)
    sched.add_sequence(a)
    if state != "waiting":
        fake_runner_step(sched, sched.schedule())  # b prefilled, a got its first 4-token chunk
        assert a.status is SequenceStatus.RUNNING and a.in_prefill
    if state in ("running", "preempted"):
        for _ in range(3):
            fake_runner_step(sched, sched.schedule())
        assert not a.in_prefill
    if state == "preempted":
        sched._preempt(sched.running.pop(sched.running.index(a)))
        assert a.status is SequenceStatus.PREEMPTED
    aborted = sched.abort("a")
    assert aborted == [a] and a.finish_reason is FinishReason.ABORT
    assert "a" not in sched.requests and a not in sched.running and a not in sched.waiting
    assert sched.kv_cache_manager.get_block_table(a.seq_id) == []
    assert sched.abort("a") == []  # idempotent
    sched.abort("b")
    assert held_blocks(sched) == 0 and not sched.requests and not sched.kv_cache_manager.ledger.held()
