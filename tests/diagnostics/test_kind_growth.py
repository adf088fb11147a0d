"""Host memory per process and per request kind: a native leak that only one
request kind takes is named by that kind and the process; warm-up and too few intervals are
said as such, never guessed; a worker that grows alone is named by its rank."""

from __future__ import annotations

import random

from conftest import make_engine

from vlite.diagnostics.checks.host_memory import host_memory_check
from vlite.diagnostics.checks.host_memory import lines as host_memory_lines
from vlite.diagnostics.checks.kind_growth import KIND_SLOPE_BYTES, kind_fit, request_kind, served_by_point
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.kind_waves import KINDS, kind_wave_size, kind_waves_workload
from vlite.diagnostics.workload.replay import IdlePoint
from vlite.diagnostics.workload.sources import RequestSpec

MIB = 1 << 20


def _waves(rounds: int, wave: int, per_kind: dict[str, float], noise: float = 200e3, first_cost: float = 0.0,
           seed: int = 0):
    """Cumulative served counts and one process's memory at the idle points of ``rounds`` rounds of
    one-kind waves: each request of kind k adds per_kind[k] bytes; each kind's first wave adds
    ``first_cost`` more (warm-up); every idle point gets Gaussian noise (bytes)."""
    rng = random.Random(seed)
    served, memory, total, counts = [dict.fromkeys(KINDS, 0)], [100.0 * MIB], 100.0 * MIB, dict.fromkeys(KINDS, 0)
    for r in range(rounds):
        for k in KINDS:
            counts[k] += wave
            total += wave * per_kind.get(k, 0.0) + (first_cost if r == 0 else 0.0)
            served.append(dict(counts))
            memory.append(total + rng.gauss(0, noise))
    return served, memory


def test_a_leak_in_one_kind_is_attributed_to_that_kind_only():
    served, memory = _waves(4, 3, {"logprobs": MIB}, first_cost=8 * MIB)
    fit = kind_fit(served, memory)
    assert fit["status"] == "fitted" and fit["intervals"] == 12 and fit["dof"] == 6
    lp = fit["kinds"]["logprobs"]
    assert lp["verdict"] == "grows" and lp["ci95"][0] < MIB < lp["ci95"][1] and lp["requests"] == 6
    # every kind's 8 MiB first wave (and its second) is warm-up: left out, so no other kind is blamed
    assert {k for k, v in fit["kinds"].items() if v["verdict"] == "grows"} == {"logprobs"}


def test_a_clean_process_grows_with_no_kind():
    served, memory = _waves(4, 3, {}, first_cost=4 * MIB)
    fit = kind_fit(served, memory)
    assert fit["status"] == "fitted"
    assert all(v["verdict"] != "grows" for v in fit["kinds"].values())
    assert all(v["ci95"][0] < KIND_SLOPE_BYTES for v in fit["kinds"].values())


def test_mixed_waves_too_few_for_the_kinds_are_not_identifiable():
    # five waves, each of every kind: the kinds always come together
    served = [dict.fromkeys(KINDS, 0)]
    for _ in range(5):
        served.append({k: served[-1][k] + 2 for k in KINDS})
    fit = kind_fit(served, [float(i * MIB) for i in range(6)])
    assert fit["status"] == "not identifiable" and fit["kinds"] == {}


def test_served_counts_a_request_at_the_first_idle_point_after_its_end():
    got = served_by_point([10.0, 20.0, 30.0], [("plain", 5.0), ("beam", 15.0), ("beam", 20.0), ("aborted", None)])
    assert [(g["plain"], g["beam"], g["aborted"]) for g in got] == [(1, 0, 0), (1, 2, 0), (1, 2, 0)]


def test_request_kind_precedence():
    def spec(**kw):
        return RequestSpec("r", 0.0, "p", 4, 4, **kw)

    assert request_kind(spec()) == "plain"
    assert request_kind(spec(n=2)) == "n>1"
    assert request_kind(spec(beam_width=2)) == "beam"
    assert request_kind(spec(logprobs=1, n=2)) == "logprobs"
    assert request_kind(spec(extra_params={"prompt_logprobs": 0})) == "logprobs"
    assert request_kind(spec(extra_params={"structured_outputs": {"regex": "a+"}}, logprobs=1)) == "structured"
    assert request_kind(spec(action=ClientAction("abort-after-tokens", after_tokens=2), beam_width=2)) == "aborted"


def test_kind_waves_are_one_kind_each_in_rounds():
    specs = kind_waves_workload(60, input_len=(4, 8), output_len=(4, 8))
    wave = kind_wave_size(60)
    assert wave == 2 and len(specs) == 5 * len(KINDS) * wave == 60
    waves = [specs[i:i + wave] for i in range(0, len(specs), wave)]
    assert [request_kind(w[0]) for w in waves] == list(KINDS) * 5
    assert {(s.prompt_len, s.max_tokens) for s in specs if request_kind(s) == "logprobs"} == {(8, 8)}
    assert all(len({request_kind(s) for s in w}) == 1 for w in waves)


def _points(per_process: dict[str, list[float]]):
    n = len(next(iter(per_process.values())))
    return [IdlePoint(float(i), i * 10, 0, None, {"anon_swap_bytes": sum(v[i] for v in per_process.values()),
                                                  "containers": {},
                                                  "processes": {k: v[i] for k, v in per_process.items()}})
            for i in range(n)]


def test_a_worker_that_keeps_growing_is_named_by_its_rank():
    rng = random.Random(1)
    engine = [200 * MIB + rng.gauss(0, 3 * MIB) for _ in range(8)]  # noisy: the sum's CI is wide
    rank0 = [150 * MIB + rng.gauss(0, 20e3) for _ in range(8)]
    rank1 = [150 * MIB + i * 10 * 256 * 1024 + rng.gauss(0, 20e3) for i in range(8)]  # 256 KiB per request
    result = host_memory_check(_points({"engine": engine, "tp_rank0": rank0, "tp_rank1": rank1}))
    assert result["verdict"] == "HOST-LEAK"
    assert not result["anon_swap"]["keeps_growing"]  # the sum alone would not tell
    assert [n for n, t in result["processes"].items() if t["keeps_growing"]] == ["tp_rank1"]
    assert any(line.startswith("HOST-LEAK: host memory of tp_rank1") for line in host_memory_lines(result))


def test_host_memory_check_names_the_kind_and_process():
    served, memory = _waves(4, 3, {"logprobs": MIB})
    points = [IdlePoint(float(i), sum(s.values()), 0, None, {"anon_swap_bytes": m, "containers": {},
                                                            "processes": {"engine": m}})
              for i, (s, m) in enumerate(zip(served, memory))]
    result = host_memory_check(points, served)
    assert result["verdict"] == "HOST-LEAK"
    grow = result["kind_growth"]["growing"]
    assert [(g["process"], g["kind"]) for g in grow] == [("engine", "logprobs")]
    assert any("per logprobs request" in line for line in host_memory_lines(result))


def test_in_process_run_reads_every_process_and_fits_per_kind(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=96, block_size=4)
    from vlite.diagnostics.targets.inprocess import run_in_process

    specs = kind_waves_workload(24, input_len=(4, 10), output_len=(4, 6))
    assert len(specs) == 48  # 4 rounds of 6 one-kind waves of 2
    run = run_in_process(engine, specs, max_concurrency=8, idle_every=kind_wave_size(24), sample_interval_s=0.1)
    assert run.info["processes"] == {"engine": __import__("os").getpid()}
    assert all(set(p.host["processes"]) == {"engine"} for p in run.replay.idle_points)
    fit = run.findings.host_memory["kind_growth"]["processes"]["engine"]
    assert fit["status"] == "fitted" and set(fit["kinds"]) == set(KINDS)
    assert not run.findings.leak, run.findings.summary()


def test_a_one_off_jump_is_uneven_not_a_leak():
    # the allocator's high-water mark: one logprobs wave grows 13 MiB (a longer prompt's logits), the others not
    served, memory = _waves(5, 3, {}, noise=30e3)
    jump_at = 3 * len(KINDS) + KINDS.index("logprobs") + 1  # its fourth wave (the second one fitted)
    memory = [m + (13 * MIB if i >= jump_at else 0) for i, m in enumerate(memory)]
    fit = kind_fit(served, memory)
    lp = fit["kinds"]["logprobs"]
    assert lp["ci95"][0] > KIND_SLOPE_BYTES  # the CI alone would call it a leak
    assert lp["verdict"] == "uneven" and lp["intervals_alone"] == 3 and lp["intervals_below"] == 2
    assert host_memory_check([IdlePoint(float(i), sum(s.values()), 0, None, {"anon_swap_bytes": m, "containers": {},
                                                                             "processes": {"engine": m}})
                              for i, (s, m) in enumerate(zip(served, memory))], served)["kind_growth"]["growing"] == []
