"""The CPU-testable parts of the CUDA path: decode-graph buckets and padding, and the KV-cache
budget arithmetic of ``--gpu-memory-utilization`` (with torch.cuda's memory queries faked).
Capture and replay themselves need a GPU (benchmarks/gpu/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine

from vlite.engine.core.sched_output import ScheduledSequence, SchedulerOutput
from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.cuda_graphs import DecodeGraphRunner, decode_buckets, pick_bucket


def test_decode_buckets():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(128) == [1, 2, 4, 8] + list(range(16, 129, 8))
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_pick_bucket_is_smallest_that_fits():
    buckets = decode_buckets(40)
    assert [pick_bucket(buckets, n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 40)] == [1, 2, 4, 8, 8, 16, 16, 24, 40]
    assert pick_bucket(buckets, 41) is None


def test_padded_bucket_gives_the_unpadded_hidden_states_and_leaves_the_cache_alone(tiny_checkpoint):
    """A 3-sequence decode run through the bucket-4 buffers (what a graph replays, here run
    eagerly on CPU) gives the eager step's hidden states; the padded row writes no K/V."""
    engine = make_engine(tiny_checkpoint, num_blocks=32, block_size=4, max_num_seqs=6, max_model_len=64)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for n in (5, 9, 2):
        engine.add_request(None, params, prompt_token_ids=list(range(100, 100 + n)))
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    sched = engine.scheduler.schedule()  # the next step: three decodes (their slots allocated)
    assert [item.num_new_tokens for item in sched.scheduled] == [1, 1, 1]
    input_ids, positions, meta, _ = engine.model_runner.prepare(sched, engine.scheduler.kv_cache_manager.block_tables)
    assert meta.num_decodes == 3
    runner = engine.model_runner
    graphs = DecodeGraphRunner(runner.model, runner.kv_caches, engine.block_size, max_num_seqs=6,
                               max_model_len=64, device=torch.device("cpu"))
    assert graphs.can_run(meta)
    with torch.inference_mode():
        caches_before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        eager = runner.model(input_ids, positions, runner.kv_caches, meta).clone()
        caches_eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        for (k, v), (k0, v0) in zip(runner.kv_caches, caches_before):  # undo the eager step's writes
            k.copy_(k0)
            v.copy_(v0)
        padded = graphs.run(input_ids, positions, meta)
    assert padded.shape == eager.shape
    assert torch.allclose(padded, eager, rtol=1e-5, atol=1e-5)
    # the same K/V were written (up to float32 rounding: a 4-row matmul may block differently),
    # and nothing anywhere else: the padded row (slot -1) wrote nothing
    others = torch.ones(runner.kv_caches[0][0].shape[:2], dtype=torch.bool).flatten()
    others[meta.slot_mapping] = False
    for (k, v), (ke, ve), (k0, v0) in zip(runner.kv_caches, caches_eager, caches_before):
        assert torch.allclose(k, ke, rtol=1e-5, atol=1e-5) and torch.allclose(v, ve, rtol=1e-5, atol=1e-5)
        assert torch.equal(k.flatten(0, 1)[others], k0.flatten(0, 1)[others])
        assert torch.equal(v.flatten(0, 1)[others], v0.flatten(0, 1)[others])
        assert not torch.equal(k.flatten(0, 1)[meta.slot_mapping], k0.flatten(0, 1)[meta.slot_mapping])
    # the buffers hold the bucket's padding
    assert graphs.slot_mapping[3].item() == -1 and graphs.seq_lens[3].item() == 0
    assert graphs.seq_lens[:3].tolist() == meta.seq_lens.tolist()


def test_can_run_only_pure_decode_batches_that_fit(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=32, block_size=4, max_num_seqs=4, max_model_len=64)
    runner = engine.model_runner
    graphs = DecodeGraphRunner(runner.model, runner.kv_caches, 4, max_num_seqs=4, max_model_len=64,
                               device=torch.device("cpu"))
    seq = Sequence("r", None, list(range(10, 17)), SamplingParams(max_tokens=2), RequestOrigin("r"))
    sched = SchedulerOutput(0, [ScheduledSequence(seq, 7, True)])
    _, _, prefill_meta, _ = runner.prepare(sched, {seq.seq_id: [0, 1]})
    assert not graphs.can_run(prefill_meta)


def test_gpu_memory_utilization_budget_subtracts_peak_and_non_torch_memory(tiny_checkpoint, monkeypatch):
    """budget = utilization * total - torch peak - memory outside torch's allocator."""
    gib = 1 << 30
    fake = {"total": 80 * gib, "free": 60 * gib, "reserved": 15 * gib, "peak": 12 * gib}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: fake["peak"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: fake["reserved"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (fake["free"], fake["total"]))
    engine = make_engine(tiny_checkpoint, num_blocks=8)
    budget = engine.model_runner.profile_cuda_budget(0.9, 16, 64)  # runs the profile forward on CPU
    non_torch = (80 - 60 - 15) * gib  # CUDA context, workspaces, other processes
    assert budget == int(0.9 * 80 * gib) - 12 * gib - non_torch
