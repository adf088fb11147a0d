"""The CPU linear layers: oneDNN on prepacked weights against F.linear, and how the engine picks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_tiny_model_dir, make_engine

from vlite.engine.config import EngineConfig
from vlite.engine.loader import load_checkpoint
from vlite.engine.models.linear import Linear, onednn_gemm_available, resolve_cpu_gemm_backend
from vlite.engine.sampling_params import SamplingParams


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


def test_keep_weight_and_cpu_only():
    layer = Linear(8, 4, bias=False)
    layer.prepack_onednn(keep_weight=True)
    assert layer.weight is not None and layer.weight.shape == (4, 8)
    meta = Linear(8, 4, bias=False, device="meta")
    with pytest.raises(RuntimeError, match="needs CPU weights"):
        meta.prepack_onednn()


@pytest.mark.parametrize("tied", [True, False])
def test_engine_prepacks_every_linear_and_keeps_a_tied_embedding(tmp_path, tied):
    ckpt = load_checkpoint(str(build_tiny_model_dir(tmp_path, "llama", tie_word_embeddings=tied)))
    model = make_engine(ckpt, cpu_gemm="onednn").model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * model.num_layers + 1
    assert all(m.packed_weight is not None for m in linears)
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
    assert resolve_cpu_gemm_backend(None, torch.bfloat16) == ("onednn" if supported else "torch")
    # a CPU without oneDNN bfloat16: "auto" falls back, an explicit "onednn" is refused before any prepacking
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert resolve_cpu_gemm_backend(None, torch.bfloat16) == "torch"
    assert resolve_cpu_gemm_backend(None, torch.float32) == "onednn"
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
