"""The C++ fused elementwise ops (CppOps) against their torch reference (TorchOps)."""

from __future__ import annotations

import pytest
import torch

from vlite.kernels import cpu_extension, fused_ops
from vlite.kernels.fused_ops import CppOps, TorchOps

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def cpp() -> CppOps:
    module = cpu_extension.load()
    assert module is not None, "the C++ CPU kernels must build on this machine (g++, ninja)"
    return CppOps(module)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in units in the last place of their dtype."""
    assert a.dtype == b.dtype and a.shape == b.shape
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    ia, ib = a.view(bits).long(), b.view(bits).long()
    # map the sign-magnitude floats onto one ordered integer line
    sign_bit = 1 << (8 * a.element_size() - 1)
    ia = torch.where(ia < 0, -(ia + sign_bit), ia)
    ib = torch.where(ib < 0, -(ib + sign_bit), ib)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (300, 576)])  # 300 rows: several threads
def test_rms_norm_and_residual_add(cpp, dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    assert _ulps(cpp.rms_norm(x, weight, 1e-5), TorchOps.rms_norm(x, weight, 1e-5)) <= 8

    x_ref, res_ref = x.clone(), residual.clone()
    TorchOps.fused_add_rms_norm(x_ref, res_ref, weight, 1e-5)
    cpp.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, res_ref)  # the add rounds exactly as torch's
    # only the float32 sum of squares runs in another order: the scale differs in its last bit
    assert _ulps(x, x_ref) <= 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 16), (5, 1536), (40, 1536)])
def test_silu_and_mul(cpp, dtype, rows, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and signed zero
    out = cpp.silu_and_mul(gate_up)
    ref = TorchOps.silu_and_mul(gate_up)
    assert out.shape == (rows, inter) and out.dtype == dtype
    assert _ulps(out, ref) <= 4  # Cephes' exp here, Sleef's in torch
    assert torch.equal(out[0, :4], ref[0, :4])  # -0.0 where exp overflows, as torch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,num_heads,num_kv_heads,head_dim", [
    (1, 9, 3, 64),     # SmolLM2, one decode row
    (37, 9, 3, 64),
    (300, 4, 2, 16),   # the tests' tiny model: half a head is not a whole vector
    (5, 8, 8, 128),
])
def test_rotary_store_equals_torch(cpp, dtype, tokens, num_heads, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    block_size, num_blocks = 16, tokens // 16 + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[0] = -1  # a padding row: must not be written
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]

    q, k, v = cpp.rotary_store(qkv, cos, sin, slots, *caches, num_heads, num_kv_heads)
    q_ref, k_ref, v_ref = TorchOps.rotary_store(qkv, cos, sin, slots, *ref_caches, num_heads, num_kv_heads)
    # the same multiplies and add, rounded the same way: equal bit for bit
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])


def test_rotary_store_refuses_a_slot_past_the_cache(cpp):
    qkv = torch.randn(2, 3 * 32)
    cos = sin = torch.ones(2, 32)
    caches = [torch.zeros(1, 16, 1, 32) for _ in range(2)]
    with pytest.raises(RuntimeError, match="past the cache"):
        cpp.rotary_store(qkv, cos, sin, torch.tensor([0, 16]), *caches, 1, 1)
    assert not caches[0].any()  # checked before anything is written


def test_ops_for_picks_cpp_only_where_it_applies(cpp, monkeypatch):
    x = torch.zeros(2, 576)
    assert fused_ops.ops_for(x, 576, 64, 1536).name == "cpp"
    assert fused_ops.ops_for(x.half(), 576, 64, 1536).name == "torch"  # float16: not taken
    assert fused_ops.ops_for(torch.zeros(2, 40), 40, 20, 96).name == "torch"  # hidden % 16
    monkeypatch.setenv("VLITE_FUSED_OPS", "torch")
    assert fused_ops.ops_for(x, 576, 64, 1536).name == "torch"
    monkeypatch.setenv("VLITE_FUSED_OPS", "fast")
    with pytest.raises(ValueError, match="VLITE_FUSED_OPS must be one of"):
        fused_ops.ops_for(x, 576, 64, 1536)


def test_a_bad_vlite_fused_ops_fails_at_engine_start(tiny_checkpoint, monkeypatch):
    from conftest import make_engine

    monkeypatch.setenv("VLITE_FUSED_OPS", "bogus")
    with pytest.raises(ValueError, match="VLITE_FUSED_OPS must be one of"):
        make_engine(tiny_checkpoint)
