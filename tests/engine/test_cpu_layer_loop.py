"""The decoder layers as one C++ call per step (vlite/engine/worker/models/cpu_layer_loop.py) against the
Python loop over the same kernels: the same hidden states and KV caches bit for bit, and which
models and steps it takes."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model_dir, make_engine

from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.loader import load_checkpoint
from vlite.engine.worker.model_runner import StepInput
from vlite.kernels import cpu_gemm, torch_ref


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory):
    # Qwen2: q/k/v biases, which the loop passes to the packed GEMM
    return load_checkpoint(str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2")))


def _engine_with_loop(checkpoint, dtype: str = "float32"):
    """An engine on ``checkpoint`` whose model has the loop, or None on a CPU where vlite's packed
    GEMM does not run ``dtype`` (then, as asserted, the engine builds no loop and every step runs
    the Python loop)."""
    engine = make_engine(checkpoint, dtype=dtype)
    if not cpu_gemm.available(getattr(torch, dtype)):
        assert engine.model.cpu_layer_loop is None
        return None
    assert engine.model.cpu_layer_loop is not None
    return engine


def _random_step(runner, layout, seed: int = 0) -> StepInput:
    """A step of ``layout`` [(query_len, seq_len)], decodes first, over random blocks whose
    earlier tokens' K/V are random values already in the caches."""
    g = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    num_blocks = runner.kv_caches[0][0].shape[0]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    for k_cache, v_cache in runner.kv_caches:
        k_cache.copy_(torch.randn(k_cache.shape, generator=g).to(k_cache.dtype))
        v_cache.copy_(torch.randn(v_cache.shape, generator=g).to(v_cache.dtype))
    ids, positions, slots, tables, used = [], [], [], [], 0
    for q_len, n in layout:
        nb = -(-n // bs)
        table = perm[used:used + nb]
        used += nb
        tables.append(table)
        positions += list(range(n - q_len, n))
        slots += [table[p // bs] * bs + p % bs for p in range(n - q_len, n)]
        ids += torch.randint(3, 200, (q_len,), generator=g).tolist()
    num_decodes = sum(1 for q, _ in layout if q == 1)
    logits_indices = list(torch.cumsum(torch.tensor([q for q, _ in layout]), 0) - 1)
    return StepInput(ids, positions, slots, tables, [q for q, _ in layout], [n for _, n in layout], num_decodes,
                     [int(i) for i in logits_indices], [])


def _forward(runner, step: StepInput, use_loop: bool):
    """Hidden states and every layer's caches after the step, through the loop or the Python loop
    (from the same caches: each run starts from a copy)."""
    saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    loop = runner.model.cpu_layer_loop
    if not use_loop:
        runner.model.cpu_layer_loop = None
    try:
        input_ids, positions, meta, _ = runner.build_metadata(step)
        with torch.inference_mode():
            hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
        caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    finally:
        runner.model.cpu_layer_loop = loop
        for (k, v), (k0, v0) in zip(runner.kv_caches, saved):
            k.copy_(k0)
            v.copy_(v0)
    return hidden, caches


# decode steps, and decodes with prefill chunks (fresh and with a cached prefix), all short enough
# for the decode kernel
LAYOUTS = [[(1, 37), (1, 5), (1, 16), (1, 200)], [(1, 37), (1, 5), (20, 50), (13, 13), (70, 70)], [(33, 33)]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loop_equals_the_python_loop_bit_for_bit(tiny_checkpoint, qwen2_checkpoint, dtype, arch, layout):
    engine = _engine_with_loop(tiny_checkpoint if arch == "llama" else qwen2_checkpoint, dtype)
    if engine is None:
        return
    runner = engine.model_runner
    step = _random_step(runner, layout)
    loop_hidden, loop_caches = _forward(runner, step, use_loop=True)
    py_hidden, py_caches = _forward(runner, step, use_loop=False)
    assert loop_hidden.dtype == getattr(torch, dtype) and loop_hidden.shape == (len(step.input_ids), 64)
    assert torch.equal(loop_hidden, py_hidden)
    for (k, v), (k_ref, v_ref) in zip(loop_caches, py_caches):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    # and the step did write this step's K/V: the caches moved from the random ones
    assert not torch.equal(loop_caches[0][0], runner.kv_caches[0][0])


def test_loop_runs_the_step_and_python_is_not_called(tiny_checkpoint, monkeypatch):
    engine = _engine_with_loop(tiny_checkpoint)
    if engine is None:
        return
    called = []
    monkeypatch.setattr(type(engine.model.layers[0]), "forward", lambda *a: called.append(1))
    step = _random_step(engine.model_runner, LAYOUTS[0])
    hidden, _ = _forward(engine.model_runner, step, use_loop=True)
    assert not called and torch.isfinite(hidden).all()


def test_a_long_prefill_chunk_runs_the_python_loop(tiny_checkpoint, monkeypatch):
    """A chunk longer than the kernel's prefill limit needs SDPA: the loop declines the step
    (returns None) and the Python loop runs it."""
    engine = _engine_with_loop(tiny_checkpoint)
    if engine is None:
        return
    runner = engine.model_runner
    monkeypatch.setattr(torch_ref, "KERNEL_PREFILL_MAX_CONTEXT", 40)
    step = _random_step(runner, [(1, 37), (50, 50)])
    _, _, meta, _ = runner.build_metadata(step)
    assert runner.model.cpu_layer_loop.forward(torch.zeros(51, 64), torch.zeros(51, 16), torch.zeros(51, 16),
                                               runner.kv_caches, meta) is None
    layer_calls = []
    real = type(runner.model.layers[0]).forward
    monkeypatch.setattr(type(runner.model.layers[0]), "forward", lambda *a: layer_calls.append(1) or real(*a))
    hidden, _ = _forward(runner, step, use_loop=True)
    assert len(layer_calls) == runner.model.num_layers and hidden.shape == (51, 64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_equal_with_and_without_the_loop(tiny_checkpoint, monkeypatch, dtype):
    prompts = ["Hello there", "A paged KV cache splits each sequence into blocks", "1 2 3 4 5 6 7 8 9"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    monkeypatch.delenv("VLITE_CPU_LAYER_LOOP", raising=False)
    engine = _engine_with_loop(tiny_checkpoint, dtype)
    if engine is None:
        return
    with_loop = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    monkeypatch.setenv("VLITE_CPU_LAYER_LOOP", "python")
    engine = make_engine(tiny_checkpoint, dtype=dtype)
    assert engine.model.cpu_layer_loop is None
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == with_loop


@pytest.mark.parametrize("env,cpu_gemm_choice", [({"VLITE_ATTENTION_BACKEND": "torch"}, None),
                                                 ({"VLITE_FUSED_OPS": "torch"}, None), ({}, "onednn")])
def test_no_loop_where_a_step_would_not_call_the_same_kernels(tiny_checkpoint, monkeypatch, env, cpu_gemm_choice):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    engine = make_engine(tiny_checkpoint, cpu_gemm=cpu_gemm_choice)
    assert engine.model.cpu_layer_loop is None
    out = engine.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_bad_switch_fails_at_start(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("VLITE_CPU_LAYER_LOOP", "cpp")
    with pytest.raises(ValueError, match=r"VLITE_CPU_LAYER_LOOP must be one of \('auto', 'python'\), got 'cpp'"):
        make_engine(tiny_checkpoint)
