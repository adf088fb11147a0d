"""Tensor parallelism over torch.distributed (gloo on CPU): sharding rules, token-for-token
parity with one rank, per-rank weight memory, and what happens when a rank fails or cannot start.

Every engine here spawns real worker processes (``MultiprocExecutor``); they are shut down by
each test, and the fault tests check that none is left behind.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from conftest import build_tiny_model_dir, make_engine
from test_engine_hf_parity import SMOL_PROMPTS

from vlite.engine.core.sequence import FinishReason
from vlite.engine.llm_engine import EngineDeadError
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.executor import ExecutorStartupError, WorkerFailedError
from vlite.engine.worker.loader import load_checkpoint
from vlite.engine.worker.models.parallel_layers import TPGroup, check_tp_size, partition_heads, shard_range

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TINY_PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7] * 9, list(range(2000, 2019))]


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


# ---- sharding rules (no processes) ----------------------------------------------------------

def test_smollm2_heads_split_over_3_but_not_2():
    check_tp_size(3, 9, 3, 1536)  # 3 query heads and 1 KV head per rank
    with pytest.raises(ValueError) as err:
        check_tp_size(2, 9, 3, 1536)
    msg = str(err.value)
    assert "\n" not in msg
    assert "9 attention heads are not divisible by 2" in msg
    assert "3 KV heads neither divide nor are divisible by 2" in msg
    assert msg.endswith("sizes that work: 1, 3")  # 9 would not divide the intermediate size 1536


def test_kv_heads_split_or_replicated():
    # 8 query heads, 4 KV heads over 2 ranks: split
    assert [partition_heads(8, 4, TPGroup(r, 2)) for r in range(2)] == [
        partition_heads(8, 4, TPGroup(0, 2)).__class__(0, 4, 0, 2),
        partition_heads(8, 4, TPGroup(0, 2)).__class__(4, 4, 2, 2)]
    # 8 query heads, 2 KV heads over 4 ranks: each KV head on 2 ranks, matching its query group
    parts = [partition_heads(8, 2, TPGroup(r, 4)) for r in range(4)]
    assert [(p.q_start, p.num_q, p.kv_start, p.num_kv) for p in parts] == [(0, 2, 0, 1), (2, 2, 0, 1),
                                                                           (4, 2, 1, 1), (6, 2, 1, 1)]
    for p in parts:  # GQA: query head h reads KV head h // (8 / 2)
        assert {h // 4 for h in range(p.q_start, p.q_start + p.num_q)} == {p.kv_start}


def test_vocab_shards_pad_the_last_rank():
    assert [shard_range(10, TPGroup(r, 3)) for r in range(3)] == [(0, 4, 4), (4, 8, 4), (8, 10, 4)]
    assert shard_range(10, TPGroup()) == (0, 10, 10)


def test_engine_refuses_a_size_that_cannot_split_smollm2(smollm2_checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel_size 2 cannot split this model"):
        make_engine(smollm2_checkpoint, tensor_parallel_size=2)


# ---- parity ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny4_checkpoint(tmp_path_factory):
    """A tiny random Llama with 4 query and 4 KV heads (so 2 ranks split the KV heads)."""
    return load_checkpoint(str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny4kv"), num_key_value_heads=4)))


def _tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


TP2_ENGINE = dict(num_blocks=64, block_size=4, max_num_batched_tokens=24)


@pytest.fixture(scope="class")
def tp2_engine(tiny4_checkpoint):
    """One 2-rank engine shared by the tests of ``TestTwoRanks`` (each start costs seconds);
    stopped when the class ends, so its workers do not add to later tests' memory."""
    engine = make_engine(tiny4_checkpoint, tensor_parallel_size=2, **TP2_ENGINE)
    pids = engine.executor.worker_pids()
    yield engine
    engine.shutdown()
    assert _gone(pids)


class TestTwoRanks:
    def test_tp2_tiny_llama_equals_one_rank_and_halves_the_weights(self, tiny4_checkpoint, tp2_engine):
        params = [GREEDY] * len(TINY_PROMPTS) + [SamplingParams(max_tokens=8, n=3, temperature=0.9, seed=5)]
        prompts = TINY_PROMPTS + [[11, 12, 13, 14, 15, 16, 17]]  # n = 3 forks: copy-on-write on every rank
        one = make_engine(tiny4_checkpoint, **TP2_ENGINE)
        expected = _tokens(one.generate(prompts, params))
        two = tp2_engine
        pids = two.executor.worker_pids()
        assert len(pids) == 2 and os.getpid() not in pids
        assert _tokens(two.generate(prompts, params)) == expected
        assert two.stats().num_used_blocks == 0  # every block came back (free or cached)
        assert two.stats().coverage.copy_on_write > 0  # forks wrote into shared blocks: copies ran on both ranks
        # each rank holds about half of the weights (only the norms are replicated)
        full = one.executor.weight_bytes[0]
        halves = two.executor.weight_bytes
        assert all(0.49 * full < b < 0.51 * full for b in halves), (full, halves)
        # each rank's KV cache holds its 2 of the 4 KV heads: a block costs the same in total
        assert two.bytes_per_block == one.bytes_per_block

    def test_prompt_logprobs_under_tp_equal_one_rank(self, tiny4_checkpoint, tp2_engine):
        # the prompt rows' logits are gathered on every rank (a collective); rank 0 reduces them
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
        prompt = list(range(20, 50))  # 30 tokens: chunked over the 24-token step budget
        expected = make_engine(tiny4_checkpoint, **TP2_ENGINE).generate([prompt], params)[0].prompt_logprobs
        got = tp2_engine.generate([prompt], params)[0].prompt_logprobs
        assert got[0] is None and len(got) == len(expected) == len(prompt)
        for want, have in zip(expected[1:], got[1:]):
            assert want.keys() == have.keys()
            for tid in want:
                assert abs(want[tid].logprob - have[tid].logprob) < 1e-4
                # top-k ranks agree; a prompt token deep in the tiny model's near-flat 49,152-way
                # distribution can swap places with a neighbour within the split sums' rounding
                top_k = want[tid].rank <= params.prompt_logprobs
                assert want[tid].rank == have[tid].rank or (not top_k and abs(want[tid].rank - have[tid].rank) <= 5)

    def test_leak_check_under_tp_is_clean_and_samples_every_worker(self, tp2_engine):
        from vlite.diagnostics.targets.inprocess import run_in_process
        from vlite.diagnostics.workload.sources import synthetic_workload

        specs = synthetic_workload(12, input_len=(8, 30), output_len=(4, 10), abort_rate=0.5, abort_mode="mix", seed=3)
        run = run_in_process(tp2_engine, specs, max_concurrency=8, idle_every=4, sample_interval_s=0.05)
        assert not run.findings.leak, run.findings.summary()
        assert run.info["tensor_parallel_size"] == 2
        assert run.info["worker_pids"] == tp2_engine.executor.worker_pids()
        samples = run.samples
        assert (samples["num_processes"] == 3).all()  # the engine process and its 2 workers
        assert (samples["worker_rss_bytes"] > 50 << 20).all()  # each worker holds torch and its shard
        assert (samples["rss_bytes"] > samples["worker_rss_bytes"]).all()  # the sum includes the engine process

    def test_leak_check_censuses_inside_every_worker(self, tp2_engine):
        """Per-request state that only a worker process holds is a LEAK, named by
        its container and rank; each rank's memory is read at every idle point."""
        from vlite.diagnostics.targets.inprocess import run_in_process
        from vlite.diagnostics.workload.sources import synthetic_workload
        from vlite.engine.core.sequence import SeqId

        specs = synthetic_workload(8, input_len=(8, 20), output_len=(4, 6), seed=4)
        # each rank's own map, keyed by a request id and by a sequence id that will have ended
        # (worker_main calls any Worker method by name: here setattr, from the engine's side)
        tp2_engine.executor.collective_rpc("__setattr__", "per_request", {specs[0].request_id: b"x", SeqId(10**9): 1})
        try:
            run = run_in_process(tp2_engine, specs, max_concurrency=4, idle_every=4, sample_interval_s=0.1)
        finally:
            tp2_engine.executor.collective_rpc("__delattr__", "per_request")
        f = run.findings
        pids = tp2_engine.executor.worker_pids()
        held = {h["path"]: h for h in f.census["held"]}
        assert set(held) == {"tp_rank0:worker.per_request", "tp_rank1:worker.per_request"}, f.census["held"]
        assert held["tp_rank1:worker.per_request"]["request_ids"] == [specs[0].request_id, f"seq {10**9}"]
        assert held["tp_rank1:worker.per_request"]["process"] == f"tp_rank1 (pid {pids[1]})"
        assert [w["pid"] for w in f.census["workers"]] == pids
        assert f.leak and "tp_rank1:worker.per_request" in f.summary()
        assert run.info["processes"] == {"engine": os.getpid(), "tp_rank0": pids[0], "tp_rank1": pids[1]}
        for p in run.replay.idle_points:  # each process's memory, and each worker's containers, by rank
            assert set(p.host["processes"]) == {"engine", "tp_rank0", "tp_rank1"}
            assert all(v > 10 << 20 for v in p.host["processes"].values())
            assert p.host["containers"]["tp_rank1:worker.per_request"] == 2


def test_tp3_smollm2_equals_one_rank_with_preemption_and_chunked_prefill(smollm2_checkpoint):
    """8 prompts of 5-31 tokens in one batch; 14 blocks of 16 tokens force preemption, a 48-token
    budget forces chunked prefill. N = 3: 3 query heads and 1 KV head per rank."""
    kw = dict(num_blocks=14, max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    one = make_engine(smollm2_checkpoint, **kw)
    expected = _tokens(one.generate(SMOL_PROMPTS, params))
    del one  # its 0.5 GB model before 3 workers start (make test stays under 4 GB)
    gc.collect()
    three = make_engine(smollm2_checkpoint, tensor_parallel_size=3, **kw)
    chunks = []  # prefill chunks that stop short of the prompt's end
    schedule = three.scheduler.schedule

    def spy():
        out = schedule()
        chunks.extend(item for item in out.scheduled if not item.sample)
        return out

    three.scheduler.schedule = spy
    try:
        got = _tokens(three.generate(SMOL_PROMPTS, params))
        stats = three.stats()
    finally:
        three.shutdown()
    assert chunks, "the 48-token budget was meant to force chunked prefill"
    assert stats.num_preemptions_total > 0, "the small cache was meant to force preemption"
    assert got == expected


# ---- faults ---------------------------------------------------------------------------------

def test_killed_worker_ends_requests_with_an_error_naming_its_rank(tiny4_checkpoint):
    engine = make_engine(tiny4_checkpoint, num_blocks=40, block_size=4, tensor_parallel_size=2)
    pids = engine.executor.worker_pids()
    try:
        ids = [engine.add_request(None, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                                  prompt_token_ids=p) for p in TINY_PROMPTS[:3]]
        for _ in range(3):
            engine.step()
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        finals = {o.request_id: o for o in engine.step()}
        assert time.monotonic() - t0 < 10
        assert set(finals) == set(ids)
        for out in finals.values():
            assert out.finished and out.outputs[0].finish_reason == FinishReason.ERROR.value
        assert "tensor-parallel rank 1" in engine.dead_error and "died" in engine.dead_error and "SIGKILL" in engine.dead_error
        assert not engine.has_unfinished_requests()
        assert engine.stats().num_used_blocks == 0
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.add_request(None, GREEDY, prompt_token_ids=[1, 2, 3])
    finally:
        engine.shutdown()
    assert _gone(pids), "a worker outlived the failure"


def test_raising_worker_ends_the_engine_without_a_hang(tiny4_checkpoint, monkeypatch):
    """Rank 1 raises in its 2nd step while rank 0 waits in an all-reduce: the engine stops both."""
    monkeypatch.setenv("VLITE_TEST_WORKER_FAULT", "raise:1:2")
    engine = make_engine(tiny4_checkpoint, num_blocks=40, block_size=4, tensor_parallel_size=2)
    pids = engine.executor.worker_pids()
    try:
        t0 = time.monotonic()
        outs = engine.generate(TINY_PROMPTS[:2], GREEDY)
        assert time.monotonic() - t0 < 20
        assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
        assert "rank 1" in engine.dead_error and "planted test fault" in engine.dead_error
        with pytest.raises(WorkerFailedError):
            engine.executor.execute(None)
    finally:
        engine.shutdown()
    assert _gone(pids)


def test_startup_failures_are_one_line(tiny4_checkpoint, tmp_path, monkeypatch):
    import socket

    with socket.socket() as busy:  # the rendezvous port is taken
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("VLITE_DIST_PORT", str(busy.getsockname()[1]))
        with pytest.raises(ExecutorStartupError) as err:
            make_engine(tiny4_checkpoint, tensor_parallel_size=2)
    assert "\n" not in str(err.value) and "VLITE_DIST_PORT" in str(err.value)
    monkeypatch.delenv("VLITE_DIST_PORT")
    # a shard that cannot load: the weights file is cut short
    bad = load_checkpoint(str(tiny4_checkpoint.path))
    bad.path = tmp_path
    for f in tiny4_checkpoint.path.iterdir():
        data = f.read_bytes()
        (tmp_path / f.name).write_bytes(data[:len(data) // 3] if f.suffix == ".safetensors" else data)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ExecutorStartupError) as err:
        make_engine(bad, tensor_parallel_size=2)
    msg = str(err.value)
    assert "\n" not in msg and "failed to start" in msg and "safetensors" in msg, msg
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert _gone(list(left))


def test_workers_exit_when_the_engine_process_is_killed(tiny4_checkpoint, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__) + '/..'!r})
        from conftest import make_engine
        from vlite.engine.worker.loader import load_checkpoint
        if __name__ == "__main__":
            engine = make_engine(load_checkpoint({str(tiny4_checkpoint.path)!r}), tensor_parallel_size=2)
            print(*engine.executor.worker_pids(), flush=True)
            time.sleep(120)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        proc.kill()  # SIGKILL: no cleanup runs in the engine process
        proc.wait(10)
        assert _gone(pids, within=5), "workers outlived their engine process"
    finally:
        proc.kill()
        proc.wait(10)


def test_ray_backend_without_ray_is_a_one_line_error(tiny4_checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, installed or not
    with pytest.raises(ExecutorStartupError) as err:
        make_engine(tiny4_checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert str(err.value) == ("distributed_executor_backend 'ray' needs Ray, which is an optional extra: "
                              "pip install 'vlite[ray]' (or use the default backend 'mp' on one host)")
