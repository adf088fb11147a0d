"""Block accounting through the engine: every exit (finish, abort in any state, preemption,
error) returns every block, and the ledger ends empty."""

from __future__ import annotations

import pytest
from conftest import make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlite.engine.core.sequence import FinishReason, RequestOrigin, SequenceStatus
from vlite.engine.sampling_params import SamplingParams


def assert_all_free(engine):
    s = engine.stats()
    # cached-evictable blocks (prefix caching) are free, not leaked
    assert s.num_free_blocks + s.num_cached_blocks == s.num_total_blocks, s
    assert s.num_used_blocks == 0 and s.kv_cache_usage == 0.0
    assert engine.ledger() == []
    assert engine.block_tables_view() == {}
    assert s.num_live_requests == 0 and s.num_running == 0 and s.num_waiting == 0
    assert all(rc == 0 for rc in engine.ref_counts())


def assert_consistent(engine):
    tables = engine.block_tables_view()
    s = engine.stats()
    held = {b for t in tables.values() for b in t}
    refs = engine.ref_counts()
    assert all(refs[b] == sum(t.count(b) for t in tables.values()) for b in range(len(refs)))
    assert len(held) + s.num_free_blocks + s.num_cached_blocks == s.num_total_blocks
    assert len(engine.ledger()) == sum(len(t) for t in tables.values())


def drain(engine, max_steps=2000):
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
        assert_consistent(engine)
    raise AssertionError("engine did not drain")


def test_abort_in_every_state(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=14, block_size=4, max_num_batched_tokens=8)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    live = engine.scheduler.requests  # test-only peek at states

    class _Seqs:
        def __getitem__(self, rid):
            return live[rid][0]

        def items(self):
            return [(rid, seqs[0]) for rid, seqs in live.items()]

    seqs = _Seqs()
    engine.add_request(None, greedy, prompt_token_ids=list(range(100, 120)), request_id="chunked")
    engine.add_request(None, greedy, prompt_token_ids=list(range(200, 204)), request_id="waiting")
    engine.step()  # "chunked" gets an 8-token chunk of 20 and stays mid-prefill
    assert seqs["chunked"].in_prefill and seqs["chunked"].num_computed_tokens == 8
    assert seqs["waiting"].status is SequenceStatus.WAITING
    assert engine.abort("chunked") and engine.abort("waiting")
    assert not engine.abort("waiting")  # already gone
    assert_all_free(engine)

    # running (decoding) and preempted: two long requests in a cache too small for both
    for rid in ("a", "b"):
        engine.add_request(None, greedy, prompt_token_ids=list(range(300, 306)), request_id=rid)
    preempted = None
    for _ in range(200):
        engine.step()
        preempted = next((r for r, s in seqs.items() if s.status is SequenceStatus.PREEMPTED), None)
        if preempted:
            break
    assert preempted is not None, "the cache was sized to force a preemption"
    other = "a" if preempted == "b" else "b"
    assert seqs[other].status is SequenceStatus.RUNNING and seqs[other].num_output_tokens > 0
    assert engine.abort(preempted) and engine.abort(other)
    assert engine.stats().num_preemptions_total >= 1
    assert_all_free(engine)


def test_error_in_step_ends_only_that_request(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=32, faults=("raise-in-step",))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("hello there", params, request_id="bad",
                       origin=RequestOrigin("bad", client_tag="raise-in-step"))
    engine.add_request("good morning", params, request_id="good")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].outputs[0].finish_reason == FinishReason.ERROR.value
    assert "raise-in-step" in finals["bad"].error
    assert finals["good"].outputs[0].finish_reason == "length"
    assert len(finals["good"].outputs[0].token_ids) == 5
    assert_all_free(engine)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 15), st.just(0)),
), min_size=1, max_size=40))
def test_random_add_step_abort_returns_every_block(tiny_checkpoint, ops):
    engine = make_engine(tiny_checkpoint, num_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    added = []
    for op, a, b in ops:
        if op == "add":
            rid = f"r{len(added)}"
            engine.add_request(None, SamplingParams(max_tokens=b, temperature=0, ignore_eos=True),
                               prompt_token_ids=[(7 * i + a) % 1000 + 10 for i in range(a)], request_id=rid)
            added.append(rid)
        elif op == "step":
            for _ in range(a):
                engine.step()
        elif added:
            engine.abort(added[a % len(added)])
        assert_consistent(engine)
    drain(engine)
    assert_all_free(engine)


def test_finished_requests_are_remembered_for_attribution(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    origin = RequestOrigin("x1", route="/v1/completions", client_tag="t", client_action="complete")
    engine.add_request("hi", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), origin=origin)
    (seq_id,) = [s["seq_id"] for s in engine.sequences_view()]
    (out,) = [o for o in iter_until_done(engine) if o.finished]
    assert engine.sequences_view() == []
    rec = engine.request_record(seq_id)
    assert rec.origin is origin and out.origin is origin
    assert rec.status == "finished" and rec.finish_reason == "length" and rec.num_output_tokens == 2


def iter_until_done(engine):
    while engine.has_unfinished_requests():
        yield from engine.step()


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_sizes_agree(tiny_checkpoint, block_size):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["The paged cache", "A much longer prompt that spans several blocks of the cache for sure"]
    ref = make_engine(tiny_checkpoint, num_blocks=64, block_size=16).generate(prompts, params)
    outs = make_engine(tiny_checkpoint, num_blocks=400, block_size=block_size,
                       max_num_batched_tokens=7).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
