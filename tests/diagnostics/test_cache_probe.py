"""Workload variety: prompts that do not repeat, and the cache-versus-leak probe.

Unit tests of the decision (checks/cache_probe.py) on synthetic series, of the distinct prompt
source and the probe's rounds, then end to end on the tiny random model with a planted bounded
cache (must not be a HOST-LEAK; reported with its entries) and a planted content-keyed memo (must
be one, and only with distinct prompts)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from conftest import make_engine

from vlite.diagnostics.checks.cache_probe import apply_probe, classify, levelled
from vlite.diagnostics.checks.cache_probe import lines as probe_lines
from vlite.diagnostics.workload import probe
from vlite.diagnostics.workload.all_paths import all_paths_workload
from vlite.diagnostics.workload.sources import synthetic_prompt, synthetic_workload


def _series(ys, start=0, step=8):
    return [(start + i * step, float(y)) for i, y in enumerate(ys)]


# --- the decision, on synthetic series ---------------------------------------------------------------

def test_a_cache_that_levels_off_with_distinct_inputs_is_bounded_with_its_cap():
    rep = _series([40, 48, 48, 48])  # the first repeated round is new content, then hits
    dis = _series([48, 56, 64, 70, 70, 70], start=24)
    k = classify(rep, dis)
    assert k["kind"] == "bounded-cache" and k["entries"] == 70 and k["grew_distinct"] == 22


def test_a_noisy_level_is_still_a_level_but_a_slow_leak_at_a_large_size_is_not():
    # a byte-limited LRU: the entries wobble by a few around its level
    assert classify(_series([90, 98, 98, 98]), _series([98, 110, 124, 130, 127, 129], start=24))["kind"] == "bounded-cache"
    # 0.25 entries per request at 200 entries: within 5% over two rounds, but its slope is a leak's
    slow = _series([200, 202, 204, 206, 208, 210], start=24)
    assert not levelled(slow)
    assert classify(_series([196, 198, 198, 198]), slow)["kind"] == "content-keyed"


def test_growth_with_distinct_inputs_only_is_content_keyed_and_with_repeats_too_per_request():
    assert classify(_series([40, 48, 48, 48]), _series([48, 56, 64, 72, 80, 88], start=24))["kind"] == "content-keyed"
    assert classify(_series([40, 48, 56, 64]), _series([64, 72, 80, 88], start=24))["kind"] == "per-request"
    assert classify(_series([40, 40, 40, 40]), _series([40, 40, 40, 40], start=24))["kind"] == "not fed"
    with pytest.raises(ValueError):
        classify([], [])


def _host(paths, anon=None):
    return {"verdict": "HOST-LEAK", "growing": [{"path": p, "entries_per_request": 1.0, "first": 0, "last": 40}
                                                for p in paths], "anon_swap": anon}


def test_apply_probe_moves_bounded_caches_out_of_the_verdict_and_keeps_the_leaks():
    bounded = (_series([40, 48, 48, 48]), _series([48, 56, 64, 70, 70, 70], start=24))
    leak = (_series([40, 48, 48, 48]), _series([48, 56, 64, 72, 80, 88], start=24))
    host = apply_probe(_host(["engine.cache"]), {"engine.cache": bounded}, rounds=8, round_size=8, budget=64)
    assert host["verdict"] == "below threshold" and not host["growing"]
    assert host["bounded_caches"][0]["path"] == "engine.cache" and host["bounded_caches"][0]["entries"] == 70
    assert any("bounded cache (not a leak): engine.cache levelled off at 70 entries" in line for line in probe_lines(host))
    host = apply_probe(_host(["engine.cache", "engine.memo"]), {"engine.cache": bounded, "engine.memo": leak},
                       rounds=8, round_size=8, budget=64)
    assert host["verdict"] == "HOST-LEAK" and [g["path"] for g in host["growing"]] == ["engine.memo"]
    assert host["growing"][0]["probe"]["kind"] == "content-keyed"
    assert any("engine.memo is keyed by content" in line for line in probe_lines(host))
    # anonymous memory that keeps growing keeps the verdict, whatever the containers
    host = apply_probe(_host(["engine.cache"], anon={"keeps_growing": True}), {"engine.cache": bounded}, rounds=8,
                       round_size=8, budget=64)
    assert host["verdict"] == "HOST-LEAK"
    # ... and still does when the probe's own requests kept it growing past the threshold
    host = apply_probe(_host(["engine.cache"], anon={"keeps_growing": True}), {"engine.cache": bounded}, rounds=8,
                       round_size=8, budget=64, anon_bytes=(100 << 20, (100 << 20) + 64 * 200 * 1024))
    assert host["verdict"] == "HOST-LEAK" and host["cache_probe"]["anon_bytes_per_request"] == 200 * 1024
    # but anonymous memory that grew in the replay while the bounded cache filled, and not over the
    # probe's 64 more requests, stopped growing with the cache: warm-up, not a leak
    host = apply_probe(_host(["engine.cache"], anon={"keeps_growing": True}), {"engine.cache": bounded}, rounds=8,
                       round_size=8, budget=64, anon_bytes=(100 << 20, (100 << 20) + 64 * 4 * 1024))
    assert host["verdict"] == "warm-up"
    # a request kind that keeps growing keeps the verdict too
    host = _host(["engine.cache"])
    host["kind_growth"] = {"growing": [{"process": "engine", "kind": "logprobs", "bytes_per_request": 1 << 20}]}
    assert apply_probe(host, {"engine.cache": bounded}, rounds=8, round_size=8, budget=64)["verdict"] == "HOST-LEAK"


# --- the distinct source and the probe's rounds ----------------------------------------------------

def test_distinct_prompts_do_not_repeat_and_draw_from_many_more_words():
    rng_w, rng_d = random.Random(0), random.Random(0)
    words = [synthetic_prompt(rng_w, 24, "word-list") for _ in range(300)]
    distinct = [synthetic_prompt(rng_d, 24, "distinct") for _ in range(300)]
    assert len(set(distinct)) == 300
    vocab_w = {w for p in words for w in p.split()}
    vocab_d = {w for p in distinct for w in p.split()}
    assert len(vocab_w) <= 90 and len(vocab_d) > 2000
    # the same seed gives the same text; an unknown source is refused by name
    assert synthetic_prompt(random.Random(5), 30, "distinct") == synthetic_prompt(random.Random(5), 30, "distinct")
    with pytest.raises(ValueError, match="word-list"):
        synthetic_prompt(random.Random(0), 8, "lorem")


def test_both_sources_plan_the_same_workload():
    a = all_paths_workload(60, seed=3, prompt_source="word-list")
    b = all_paths_workload(60, seed=3, prompt_source="distinct")
    strip = [(s.request_id, s.client_tag, s.action, s.prompt_len, s.max_tokens, s.n) for s in a]
    assert strip == [(s.request_id, s.client_tag, s.action, s.prompt_len, s.max_tokens, s.n) for s in b]
    assert sum(x.prompt != y.prompt for x, y in zip(a, b)) > 40  # chat messages and nothing else stay


def test_probe_rounds_repeat_or_renew_the_prompts():
    base = probe.template(synthetic_workload(10, seed=1), 4)
    r0, r1 = probe.repeated_round(base, 0), probe.repeated_round(base, 1)
    assert [s.prompt for s in r0] == [s.prompt for s in r1] == [s.prompt for s in base]
    assert len({s.request_id for s in r0 + r1}) == 8
    d0, d1 = probe.distinct_round(base, 0), probe.distinct_round(base, 1)
    assert not {s.prompt for s in d0} & ({s.prompt for s in d1} | {s.prompt for s in base})
    with pytest.raises(ValueError):
        probe.template([], 4)


# --- end to end on the tiny model ------------------------------------------------------------------

def _plant(engine, cache):
    """Wrap the engine's add_request so that ``cache(prompt)`` runs on every prompt; the container
    lives on the engine (the census reaches it as ``engine.planted``)."""
    add = engine.add_request
    engine.planted = cache.store

    def add_request(prompt=None, *args, **kwargs):
        cache(prompt)
        return add(prompt, *args, **kwargs)

    engine.add_request = add_request


class _WordMemo:
    """A memo keyed by each word of the prompt, never bounded."""

    def __init__(self):
        self.store = {}

    def __call__(self, prompt):
        for w in prompt.split():
            self.store.setdefault(w, len(w))


class _PromptLRU:
    """A prompt cache keyed by the whole prompt, least recently used evicted past ``cap`` entries."""

    def __init__(self, cap):
        self.store, self.cap = OrderedDict(), cap

    def __call__(self, prompt):
        self.store[prompt] = len(prompt)
        self.store.move_to_end(prompt)
        while len(self.store) > self.cap:
            self.store.popitem(last=False)


def _run(checkpoint, cache, source="distinct", budget=None):
    from vlite.diagnostics.targets.inprocess import run_in_process

    engine = make_engine(checkpoint, num_blocks=128)
    _plant(engine, cache)
    specs = synthetic_workload(40, input_len=(8, 20), output_len=(2, 4), seed=4, prompt_source=source)
    return run_in_process(engine, specs, max_concurrency=8, idle_every=8, sample_interval_s=0.05,
                          cache_probe_requests=budget).findings


def test_a_planted_bounded_cache_is_reported_with_its_size_not_as_a_leak(tiny_checkpoint):
    f = _run(tiny_checkpoint, _PromptLRU(cap=60), budget=64)
    hm = f.host_memory
    assert hm["verdict"] != "HOST-LEAK" and not f.host_leak and not f.leak, hm
    (b,) = hm["bounded_caches"]
    assert b["path"] == "engine.planted" and b["entries"] == 60
    assert "CLEAN" in f.summary()
    assert f.cardinality["verdict"] == "CLEAN"  # the probe's rounds leave the run's other checks as they were
    # without the probe, the same run calls the cache a leak: it was still filling when the run ended
    f = _run(tiny_checkpoint, _PromptLRU(cap=60), budget=0)
    assert f.host_leak and f.host_memory["growing"][0]["path"] == "engine.planted"


def test_a_planted_content_keyed_memo_is_a_leak_with_distinct_prompts_only(tiny_checkpoint):
    f = _run(tiny_checkpoint, _WordMemo(), budget=32)
    assert f.host_leak
    (g,) = f.host_memory["growing"]
    assert g["path"] == "engine.planted" and g["probe"]["kind"] == "content-keyed"
    assert "engine.planted" in f.summary() and "content-keyed" in f.summary()
    # the 90-word list fills the same memo within the first wave: growth that passes for warm-up
    f = _run(tiny_checkpoint, _WordMemo(), source="word-list", budget=32)
    assert not f.host_leak and not f.host_memory["growing"]
