"""The C++ CPU paged decode kernel against the torch path, and how attention.py falls back."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine

from vlite.engine.sampling_params import SamplingParams
from vlite.kernels import attention, cpu_attention, cpu_extension, fused_ops, torch_ref
from vlite.kernels.attention import AttentionMetadata


@pytest.fixture(scope="module")
def kernel():
    module = cpu_attention.load()
    assert module is not None, "the C++ CPU attention kernel must build on this machine (g++, ninja)"
    return module


def _decode_case(seed: int, lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
    """Random caches, scattered block tables (padded with 0), one query per sequence."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + 1  # one spare column of padding
    num_blocks = len(lens) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long),
                             query_start_loc=torch.arange(len(lens) + 1), seq_lens=torch.tensor(lens),
                             block_tables=tables, num_decodes=len(lens), query_lens=[1] * len(lens),
                             seq_lens_list=lens, block_size=block_size)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("lens,num_heads,num_kv_heads,head_dim,block_size", [
    ([1, 2, 15, 16, 17, 33, 100], 9, 3, 64, 16),   # SmolLM2's heads; lengths around block edges
    ([5], 4, 4, 32, 8),                            # one sequence, no GQA
    ([300, 7, 64, 129], 8, 1, 128, 16),            # 8 query heads per KV head, long context
    ([40, 41, 3], 4, 2, 16, 4),                    # the tiny test model's heads, small blocks
])
def test_kernel_equals_torch_path(kernel, lens, num_heads, num_kv_heads, head_dim, block_size):
    q, k_cache, v_cache, meta = _decode_case(len(lens), lens, num_heads, num_kv_heads, head_dim, block_size)
    assert cpu_attention.supports(q, k_cache)
    scale = head_dim ** -0.5
    expected = torch_ref._decode_attention(q, k_cache, v_cache, meta, scale)
    poisoned = k_cache.clone()
    for i, n in enumerate(lens):  # tokens past each sequence's length must not be read
        tail = meta.block_tables[i, (n - 1) // block_size]
        poisoned[tail, (n - 1) % block_size + 1:] = float("nan")
    out = cpu_attention.paged_decode(q, poisoned, v_cache, meta.block_tables, meta.seq_lens, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens,num_heads,num_kv_heads,head_dim,block_size", [
    ([1, 2, 15, 16, 17, 33, 100], 9, 3, 64, 16),
    ([300, 7, 64, 129], 8, 1, 128, 16),
    ([40, 41, 3, 77], 4, 2, 48, 8),   # head_dim 48: the path without VDPBF16PS; 8-token blocks
])
def test_bfloat16_kernel_equals_float32_math_on_the_same_values(kernel, lens, num_heads, num_kv_heads, head_dim,
                                                                block_size):
    """bfloat16 in, float32 sums inside: the result is the float32 attention of the bfloat16
    values, rounded once to bfloat16 (at most half a bfloat16 ulp away, rtol 2**-8)."""
    q, k_cache, v_cache, meta = _decode_case(7, lens, num_heads, num_kv_heads, head_dim, block_size)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    assert cpu_attention.supports(q, k_cache)
    scale = head_dim ** -0.5
    exact = torch_ref._decode_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    # the unused slots of each last block may be read (AMX loads whole 16-slot tiles) but never count
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    for i, n in enumerate(lens):
        tail = meta.block_tables[i, (n - 1) // block_size]
        poisoned_k[tail, (n - 1) % block_size + 1:] = float("nan")
        poisoned_v[tail, (n - 1) % block_size + 1:] = float("inf")
    out = cpu_attention.paged_decode(q, poisoned_k, poisoned_v, meta.block_tables, meta.seq_lens, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), exact, rtol=2 ** -8, atol=1e-6)
    # and it is closer to the exact result than the torch path computed in bfloat16
    torch_bf16 = torch_ref._decode_attention(q, k_cache, v_cache, meta, scale).float()
    assert (out.float() - exact).abs().mean() <= (torch_bf16 - exact).abs().mean()


def test_supports_only_what_the_kernel_takes():
    q = torch.zeros(2, 9, 64)
    cache = torch.zeros(4, 16, 3, 64)
    assert cpu_attention.supports(q, cache)
    assert cpu_attention.supports(q.bfloat16(), cache.bfloat16())
    assert not cpu_attention.supports(q.half(), cache.half())  # float32 and bfloat16 only
    assert not cpu_attention.supports(q, cache.bfloat16())  # query and cache alike
    assert not cpu_attention.supports(torch.zeros(2, 9, 24), torch.zeros(4, 16, 3, 24))  # head_dim % 16
    assert not cpu_attention.supports(torch.zeros(2, 16, 64), torch.zeros(4, 16, 1, 64))  # 16 heads per KV head
    assert not cpu_attention.supports(q, cache.transpose(1, 2).contiguous().transpose(1, 2))  # not contiguous


def test_engine_uses_the_kernel_and_matches_the_torch_path(kernel, tiny_checkpoint, monkeypatch):
    # the Python loop over the layers calls the kernel through cpu_attention (counted here); the
    # C++ layer loop calls the same kernel from C++ (tests/engine/test_cpu_layer_loop.py)
    monkeypatch.setenv("VLITE_CPU_LAYER_LOOP", "python")
    calls = []
    real = cpu_attention.paged_decode
    monkeypatch.setattr(cpu_attention, "paged_decode", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    prompts = ["Hello there", "A paged KV cache splits each sequence into blocks", "1 2 3 4 5 6 7 8 9"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    monkeypatch.delenv("VLITE_ATTENTION_BACKEND", raising=False)
    engine = make_engine(tiny_checkpoint)
    prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in prompts)
    with_kernel = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    # per layer: the prefill step's rows (short prompts: one row per prompt token), then the 11
    # decode steps' rows (one per sequence)
    layers = engine.model.num_layers
    assert calls == [prompt_tokens] * layers + [len(prompts)] * (11 * layers)
    calls.clear()
    monkeypatch.setenv("VLITE_ATTENTION_BACKEND", "torch")
    torch_only = [o.outputs[0].token_ids for o in make_engine(tiny_checkpoint).generate(prompts, params)]
    assert not calls
    assert with_kernel == torch_only


def test_without_the_kernel_the_torch_path_runs(tiny_checkpoint, monkeypatch):
    """A machine without a compiler: load() returns None, decodes and the fused ops stay on torch."""
    monkeypatch.delenv("VLITE_ATTENTION_BACKEND", raising=False)
    monkeypatch.setitem(cpu_extension._state, "module", None)
    assert attention.prepare_backend("cpu") == "torch"
    assert fused_ops.ops_for(torch.zeros(1, 64), 64, 16, 128).name == "torch"
    out = make_engine(tiny_checkpoint).generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(RuntimeError, match="not loaded"):
        cpu_attention.paged_decode(torch.zeros(1, 4, 16), torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16),
                                   torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 0.25)


MIXED_LAYOUT = [(1, 37), (1, 5), (20, 50), (13, 13), (70, 70)]  # (query_len, seq_len), decodes first


def _mixed_step(block_size: int = 16, seed: int = 0, layout=MIXED_LAYOUT, num_decodes: int = 2):
    """A step of 2 decodes, a chunk with a cached prefix, a fresh prompt and a long fresh prompt:
    caches hold every token's K/V (this step's included, as after rotary_store)."""
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    tables, used = [], 0
    max_blocks = max(-(-n // block_size) for _, n in layout)
    num_blocks = sum(-(-n // block_size) for _, n in layout) + 2
    perm = torch.randperm(num_blocks, generator=g).tolist()
    for _, n in layout:
        nb = -(-n // block_size)
        tables.append(perm[used:used + nb] + [0] * (max_blocks - nb))
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    slots, q_lens = [], [q for q, _ in layout]
    for (q_len, n), table in zip(layout, tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - q_len, n)]
    slot_t = torch.tensor(slots)
    key = k_cache.view(-1, num_kv_heads, head_dim)[slot_t]
    value = v_cache.view(-1, num_kv_heads, head_dim)[slot_t]
    query = torch.randn(len(slots), num_heads, head_dim, generator=g)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(slot_mapping=slot_t, query_start_loc=torch.tensor(qsl),
                             seq_lens=torch.tensor([n for _, n in layout]), block_tables=torch.tensor(tables),
                             num_decodes=num_decodes, query_lens=q_lens, seq_lens_list=[n for _, n in layout],
                             block_size=block_size)
    return query, key, value, k_cache, v_cache, meta


@pytest.mark.parametrize("max_context", [1024, 60, 0])
def test_prefill_rows_through_the_kernel_equal_the_torch_path(kernel, monkeypatch, max_context):
    """Chunks up to KERNEL_PREFILL_MAX_CONTEXT go through the decode kernel row by row (each
    query token over its causal prefix), longer ones through SDPA; the result is the same."""
    query, key, value, k_cache, v_cache, meta = _mixed_step()
    scale = 64 ** -0.5
    expected = torch_ref.paged_attention(query, key, value, k_cache, v_cache, meta, scale)
    calls = []
    monkeypatch.setattr(torch_ref, "KERNEL_PREFILL_MAX_CONTEXT", max_context)
    meta.plan_cache.clear()

    def counted(q, *rest):
        calls.append(q.shape[0])
        return cpu_attention.paged_decode(q, *rest)

    out = torch_ref.paged_attention(query, key, value, k_cache, v_cache, meta, scale, decode_attention=counted)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    taken = {1024: 1 + 1 + 20 + 13 + 70, 60: 1 + 1 + 20 + 13, 0: 2}[max_context]
    assert calls == [taken]


def test_a_step_with_only_long_prefill_chunks_never_calls_the_kernel(kernel, monkeypatch):
    """No row qualifies (no decodes, every chunk longer than the limit): SDPA does it all."""
    query, key, value, k_cache, v_cache, meta = _mixed_step(layout=[(20, 50), (70, 70)], num_decodes=0)
    scale = 64 ** -0.5
    expected = torch_ref.paged_attention(query, key, value, k_cache, v_cache, meta, scale)
    monkeypatch.setattr(torch_ref, "KERNEL_PREFILL_MAX_CONTEXT", 10)
    meta.plan_cache.clear()
    calls = []
    out = torch_ref.paged_attention(query, key, value, k_cache, v_cache, meta, scale,
                                    decode_attention=lambda q, *rest: calls.append(q.shape[0]))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert calls == []


def test_a_long_prompt_alone_goes_through_sdpa_and_matches_the_torch_path(kernel, tiny_checkpoint, monkeypatch):
    """One prompt longer than KERNEL_PREFILL_MAX_CONTEXT (lowered to 100: the tiny model takes
    512 tokens) prefills alone (no decode rows, no short chunk), then decodes through the
    kernel; greedy tokens equal the torch path's."""
    monkeypatch.setattr(torch_ref, "KERNEL_PREFILL_MAX_CONTEXT", 100)
    prompt = [(7 * i) % 200 + 3 for i in range(300)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    monkeypatch.delenv("VLITE_ATTENTION_BACKEND", raising=False)
    with_kernel = make_engine(tiny_checkpoint).generate([prompt], params)[0].outputs[0].token_ids
    monkeypatch.setenv("VLITE_ATTENTION_BACKEND", "torch")
    torch_only = make_engine(tiny_checkpoint).generate([prompt], params)[0].outputs[0].token_ids
    assert len(with_kernel) == 4 and with_kernel == torch_only


def test_the_kernels_build_with_the_venvs_ninja_whichever_shell_runs(monkeypatch, tmp_path):
    # with and without an activated venv, PATH finds different ninja versions, each of which reads
    # the other's .ninja_log as stale and rebuilds the kernels; the build pins the venv's one
    import os
    import sys

    from vlite.kernels import cpu_extension

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "ninja").write_text("")
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with cpu_extension._venv_ninja_first():
        assert os.environ["PATH"].split(os.pathsep)[0] == str(venv / "bin")
    assert os.environ["PATH"] == "/usr/bin:/bin"
    (venv / "bin" / "ninja").unlink()  # a venv without its own ninja: PATH is left alone
    with cpu_extension._venv_ninja_first():
        assert os.environ["PATH"] == "/usr/bin:/bin"
