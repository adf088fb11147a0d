"""The request-id census finds per-request state nobody registered."""

from __future__ import annotations

import collections
import gc

import pytest

from vlite.engine.census import request_census
from vlite.engine.core.sequence import SeqId


class _Holder:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


class _Slotted:
    __slots__ = ("cache",)

    def __init__(self, cache) -> None:
        self.cache = cache


class _RequestState:  # a client's own per-request object: known by its request_id
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.text = "partial"


def _paths(result) -> dict[str, tuple]:
    return {h.path: (h.kind, h.request_ids) for h in result.held}


def test_census_names_each_container_by_its_path_and_how_it_holds_the_ids():
    root = _Holder(
        output_processor=_Holder(holdback={"r-1": 3, "r-live": 1}),
        grammar=_Slotted(cache=collections.deque([_RequestState("r-2")])),
        tags={"r-3"},
        last_request_id="r-4",
        by_seq={SeqId(7): [1, 2], SeqId(8): [3]},
        ledger={(SeqId(9), 4): "entry"},
        counts={7: 1, 8: 2},  # plain ints that equal sequence ids are not sequence ids
    )
    result = request_census({"engine": root}, {"r-1", "r-2", "r-3", "r-4"}, seq_id_type=SeqId,
                            live_seq_ids={8}, seq_names={7: "r-7"})
    assert _paths(result) == {
        "engine.output_processor.holdback": ("key", ("r-1",)),
        "engine.grammar.cache": ("element", ("r-2",)),
        "engine.tags": ("element", ("r-3",)),
        "engine.last_request_id": ("attribute", ("r-4",)),
        "engine.by_seq": ("key", ("r-7",)),
        "engine.ledger": ("key", ("seq 9",)),
    }
    assert result.num_requests_held == 6
    assert not result.truncated


def test_census_finds_ended_requests_as_values_and_skips_bounded_histories():
    history = collections.OrderedDict(a=_RequestState("r-1"))
    root = _Holder(history=history, by_slot=[None, _RequestState("r-1")], ok={"r-live": _RequestState("r-live")})
    result = request_census({"engine": root}, {"r-1"}, skip=[history])
    assert _paths(result) == {"engine.by_slot": ("element", ("r-1",))}


def test_census_reaches_objects_moved_to_the_permanent_generation_by_gc_freeze():
    # vllm#44175 hid from gc.get_objects() behind gc.freeze(); references still reach it
    leaky = _Holder(new_block_ids={"r-9": [1, 2, 3]})
    gc.collect()
    gc.freeze()
    try:
        assert leaky not in gc.get_objects()
        result = request_census({"runner": _Holder(manager=leaky)}, {"r-9"})
    finally:
        gc.unfreeze()
    assert _paths(result) == {"runner.manager.new_block_ids": ("key", ("r-9",))}


def test_census_is_empty_when_nothing_holds_an_ended_request():
    root = _Holder(m={"x": 1}, seqs={SeqId(1): 2})
    result = request_census({"engine": root}, {"r-1"}, seq_id_type=SeqId, live_seq_ids={1})
    assert result.held == ()
    assert result.objects_visited >= 3


def test_census_finds_keys_and_values_derived_from_an_ended_id():
    """The id handed to the client (``chatcmpl-<id>``), a choice's or prompt's (``<id>-1``,
    ``1_<id>``), a cache key (``<id>:prefix``) and a multi-prompt request's response id
    (``cmpl-<parent>`` where the engine's ids are ``<parent>-0``, ``<parent>-1``) all stand for
    the ended request; an id that only starts the same way, or a short id inside a word, does not."""
    ended = {"lc-00017", "lc-00018", "lc-00019", "lc-00020", "cmpl-9f2a71-0", "cmpl-9f2a71-1", "r-1"}
    root = _Holder(
        responses={"chatcmpl-lc-00017": "hi"},
        choices=["lc-00018-1", "lc-00018-2"],
        parallel={"1_lc-00019": 3},
        prefix_keys={"lc-00020:prefix": 0},
        by_http_id={"cmpl-9f2a71": "whole"},
        unrelated={"lc-000171": 1, "lc-00017x": 2, "car-1-door": 3, "cmpl-9f2a712": 4},
    )
    result = request_census({"engine": root}, ended)
    assert _paths(result) == {
        "engine.responses": ("key", ("lc-00017",)),
        "engine.choices": ("element", ("lc-00018",)),
        "engine.parallel": ("key", ("lc-00019",)),
        "engine.prefix_keys": ("key", ("lc-00020",)),
        "engine.by_http_id": ("key", ("cmpl-9f2a71-0",)),
    }
    assert [h.num_entries for h in result.held if h.path == "engine.choices"] == [2]


def test_census_enters_closures_bound_methods_partials_and_lru_caches():
    """State held by a callback: a closure's cell, a bound method's owner, a partial's argument,
    an ``lru_cache`` keyed by request id (alone or with ``self``). An object also held plainly
    keeps its plain path."""
    import functools

    by_request = {"lc-00031": "state"}

    def on_output():
        return by_request

    class _Tracker:
        def __init__(self) -> None:
            self.pending = {"lc-00032": 1}

        def observe(self) -> None:
            pass

        @functools.cache  # noqa: B019 - a per-instance cache is the planted leak
        def prompt_ids(self, request_id: str) -> list[int]:
            return [1, 2]

    @functools.cache
    def detokenizer_for(request_id: str) -> str:
        return request_id.upper()

    tracker = _Tracker()
    tracker.prompt_ids("lc-00035")
    detokenizer_for("lc-00036")
    shared = {"lc-00037": 0}
    root = _Holder(callbacks=[on_output, tracker.observe, functools.partial(print, {"lc-00033": 2}, sep=["lc-00034"])],
                   plain=_Holder(shared=shared), hooks={"done": functools.partial(len, shared)},
                   cached=detokenizer_for, cached_method=_Tracker.prompt_ids)
    result = request_census({"engine": root}, {f"lc-000{i}" for i in range(31, 38)})
    assert _paths(result) == {
        "engine.callbacks[0].<closure by_request>": ("key", ("lc-00031",)),
        "engine.callbacks[1].__self__.pending": ("key", ("lc-00032",)),
        "engine.callbacks[2].args[0]": ("key", ("lc-00033",)),
        "engine.callbacks[2].keywords['sep']": ("element", ("lc-00034",)),
        "engine.cached_method.<lru_cache>": ("key", ("lc-00035",)),
        "engine.cached.<lru_cache>": ("key", ("lc-00036",)),
        "engine.plain.shared": ("key", ("lc-00037",)),
    }


def test_module_roots_include_lru_cached_functions(monkeypatch):
    import functools
    import sys
    import types

    from vlite.engine.census import module_roots

    mod = types.ModuleType("censusfixture.detok")

    @functools.cache
    def by_request(request_id: str) -> int:
        return len(request_id)

    by_request.__module__ = mod.__name__
    mod.by_request, mod.imported = by_request, functools.lru_cache(maxsize=None)(len)  # another module's
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    by_request("lc-00041")
    roots = module_roots(("censusfixture",))
    assert list(roots) == ["censusfixture.detok.by_request"]
    result = request_census(roots, {"lc-00041"})
    assert _paths(result) == {"censusfixture.detok.by_request.<lru_cache>": ("key", ("lc-00041",))}


def test_census_says_when_it_stopped_at_its_budget():
    root = _Holder(chain=[[[[{"r-1": 1}]]]])
    assert request_census({"engine": root}, {"r-1"}, max_objects=2).truncated
    assert not request_census({"engine": root}, {"r-1"}).truncated


@pytest.fixture(scope="module")
def idle_engine(tiny_checkpoint):
    """A tiny engine after a run of finished and aborted requests, idle."""
    from conftest import make_engine

    from vlite.engine import SamplingParams

    engine = make_engine(tiny_checkpoint, num_blocks=32)
    for i in range(6):
        engine.add_request("a b c d e f g h " * (i + 1), SamplingParams(max_tokens=6, temperature=0), request_id=f"cz-{i}")
    engine.step()
    engine.abort("cz-5")
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def test_a_clean_idle_engine_holds_no_ended_request(idle_engine):
    from vlite.engine import EngineView

    result = EngineView(idle_engine).request_census({f"cz-{i}" for i in range(6)})
    assert result.held == ()


def test_the_census_finds_an_unregistered_map_in_the_engine(idle_engine):
    from vlite.engine import EngineView

    processor = idle_engine.output_processor
    processor.holdback_by_request = {"cz-3": "partial stop string"}  # nobody registered this map
    try:
        result = EngineView(idle_engine).request_census({f"cz-{i}" for i in range(6)})
    finally:
        del processor.holdback_by_request
    assert _paths(result) == {"engine.output_processor.holdback_by_request": ("key", ("cz-3",))}


# Registry name -> how to plant one ended entry in it (the map as the engine holds it).
_PLANT = {
    "scheduler.requests": lambda e, s: e.scheduler.requests.__setitem__(s.request_id, _Holder(live=[])),
    "scheduler.waiting": lambda e, s: e.scheduler.waiting.append(s),
    "scheduler.running": lambda e, s: e.scheduler.running.append(s),
    "scheduler.live_sequences": lambda e, s: e.scheduler.requests.__setitem__(
        "other-id", _Holder(request_id="other-id", live=[s])),
    "block_tables": lambda e, s: e.scheduler.kv_cache_manager.block_tables.__setitem__(s.seq_id, [0]),
    "prefix_hash_progress": lambda e, s: e.scheduler.kv_cache_manager._num_hashed.__setitem__(s.seq_id, 1),
    "ledger.held": lambda e, s: e.scheduler.kv_cache_manager.ledger._held.__setitem__((s.seq_id, 0), None),
    "structured_output.matchers": lambda e, s: e.scheduler.structured_output.matchers.add(s.seq_id),
}
# pending_copies holds (src, dst) block ids with no request identity: only the registry sees it.
_REGISTRY_ONLY = {"pending_copies"}


def test_every_registered_map_is_planted_here_or_said_to_be_registry_only():
    from vlite.engine.introspection import REGISTRIES

    assert set(REGISTRIES) == set(_PLANT) | _REGISTRY_ONLY


@pytest.mark.parametrize("registry", sorted(_PLANT))
def test_the_census_finds_an_ended_entry_in_every_registered_map(idle_engine, registry):
    from vlite.engine import EngineView, SamplingParams
    from vlite.engine.core.sequence import RequestOrigin, Sequence

    seq = Sequence("cz-0", "x", [1, 2], SamplingParams(max_tokens=1), RequestOrigin("cz-0"))
    saved = _state(idle_engine)
    try:
        _PLANT[registry](idle_engine, seq)
        result = EngineView(idle_engine).request_census({f"cz-{i}" for i in range(6)})
    finally:
        _restore(idle_engine, saved)
    assert result.held, registry
    assert all(set(h.request_ids) <= {"cz-0", f"seq {int(seq.seq_id)}"} for h in result.held)


def _state(engine):
    s, bm = engine.scheduler, engine.scheduler.kv_cache_manager
    return (dict(s.requests), list(s.waiting), list(s.running), dict(bm.block_tables), dict(bm._num_hashed),
            dict(bm.ledger._held), set(s.structured_output.matchers))


def _restore(engine, saved):
    s, bm = engine.scheduler, engine.scheduler.kv_cache_manager
    for live, old in zip((s.requests, s.waiting, s.running, bm.block_tables, bm._num_hashed, bm.ledger._held,
                          s.structured_output.matchers), saved):
        live.clear()
        (getattr(live, "extend", None) or live.update)(old)


def test_the_walk_does_not_grow_with_the_block_pool(tiny_checkpoint):
    # the pool's blocks and free queue hold ints only; entering them cost one visit per block
    # (131,072 blocks, 1.2 s per idle point, on the tiny model's default pool)
    from conftest import make_engine

    from vlite.engine import EngineView

    small = EngineView(make_engine(tiny_checkpoint, num_blocks=16)).request_census(set())
    large = EngineView(make_engine(tiny_checkpoint, num_blocks=4096)).request_census(set())
    assert large.objects_visited == small.objects_visited
    assert not large.truncated


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_idle_census_runs_when_quiet_whatever_the_maps_hold_and_is_overdue_when_kept_busy(monkeypatch):
    # the census's idle point is the process's own (blockers empty, quiet for
    # CENSUS_QUIET_S); kept from it while no new work comes, it is overdue, naming what blocks it
    from vlite.engine import census as census_mod
    from vlite.engine.census import CensusResult, EndedRequests, IdleCensus

    clock = _Clock()
    monkeypatch.setattr(census_mod.time, "monotonic", clock)
    ended = EndedRequests()
    census = IdleCensus("engine", ended)
    walks = []

    def walk(ids, skip):
        walks.append(set(ids))
        return CensusResult((), 1, False)

    busy: dict[str, int] = {"scheduler.running": 1}
    ended.record("r-1")
    last_work = clock.t
    assert not census.tick(lambda: busy, clock.t, last_work, walk)  # a step just ran
    clock.t += 2.0  # still stepping (quiet_since = now), new work 2 s ago: not overdue yet
    assert not census.tick(lambda: busy, clock.t, last_work, walk) and census.overdue is None
    clock.t += 1.5  # due 3.5 s, no new work: overdue, blocked by the scheduler
    assert census.tick(lambda: busy, clock.t, last_work, walk)
    assert census.overdue == {"seconds": 3.5, "blocked_by": {"scheduler.running": 1}}
    assert census.document()["overdue"] == census.overdue and walks == []
    busy = {}  # the scheduler emptied; quiet since 0.2 s: not yet
    assert not census.tick(lambda: busy, clock.t - 0.2, last_work, walk) and walks == []
    assert census.tick(lambda: busy, clock.t - 0.6, last_work, walk)  # quiet long enough: it runs
    assert walks == [{"r-1"}] and census.overdue is None and census.pending == 0
    ended.record("r-2")
    clock.t += 0.5  # within CENSUS_INTERVAL_S of the last one: waits
    assert not census.tick(lambda: busy, clock.t - 5, last_work, walk) and census.wait_s(clock.t - 5) == 0.5
    clock.t += 0.5
    assert census.tick(lambda: busy, clock.t - 5, last_work, walk) and walks[-1] == {"r-1", "r-2"}


def test_new_work_keeps_a_busy_census_from_being_called_overdue(monkeypatch):
    from vlite.engine import census as census_mod
    from vlite.engine.census import CensusResult, EndedRequests, IdleCensus

    clock = _Clock()
    monkeypatch.setattr(census_mod.time, "monotonic", clock)
    ended = EndedRequests()
    census = IdleCensus("api_server", ended)
    ended.record("r-1")
    for _ in range(10):  # a busy server: a request starts every second
        clock.t += 1.0
        census.tick(lambda: {"requests_in_flight": 2}, clock.t, clock.t - 0.5, lambda i, s: CensusResult((), 1, False))
        assert census.overdue is None


def test_an_ended_requests_map_entry_is_one_container_not_one_per_part_of_its_value():
    # the engine loop's live map holds _LiveRequest(request, last): reported once, at the map
    # (not as live['r-1'].last, live['r-2'].last, ...: one /metrics series per request)
    root = _Holder(live={"r-1": _Holder(last=_RequestState("r-1"), n=1), "r-2": _Holder(last=_RequestState("r-2"))})
    result = request_census({"loop": root}, {"r-1", "r-2"})
    assert _paths(result) == {"loop.live": ("key", ("r-1", "r-2"))}


def test_the_census_reports_the_cap_a_container_type_declares():
    import collections
    import functools

    from vlite.engine.census import request_census

    window = collections.deque(range(7), maxlen=1000)
    unbounded = collections.deque(range(3))

    @functools.lru_cache(maxsize=64)
    def square(x):
        return x * x

    for i in range(5):
        square(i)
    res = request_census({"window": window, "plain": unbounded, "square": square}, ())
    assert res.container_sizes["window"] == 7 and res.container_caps["window"] == 1000
    assert "plain" not in res.container_caps
    assert res.container_sizes["square.<lru_cache>"] == 5 and res.container_caps["square.<lru_cache>"] == 64
