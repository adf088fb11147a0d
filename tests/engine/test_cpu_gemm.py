"""The CPU linear layers: vlite's packed kernels and oneDNN on prepacked weights against F.linear
and float64, and how the engine picks among them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_model_dir, make_engine

from vlite.engine.config import EngineConfig
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.loader import load_checkpoint
from vlite.engine.worker.models import linear as linear_mod
from vlite.engine.worker.models.linear import Linear, onednn_gemm_available, resolve_cpu_gemm_backend
from vlite.kernels import cpu_gemm


def test_this_torch_has_onednn():
    # the default CPU path depends on it; if a torch upgrade drops it, say so here first
    assert onednn_gemm_available()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_prepacked_linear_equals_f_linear(dtype, tol, rows):
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=True, dtype=dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(rows, 96, dtype=dtype)
    expected = F.linear(x.double(), weight.double(), bias.double())
    if not onednn_gemm_available(dtype):  # bfloat16 on a CPU without AVX-512 BW/VL/DQ (Zen 3): torch's op refuses
        with pytest.raises(RuntimeError, match="bf16"):
            layer.prepack_onednn()
        return
    layer.prepack_onednn()
    assert layer.weight is None and layer.packed_weight is not None  # the plain weight is not kept twice
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (rows, 160) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    # the error is that of an ordinary float32 GEMM, not of a reduced-precision one
    if dtype == torch.float32 and rows:
        mkl_err = (F.linear(x, weight, bias).double() - expected).abs().max().item()
        assert (out.double() - expected).abs().max().item() <= 10 * mkl_err + 1e-6


VLITE_SHAPES = [(160, 96), (1000, 97), (48, 64), (17, 32)]  # out, in: N past a panel edge, odd K, N < 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 16, 17, 33, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_vlite_packed_linear_against_float64(dtype, rows, bias):
    if not cpu_gemm.available(dtype):  # a CPU without AVX-512 (float32) or AMX (bfloat16): refused, with why
        with pytest.raises(RuntimeError, match="no packed GEMM|could not be built"):
            cpu_gemm.pack(torch.zeros(32, 32, dtype=dtype))
        with pytest.raises(ValueError, match="'vlite' cannot run"):
            resolve_cpu_gemm_backend("vlite", dtype)
        return
    for out_features, in_features in VLITE_SHAPES:
        if dtype == torch.bfloat16 and in_features % 32:
            with pytest.raises(RuntimeError, match="multiple of 32"):
                cpu_gemm.pack(torch.zeros(out_features, in_features, dtype=dtype))
            continue
        torch.manual_seed(rows * 7 + in_features)
        layer = Linear(in_features, out_features, bias=bias, dtype=dtype)
        weight = layer.weight.detach().clone()
        b = layer.bias.detach().clone() if bias else None
        x = torch.randn(rows, in_features, dtype=dtype)
        expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
        layer.prepack("vlite")
        assert layer.weight is None and layer.packed_by == "vlite"
        with torch.inference_mode():
            out = layer(x)
        assert out.shape == (rows, out_features) and out.dtype == dtype
        if not rows:
            continue
        err = (out.double() - expected).abs()
        if dtype == torch.float32:  # an ordinary float32 GEMM's error, not a reduced-precision one's
            mkl_err = (F.linear(x, weight, b).double() - expected).abs().max().item()
            assert err.max().item() <= 10 * mkl_err + 1e-6
        else:  # exact bf16 products, float32 sums, one rounding: within one bfloat16 ulp (2^-7 relative)
            ulp = expected.abs().clamp_min(1e-30).log2().floor().exp2() / 128
            assert bool((err <= ulp + 1e-4).all()), err.max().item()


def test_vlite_linear_keeps_leading_dims_and_is_deterministic():
    layer = Linear(64, 100, bias=False)
    if not cpu_gemm.available(torch.float32):  # no AVX-512 here: the layer refuses to pack, and says why
        with pytest.raises(RuntimeError, match="no packed GEMM|could not be built"):
            layer.prepack("vlite")
        assert layer.weight is not None and layer.packed_by is None
        return
    weight = layer.weight.detach().clone()
    layer.prepack("vlite")
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        out = layer(x)
        assert out.shape == (3, 5, 100)
        assert torch.equal(out, layer(x))  # same bits every call: no race between the threads' shares
        # each row's result does not depend on the other rows in the call (batch invariance)
        assert torch.equal(out[1, 2], layer(x[1, 2:3])[0])
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_keep_weight_and_cpu_only():
    layer = Linear(8, 4, bias=False)
    layer.prepack_onednn(keep_weight=True)
    assert layer.weight is not None and layer.weight.shape == (4, 8)
    meta = Linear(8, 4, bias=False, device="meta")
    with pytest.raises(RuntimeError, match="needs CPU weights"):
        meta.prepack_onednn()


@pytest.mark.parametrize("backend", ["onednn", "vlite"])
@pytest.mark.parametrize("tied", [True, False])
def test_engine_prepacks_every_linear_and_keeps_a_tied_embedding(tmp_path, tied, backend):
    ckpt = load_checkpoint(str(build_tiny_model_dir(tmp_path, "llama", tie_word_embeddings=tied)))
    if backend == "vlite" and not cpu_gemm.available(torch.float32):  # no AVX-512: refused at start, with why
        with pytest.raises(ValueError, match="'vlite' cannot run float32 weights here"):
            make_engine(ckpt, cpu_gemm=backend)
        return
    model = make_engine(ckpt, cpu_gemm=backend).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.num_layers + 1
    assert all(m.packed_weight is not None and m.packed_by == backend for m in linears)
    assert model.tie_word_embeddings is tied
    if tied:  # the embedding still needs the shared plain weight
        assert model.lm_head.weight is model.embed_tokens.weight
    assert all(m.weight is None for m in linears if not (tied and m is model.lm_head))
    plain = make_engine(ckpt, cpu_gemm="torch")
    assert plain.cpu_gemm == "torch"
    assert all(m.packed_weight is None and m.weight is not None
               for m in plain.model.modules() if isinstance(m, Linear))


def test_bfloat16_backend_follows_the_cpu(monkeypatch, tmp_path):
    monkeypatch.delenv("VLITE_CPU_GEMM", raising=False)
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert onednn_gemm_available(torch.bfloat16) is supported
    amx = cpu_gemm.available(torch.bfloat16)
    assert resolve_cpu_gemm_backend(None, torch.bfloat16) == ("vlite" if amx else "onednn" if supported else "torch")
    # a CPU without AMX: "auto" takes oneDNN; an explicit "vlite" is refused there
    monkeypatch.setattr(linear_mod.cpu_gemm, "available", lambda dtype: dtype == torch.float32)
    assert resolve_cpu_gemm_backend(None, torch.bfloat16) == ("onednn" if supported else "torch")
    with pytest.raises(ValueError, match="'vlite' cannot run bfloat16 weights here.*AMX"):
        resolve_cpu_gemm_backend("vlite", torch.bfloat16)
    # nor oneDNN bfloat16: "auto" falls back, an explicit "onednn" is refused before any prepacking
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert resolve_cpu_gemm_backend(None, torch.bfloat16) == "torch"
    assert resolve_cpu_gemm_backend(None, torch.float32) == "vlite"
    with pytest.raises(ValueError, match="cannot run bfloat16 weights here.*AVX-512"):
        resolve_cpu_gemm_backend("onednn", torch.bfloat16)
    # and a bfloat16 engine on "auto" starts and generates there
    ckpt = load_checkpoint(str(build_tiny_model_dir(tmp_path, "llama")))
    engine = make_engine(ckpt, dtype="bfloat16")
    assert engine.cpu_gemm == "torch"
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5


def test_backend_choice_and_bad_names(monkeypatch):
    monkeypatch.delenv("VLITE_CPU_GEMM", raising=False)
    assert resolve_cpu_gemm_backend(None) == ("vlite" if cpu_gemm.available(torch.float32) else "onednn")
    monkeypatch.setattr(linear_mod.cpu_gemm, "available", lambda dtype: False)  # no AVX-512, or no compiler
    assert resolve_cpu_gemm_backend(None) == "onednn"
    assert resolve_cpu_gemm_backend("torch") == "torch"
    monkeypatch.setenv("VLITE_CPU_GEMM", "torch")
    assert resolve_cpu_gemm_backend(None) == "torch"
    assert resolve_cpu_gemm_backend("onednn") == "onednn"  # an explicit choice wins over the variable
    monkeypatch.setenv("VLITE_CPU_GEMM", "mkl")
    with pytest.raises(ValueError, match="VLITE_CPU_GEMM must be one of"):
        resolve_cpu_gemm_backend(None)
    with pytest.raises(ValueError, match="cpu_gemm must be"):
        EngineConfig(cpu_gemm="blas")


def test_bad_attention_backend_variable_fails_at_engine_start(monkeypatch, tiny_checkpoint):
    monkeypatch.setenv("VLITE_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match="VLITE_ATTENTION_BACKEND must be one of"):
        make_engine(tiny_checkpoint)
    monkeypatch.setenv("VLITE_ATTENTION_BACKEND", "torch")
    assert make_engine(tiny_checkpoint).generate(["Hi"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
