"""Host memory gets its own verdict: planted host leaks that hold no request id
are HOST-LEAK, named by the container that keeps growing; a clean run is not flagged."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from conftest import make_engine

from vlite.diagnostics.checks.host_memory import host_memory_check, plateau_test
from vlite.diagnostics.checks.host_memory import lines as host_memory_lines
from vlite.diagnostics.targets.inprocess import run_in_process
from vlite.diagnostics.workload.replay import IdlePoint
from vlite.diagnostics.workload.sources import synthetic_workload


def _specs():
    return synthetic_workload(48, input_len=(8, 30), output_len=(4, 8), abort_rate=0.25, abort_mode="mix", seed=7)


def _run(engine):
    return run_in_process(engine, _specs(), max_concurrency=8, idle_every=6, sample_interval_s=0.05)


def _block_id_list(engine):
    """vllm#44175: a list that gets every allocated block id and is never emptied."""
    bm = engine.scheduler.kv_cache_manager
    bm.new_block_ids = []
    pop = bm.block_pool.pop_free_block

    def pop_free_block():
        block_id = pop()
        bm.new_block_ids.append(block_id)
        return block_id

    bm.block_pool.pop_free_block = pop_free_block
    return "engine.scheduler.kv_cache_manager.new_block_ids"


def _tensor_cache(engine):
    """A per-request CPU tensor kept in a cache (keyed by the step, not by the request)."""
    processor = engine.output_processor
    processor.last_logits = []
    make_output = processor.make_output

    def keep(self, req):
        out = make_output(req)
        if out.finished:
            self.last_logits.append(torch.zeros(256))
        return out

    processor.make_output = types.MethodType(keep, processor)
    return "engine.output_processor.last_logits"


_INTERNED: dict[str, str] = {}


def _interned_prompts(engine):
    """A per-request string interned into a module-level dict (keyed by the prompt text)."""
    module = sys.modules["vlite.engine.output_processor"]
    module._INTERNED = _INTERNED
    _INTERNED.clear()
    make_output = engine.output_processor.make_output

    def intern(self, req):
        out = make_output(req)
        if out.finished:
            _INTERNED[sys.intern(out.prompt + "#" + out.request_id[::-1])] = "seen"
        return out

    engine.output_processor.make_output = types.MethodType(intern, engine.output_processor)
    return "vlite.engine.output_processor._INTERNED"


@pytest.mark.parametrize("plant", [_block_id_list, _tensor_cache, _interned_prompts])
def test_a_planted_host_leak_is_host_leak_named_by_its_container(tiny_checkpoint, plant):
    engine = make_engine(tiny_checkpoint, num_blocks=128)
    path = plant(engine)
    try:
        f = _run(engine).findings
    finally:
        sys.modules["vlite.engine.output_processor"].__dict__.pop("_INTERNED", None)
    assert not f.leak, f.summary()  # blocks and per-request state are clean
    assert f.verdict == "HOST-LEAK", (f.summary(), f.host_memory)
    assert [g["path"] for g in f.host_memory["growing"]] == [path]
    assert f.host_memory["growing"][0]["entries_per_request"] > 0.2
    assert path in f.summary()


def test_a_clean_run_has_no_host_leak(tiny_checkpoint):
    f = _run(make_engine(tiny_checkpoint, num_blocks=128)).findings
    assert f.verdict == "CLEAN", f.summary()
    assert f.host_memory["verdict"] in ("below threshold", "warm-up", "inconclusive") and f.host_memory["growing"] == []
    assert f.host_memory["n"] >= 8


def _points(sizes, anon):
    return [IdlePoint(float(i), 10 * i, 0, None, {"anon_swap_bytes": a, "containers": {"engine.cache": s}})
            for i, (s, a) in enumerate(zip(sizes, anon))]


def test_growth_that_levels_off_is_warm_up_and_growth_that_keeps_its_slope_is_a_leak():
    flat_late = [0, 40, 80, 100, 100, 101, 100, 101]  # a cache that fills, then stays
    steady = [0, 10, 20, 30, 40, 50, 60, 70]  # one entry per request, all run long
    mib = 2**20
    warm_anon = [100 * mib, 140 * mib, 170 * mib, 180 * mib, 180 * mib, 180 * mib + 4096, 180 * mib, 180 * mib + 4096]
    assert host_memory_check(_points(flat_late, warm_anon))["verdict"] == "warm-up"
    leak = host_memory_check(_points(steady, [100 * mib] * 8))
    assert leak["verdict"] == "HOST-LEAK" and leak["growing"][0]["entries_per_request"] == pytest.approx(1.0)
    anon_leak = host_memory_check(_points([5] * 8, [100 * mib + i * 10 * 256 * 1024 for i in range(8)]))
    assert anon_leak["verdict"] == "HOST-LEAK" and anon_leak["growing"] == []
    assert host_memory_check(_points(steady[:4], [0] * 4))["verdict"] == "too few idle points"
    # the default 60-request run's 5 idle points (the baseline and 4 waves): enough for a steady container
    assert host_memory_check(_points(steady[:5], [100 * mib] * 5))["verdict"] == "HOST-LEAK"
    assert host_memory_check(_points(flat_late[:5], [100 * mib] * 5))["verdict"] != "HOST-LEAK"


def test_a_container_below_the_cap_its_type_declares_is_bounded_not_a_leak():
    # vLLM's window of prefix-cache hit rates: a deque(maxlen=1000) that gains one entry per request
    # grows all through a run shorter than 1000 requests; its cap says where it stops
    from vlite.diagnostics.checks.host_memory import lines

    steady = [0, 10, 20, 30, 40, 50, 60, 70]
    pts = _points(steady, [100 * 2**20] * 8)
    for p in pts:
        p.host["caps"] = {"engine.cache": 1000}
    res = host_memory_check(pts)
    assert res["verdict"] != "HOST-LEAK" and res["growing"] == []
    assert res["bounded_caches"] == [{"path": "engine.cache", "entries_per_request": pytest.approx(1.0), "first": 0,
                                      "last": 70, "kind": "bounded-cache", "entries": 70, "declared_cap": 1000}]
    assert ("bounded container (not a leak): engine.cache grew 0 -> 70 entries (1.0 per request), below the cap its "
            "type declares, 1000: bounded at 1000") in lines(res)
    # a cap it has passed (a maxlen changed, a stale reading) bounds nothing: still a leak
    for p in pts:
        p.host["caps"] = {"engine.cache": 50}
    assert host_memory_check(pts)["verdict"] == "HOST-LEAK"


def test_plateau_test_fits_the_later_half():
    t = plateau_test([0, 1, 2, 3, 4, 5], [0, 5, 10, 10, 10, 10], 0.1)
    assert t["slope"] > 1 and t["late_slope"] == pytest.approx(0.0) and t["warm_up"] and not t["keeps_growing"]


def test_six_idle_points_are_enough_for_a_container_that_keeps_growing():
    # 6 idle points (120 requests): a 95% CI over the last 3 is too wide, steady growth is not
    mib = 2**20
    bursty = [67, 203, 325, 434, 553, 713]  # vllm#44175's list on the all-paths workload (entries)
    assert host_memory_check(_points(bursty, [100 * mib] * 6))["verdict"] == "HOST-LEAK"
    tapering = [0, 60, 90, 100, 103, 104]  # a cache filling up: late growth < 0.2 entries/request
    assert host_memory_check(_points(tapering, [100 * mib] * 6))["verdict"] != "HOST-LEAK"
    levelling = [0, 100, 200, 230, 235, 236]  # early growth that levels off in the later half
    assert host_memory_check(_points(levelling, [100 * mib] * 6))["verdict"] != "HOST-LEAK"


def test_trace_allocations_names_the_line_that_keeps_allocating(tiny_checkpoint):
    # A 4 KiB buffer per finished request, kept where no walk from the engine reaches it (a closure
    # cell): tracemalloc names the allocating line and its bytes per request; a clean run traced
    # the same way names no site in this file.
    engine = make_engine(tiny_checkpoint, num_blocks=128)
    processor, kept = engine.output_processor, []
    make_output = processor.make_output

    def keep(self, req):
        out = make_output(req)
        if out.finished:
            kept.append(bytearray(4096))  # the planted allocation
        return out

    processor.make_output = types.MethodType(keep, processor)
    f = run_in_process(engine, _specs(), max_concurrency=8, idle_every=6, sample_interval_s=0.05,
                       trace_allocations=True).findings
    trace = f.host_memory["allocation_sites"]
    top = trace["sites"][0]
    assert top["site"].endswith(f"test_host_memory.py:{keep.__code__.co_firstlineno + 3}"), trace
    served = trace["to_requests"] - trace["from_requests"]  # a quarter are aborted: no buffer for those
    assert top["bytes_per_request"] >= 0.5 * 4096 and top["count_diff"] >= 0.5 * served
    assert any("test_host_memory.py" in line for line in host_memory_lines(f.host_memory))

    clean = run_in_process(make_engine(tiny_checkpoint, num_blocks=128), _specs(), max_concurrency=8, idle_every=6,
                           sample_interval_s=0.05, trace_allocations=True).findings
    assert not any("test_host_memory.py" in s["site"] for s in clean.host_memory["allocation_sites"]["sites"])
    assert clean.verdict == "CLEAN", clean.summary()


def test_a_late_slope_whose_interval_straddles_the_threshold_is_inconclusive_not_levelled_off():
    # "late-half slope 132.1 KiB/request (95% CI -460.3 .. 724.5; a leak above 64 KiB/request)" must not
    # be followed by "growth within warm-up (it levelled off)": the run cannot tell
    mib = 2**20
    anon = [100 * mib, 140 * mib, 170 * mib, 180 * mib, 180 * mib, 181 * mib, 180 * mib, 181 * mib]
    result = host_memory_check(_points([5] * 8, anon))
    late = result["anon_swap"]["late_ci95"]
    assert late[0] < 64 * 1024 < late[1]
    assert result["verdict"] == "inconclusive"
    text = "\n".join(host_memory_lines(result))
    assert "inconclusive" in text and "straddles the 64 KiB/request threshold" in text and "levelled off" not in text
    # "levelled off" only where the interval lies below the threshold
    flat = [100 * mib, 140 * mib, 170 * mib, 180 * mib, 180 * mib, 180 * mib + 4096, 180 * mib, 180 * mib + 4096]
    warm = host_memory_check(_points([5] * 8, flat))
    assert warm["verdict"] == "warm-up" and warm["anon_swap"]["late_ci95"][1] < 64 * 1024
    assert "levelled off" in "\n".join(host_memory_lines(warm))


def _anon_points(anon, every=16, processes=None):
    """Idle points every ``every`` requests with anonymous memory ``anon`` (bytes) and no container growth."""
    return [IdlePoint(float(i), every * i, 0, None, {"anon_swap_bytes": a, "containers": {"engine.cache": 5},
                                                     **({"processes": processes[i]} if processes else {})})
            for i, a in enumerate(anon)]


_MIB, _KIB = 2**20, 1024
_NOISE = [(i % 2) * 50 * _KIB for i in range(16)]  # RssAnon jitters by pages between idle points


def test_one_step_then_flat_is_not_a_leak():
    # a clean run's RssAnon: 1040 MiB, one +67 MiB step (an arena that grew once), then flat; the
    # late half's fit reads the step as ~770 KiB/request with a CI above the threshold
    anon = [1040 * _MIB + n + (67 * _MIB if i > 10 else 0) for i, n in enumerate(_NOISE)]
    result = host_memory_check(_anon_points(anon))
    assert result["verdict"] == "one step", result
    step = result["anon_swap"]["step"]
    assert (step["from_requests"], step["to_requests"], step["after_points"]) == (160, 176, 5)
    assert step["after_ci95"][1] < 64 * _KIB
    text = "\n".join(host_memory_lines(result))
    assert "one step of +67.0 MiB between 160 and 176 requests served" in text and "HOST-LEAK" not in text


def test_a_step_then_steady_growth_is_a_leak_judged_after_the_step():
    anon = [1040 * _MIB + (30 * _MIB if i >= 2 else 0) + i * 16 * 200 * _KIB + n for i, n in enumerate(_NOISE[:10])]
    result = host_memory_check(_anon_points(anon))
    assert result["verdict"] == "HOST-LEAK"
    step = result["anon_swap"]["step"]
    assert step["to_requests"] == 32 and step["after_points"] == 8
    assert step["after_slope"] == pytest.approx(200 * _KIB, rel=0.05) and step["after_ci95"][0] > 64 * _KIB


def test_steady_growth_is_a_leak_with_no_step():
    anon = [1040 * _MIB + i * 16 * 200 * _KIB + n for i, n in enumerate(_NOISE[:8])]
    result = host_memory_check(_anon_points(anon))
    assert result["verdict"] == "HOST-LEAK" and result["anon_swap"]["step"] is None


def test_too_few_points_after_a_step_is_too_short_and_names_the_options():
    # the default run's 6 idle points (60 requests + 3 probes): +67 MiB over the last two intervals
    xs = [0, 16, 32, 48, 60, 63]
    anon = [1040 * _MIB, 1040 * _MIB + 40 * _KIB, 1041 * _MIB, 1041 * _MIB, 1074 * _MIB, 1107 * _MIB]
    pts = [IdlePoint(float(i), x, 0, None, {"anon_swap_bytes": a, "containers": {}}) for i, (x, a) in
           enumerate(zip(xs, anon))]
    result = host_memory_check(pts)
    assert result["verdict"] == "too short", result
    assert result["anon_swap"]["step"]["after_points"] < 4
    text = "\n".join(host_memory_lines(result))
    assert "too short to tell a one-time step from a leak" in text
    assert "--num-requests 95 --idle-every 16" in text and "needs 4" in text
    # a step at the end of a longer run: the same verdict, with the run's own spacing
    late = [1040 * _MIB + n + (67 * _MIB if i > 13 else 0) for i, n in enumerate(_NOISE)]
    assert "--num-requests 272 --idle-every 16" in "\n".join(host_memory_lines(host_memory_check(_anon_points(late))))


def test_a_step_in_one_tensor_parallel_worker_is_not_a_leak_of_that_rank():
    # -tp 2 on a loaded machine: tp_rank0 took one step, then stayed flat; the sum is flat otherwise
    rank0 = [300 * _MIB + n + (40 * _MIB if i > 10 else 0) for i, n in enumerate(_NOISE)]
    procs = [{"engine": 1000 * _MIB, "tp_rank0": r, "tp_rank1": 300 * _MIB} for r in rank0]
    result = host_memory_check(_anon_points([sum(p.values()) for p in procs], processes=procs))
    assert result["verdict"] == "one step", result
    assert not result["processes"]["tp_rank0"]["keeps_growing"] and result["processes"]["tp_rank0"]["step"]


def test_growth_still_settling_over_few_idle_points_is_too_short_not_a_leak():
    """The bare command's 5 idle points on a clean tree: anonymous memory rising at a falling rate
    per request (allocator warm-up) fits a narrow late-half slope over 3 points; that is no HOST-LEAK,
    and the verdict names the rerun that gives 8 idle points."""
    xs = [0, 19, 35, 51, 63]
    anon = [int(v * 2**20) for v in (1029.5, 1092.9, 1123.0, 1149.1, 1167.9)]
    pts = [types.SimpleNamespace(requests_completed=x, host={"anon_swap_bytes": a, "containers": {}})
           for x, a in zip(xs, anon)]
    result = host_memory_check(pts)
    assert result["verdict"] == "too short", result
    text = "\n".join(host_memory_lines(result))
    assert "too short to tell warm-up from a leak" in text and "--num-requests 111 --idle-every 16" in text
    falling = [int(v * 2**20) for v in (1000, 1100, 1180, 1240, 1285, 1320, 1345, 1362)]
    pts = [types.SimpleNamespace(requests_completed=16 * i, host={"anon_swap_bytes": a, "containers": {}})
           for i, a in enumerate(falling)]
    result = host_memory_check(pts)
    assert result["verdict"] == "too short" and "growth per request fell at every idle point" in "\n".join(
        host_memory_lines(result)), result


def _series(start_mib: float, rises_mib: list[float], every: int) -> list[types.SimpleNamespace]:
    anon, pts = start_mib * _MIB, []
    for i, rise in enumerate([0.0, *rises_mib]):
        anon += rise * _MIB
        pts.append(types.SimpleNamespace(requests_completed=every * i,
                                         host={"anon_swap_bytes": int(anon), "containers": {}}))
    return pts


def test_growth_in_shrinking_steps_flat_between_them_is_not_a_leak():
    """`--workload kind-waves` on a clean tree: each logprobs wave doubles a buffer (+49.6, +47.4,
    +23.7, +11.9 MiB), flat between (~25 KiB/request); the fit after the first step reads that as
    ~1 MiB/request with a CI above the threshold."""
    rises = [0.59, 0.12, 0.11, 49.61, 47.35, 0.05, 0.05, 0.05, 0.07, 0.11, 23.68, 0.04, 0.03, 0.05, 0.07, 0.05,
             11.88, 0.02, 0.05, 0.05, 0.08, 0.05, 0.05, 0.03, 0.05, 0.04, 0.07, 0.09, 0.06, 0.02]
    result = host_memory_check(_series(1450.8, rises, 2))
    assert result["verdict"] == "steps", result
    steps = result["anon_swap"]["steps"]
    assert steps["median_rate"] < 64 * _KIB and len(steps["rises"]) == 3
    text = "\n".join(host_memory_lines(result))
    assert "grows in steps, flat between them: rises of +47.4, +23.7, +11.9 MiB" in text and "HOST-LEAK" not in text


def test_equal_steps_now_and_then_are_a_leak_of_some_requests():
    """One request kind in five leaks 8 MiB: steps of one size every fifth interval, flat between,
    the median interval below the threshold; the steps keep their size, so it is a leak."""
    rises = [8.0 if i % 5 == 4 else 0.05 for i in range(30)]
    result = host_memory_check(_series(1000.0, rises, 2))
    assert result["verdict"] == "HOST-LEAK", result
    assert result["anon_swap"]["steps"] is None


def test_a_step_then_growth_falling_over_few_points_is_too_short():
    """The replay of 120 requests on a clean tree: +76 MiB in the first interval, then a buffer that
    doubles at a falling rate (+47, +22, +11, +0.3 MiB) over 5 idle points: the fit after the step
    lies above the threshold, but 5 points are too few for a slope over the later half of them."""
    pts = _series(421.5, [76.03, 47.12, 22.05, 10.64, 0.27], 24)
    result = host_memory_check(pts)
    assert result["verdict"] == "too short", result
    assert result["anon_swap"]["settling"]["after_step"]
    assert "5 idle points after the one-time step" in "\n".join(host_memory_lines(result))


def test_a_later_half_growing_just_below_the_threshold_is_not_called_levelled_off():
    """kind-waves on a clean tree: the later half grows 48 KiB/request (95% CI 47 .. 50), the whole
    run faster: below the threshold, but not levelled off, and the line says so with its numbers."""
    rises = [60.0, 30.0, 20.0, 10.0] + [0.094] * 12  # MiB per 2 requests: 48 KiB/request late
    result = host_memory_check(_series(1000.0, rises, 2))
    assert result["verdict"] == "warm-up", result
    text = "\n".join(host_memory_lines(result))
    assert "levelled off" not in text and "growth slowed past warm-up to 48.1 KiB/request" in text, text


@pytest.mark.parametrize("host_verdict, says", [
    ("too short", "host memory: no verdict, the run is too short"),
    ("inconclusive", "host memory: no verdict, its growth cannot be told from noise in this run"),
    ("warm-up", None), ("below threshold", None),
])
def test_a_clean_verdict_says_when_host_memory_gave_none(host_verdict, says):
    from vlite.diagnostics.checks.detect import DrainCheck, Findings

    drain = DrainCheck(39, 9, 30, 0, 0, 0, 0, "balanced", True)
    f = Findings(drain, [], [], [], [], [], [], {"num_leftover_entries": 0}, 0, True,
                 host_memory={"verdict": host_verdict, "growing": []})
    line = f.summary()
    assert line.startswith("CLEAN: drain invariant holds (9 free + 30 cached == 39 total blocks)"), line
    assert (says in line) if says else ("host memory" not in line), line
