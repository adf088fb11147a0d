"""benchmarks/gpu/gpu_e2e.py's teacher-forced parity check (run on the GPU by gpu_check.sh), on the CPU:
it passes on vlite's real output and fails when the output is not transformers' argmax."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "gpu_e2e.py"


@pytest.fixture(scope="module")
def gpu_e2e():
    spec = importlib.util.spec_from_file_location("gpu_e2e", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parity_passes_on_vlites_greedy_tokens(gpu_e2e, tiny_model_dir):
    result = gpu_e2e.parity(str(tiny_model_dir), "float32", "cpu", True, num_prompts=3, prompt_len=10, max_tokens=6,
                            tolerance=None, seed=1)
    assert result["pass"] and result["tokens"] == 18 and result["equal_to_argmax"] == 18
    assert result["largest_relative_gap"] == 0.0 and result["cuda_graphs"] is False


def test_parity_fails_when_a_token_is_not_the_argmax(gpu_e2e, tiny_model_dir, monkeypatch):
    from vlite.engine.llm_engine import LLMEngine

    real = LLMEngine.generate

    def off_by_one(self, *args, **kwargs):  # the last token of every output replaced by another one
        outs = real(self, *args, **kwargs)
        for o in outs:
            ids = o.outputs[0].token_ids
            ids[-1] = (ids[-1] + 1) % self.hf_config.vocab_size
        return outs

    monkeypatch.setattr(LLMEngine, "generate", off_by_one)
    result = gpu_e2e.parity(str(tiny_model_dir), "float32", "cpu", True, num_prompts=2, prompt_len=10, max_tokens=4,
                            tolerance=None, seed=1)
    assert not result["pass"] and result["equal_to_argmax"] == 6 and result["largest_relative_gap"] > 0
    # a tolerance far below the gap fails too
    result = gpu_e2e.parity(str(tiny_model_dir), "float32", "cpu", True, num_prompts=2, prompt_len=10, max_tokens=4,
                            tolerance=1e-6, seed=1)
    assert not result["pass"]
