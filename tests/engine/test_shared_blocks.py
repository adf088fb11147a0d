"""Shared KV blocks: prefix caching, parallel sampling (fork + copy-on-write), beam search."""

from __future__ import annotations

import random

import torch
from conftest import make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_accounting import assert_all_free, assert_consistent, drain

from vlite.engine.core.sequence import RequestOrigin
from vlite.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SHARED = "You are a careful assistant. Answer briefly and precisely, citing the block manager. "
PROMPTS = [SHARED + "What is a block table?", SHARED + "What is a slot mapping?", SHARED + "What is a block table?",
           "Unrelated prompt with no shared prefix at all"]


def test_prefix_caching_gives_identical_outputs_and_hits(tiny_checkpoint):
    off = make_engine(tiny_checkpoint, num_blocks=64, block_size=4)
    off.scheduler.kv_cache_manager.enable_prefix_caching = False
    ref = [o.outputs[0].token_ids for o in off.generate(PROMPTS, GREEDY)]
    assert off.stats().blocks.prefix_cache_hits == 0
    on = make_engine(tiny_checkpoint, num_blocks=64, block_size=4)
    for prompt, expected in zip(PROMPTS, ref):  # one at a time, so later prompts can hit earlier blocks
        assert on.generate([prompt], GREEDY)[0].outputs[0].token_ids == expected
    blocks = on.stats().blocks
    assert blocks.prefix_cache_hits > 0 and blocks.prefix_cache_queries > blocks.prefix_cache_hits
    # the repeated prompt hit everything but its last (partial or final) block
    assert blocks.num_cached_blocks > 0 and blocks.num_used_blocks == 0 and blocks.kv_cache_usage == 0
    assert_all_free(on)


def test_cached_blocks_are_evicted_when_needed(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=12, block_size=4)
    words = ["apple", "river", "stone", "cloud", "tiger", "piano"]
    prompts = [f"{w} starts this distinct prompt about caches" for w in words]  # no shared first block
    for prompt in prompts:  # distinct prompts: far more full blocks than the cache holds
        engine.generate([prompt], GREEDY)
        s = engine.stats()
        assert s.num_free_blocks + s.num_cached_blocks == s.num_total_blocks
    assert engine.stats().num_cached_blocks > 0
    hits = engine.stats().blocks.prefix_cache_hits
    engine.generate([prompts[0]], GREEDY)  # least recently freed: its blocks were evicted
    assert engine.stats().blocks.prefix_cache_hits == hits
    engine.generate([prompts[0]], GREEDY)  # now cached again
    assert engine.stats().blocks.prefix_cache_hits > hits


def run_with_ledger_sites(engine):
    sites = set()
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        sites |= {r.site for r in engine.ledger()}
    return finals, sites


def test_parallel_sampling_shares_prompt_blocks_with_copy_on_write(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=64, block_size=16)
    prompt_ids = list(range(1000, 1020))  # 20 tokens: the second block is partial, so shared writes CoW
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request(None, params, prompt_token_ids=prompt_ids, request_id="par")
    engine.step()  # prefill + fork
    tables = engine.block_tables_view()
    assert len(tables) == 4
    first_blocks = {t[0] for t in tables.values()}
    assert len(first_blocks) == 1 and engine.ref_counts()[first_blocks.pop()] == 4
    finals, sites = run_with_ledger_sites(engine)
    assert {"prefill", "fork", "copy-on-write"} <= sites
    out = finals["par"]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_all_free(engine)


def test_greedy_parallel_samples_equal_a_single_greedy_run(tiny_checkpoint):
    # copy-on-write must copy the right K/V: n greedy samples equal one greedy run
    engine = make_engine(tiny_checkpoint, num_blocks=64, block_size=16)
    single = engine.generate(["The shared partial block"], GREEDY)[0].outputs[0].token_ids
    multi = engine.generate(["The shared partial block"], SamplingParams(n=3, max_tokens=10, temperature=0,
                                                                         ignore_eos=True))[0]
    assert [c.token_ids for c in multi.outputs] == [single] * 3
    assert_all_free(engine)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 10_000))
def test_forks_aborts_and_evictions_keep_accounting(tiny_checkpoint, seed):
    rng = random.Random(seed)
    engine = make_engine(tiny_checkpoint, num_blocks=40, block_size=4, max_num_batched_tokens=24, max_num_seqs=8)
    ids = []
    for i in range(rng.randint(2, 6)):
        n = rng.choice([1, 2, 3])
        prompt = [11 + (j % 7) for j in range(rng.randint(1, 14))]  # repetitive: prefix hits happen
        params = SamplingParams(n=n, max_tokens=rng.randint(1, 8), temperature=1.0, seed=i, ignore_eos=True)
        if rng.random() < 0.3:
            params = SamplingParams(beam_width=2, max_tokens=rng.randint(1, 6), temperature=0)
        ids.append(engine.add_request(None, params, prompt_token_ids=prompt, request_id=f"r{i}"))
    for _ in range(rng.randint(0, 12)):
        engine.step()
        assert_consistent(engine)
        if rng.random() < 0.3:
            engine.abort(rng.choice(ids))
            assert_consistent(engine)
    drain(engine)
    assert_all_free(engine)


def test_abort_parent_request_frees_every_child(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=64, block_size=4)
    engine.add_request("fork me please", SamplingParams(n=4, max_tokens=20, temperature=1.0, ignore_eos=True),
                       request_id="p")
    for _ in range(3):
        engine.step()
    assert len(engine.block_tables_view()) == 4
    assert engine.abort("p")
    assert_all_free(engine)
    assert not engine.abort("p")


def test_refcount_fault_leaves_blocks_attributed_to_the_forking_request(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=64, block_size=16, faults=("refcount-not-decremented-on-fork",))
    origin = RequestOrigin("forker", client_action="complete")
    engine.add_request(None, SamplingParams(n=2, max_tokens=4, temperature=1.0, ignore_eos=True),
                       prompt_token_ids=list(range(500, 520)), origin=origin)
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    assert s.num_used_blocks > 0  # leaked: the shared prompt block never returns
    held = engine.ledger()
    assert held and all(r.request_id == "forker" and r.site == "fork" for r in held)
    assert all(r.origin is origin and r.finish_reason == "length" for r in held)


def test_beam_search_matches_transformers(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint.path, dtype=torch.float32).eval()
    tok = tiny_checkpoint.tokenizer
    engine = make_engine(tiny_checkpoint, num_blocks=128, block_size=4)
    for prompt, width, max_new in [("Beam search over paged blocks", 3, 8), ("Hello", 2, 6), ("a b c d e f", 4, 7)]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
                              length_penalty=1.0, max_new_tokens=max_new, num_return_sequences=1,
                              pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
        engine.add_request(None, SamplingParams(beam_width=width, max_tokens=max_new, temperature=0),
                           prompt_token_ids=ids[0].tolist(), request_id=prompt)
        finals, sites = run_with_ledger_sites(engine)
        assert finals[prompt].outputs[0].token_ids == ref, prompt
        assert "fork" in sites
        assert_all_free(engine)


def test_beam_groups_under_memory_pressure_finish_with_the_same_beams(tiny_checkpoint):
    # Three 4-beam searches in a cache that holds one group at a time: beams of a group wait
    # for preempted siblings; the scheduler must not deadlock, and preemption must not change
    # the result.
    params = SamplingParams(beam_width=4, max_tokens=8, temperature=0)
    prompts = [list(range(10 + i, 14 + i)) for i in range(3)]
    roomy = make_engine(tiny_checkpoint, num_blocks=128, block_size=4).generate(prompts, params)
    tight = make_engine(tiny_checkpoint, num_blocks=16, block_size=4, max_num_batched_tokens=32)
    outs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    assert tight.stats().num_preemptions_total > 0
    assert_all_free(tight)
