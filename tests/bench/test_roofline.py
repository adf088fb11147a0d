"""vlite.bench.roofline: the bytes and FLOPs it counts equal what real models hold and compute."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vlite.bench.roofline import LLAMA_3_2_1B, ModelShape, roofline


def _hf_model(tied: bool, dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tied,
                         attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_equal_a_transformers_models_parameter_bytes(tied):
    model = _hf_model(tied)
    shape = ModelShape.from_config(model.config, "bfloat16")
    assert shape.weight_bytes() == sum(p.numel() * p.element_size() for p in model.parameters())
    assert shape.num_params() == sum(p.numel() for p in model.parameters())


def test_kv_bytes_per_token_equal_what_vlites_kv_cache_allocates():
    from vlite.engine.worker.model_runner import kv_cache_bytes_per_block
    from vlite.engine.worker.models.llama import LlamaForCausalLM

    config = _hf_model(True).config
    with torch.device("meta"):
        model = LlamaForCausalLM(config, 64)
    shape = ModelShape.from_config(config, "bfloat16")
    assert shape.kv_bytes_per_token() * 16 == kv_cache_bytes_per_block(model, 16, torch.bfloat16)


def test_prefill_flops_equal_the_matmuls_transformers_runs():
    """A float32 transformers forward over 2 prompts of 12 tokens, logits of the last token only:
    its linear-layer FLOPs (aten.mm/addmm) equal the count's linear + lm_head part, and its
    eager attention (aten.bmm, every (query, key) pair) equals the count's causal pairs scaled
    to all L x L pairs."""
    model = _hf_model(False, torch.float32)
    shape = ModelShape.from_config(model.config, "float32")
    b, length = 2, 12
    ids = torch.randint(0, 320, (b, length))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids, logits_to_keep=1)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm"))
    attention = sum(n for op, n in counts.items() if op == "aten.bmm")
    counted = shape.prefill_flops(b, length)
    causal = 4 * b * length * (length + 1) // 2 * shape.num_heads * shape.head_dim * shape.num_layers
    assert linear == counted - causal
    assert attention == causal * 2 * length // (length + 1)


def test_roofline_sums_decode_steps_and_waves_by_hand():
    shape = ModelShape(64, 2, 4, 2, 16, 128, 100, True, 2)
    w, kv = shape.weight_bytes(), shape.kv_bytes_per_token()
    bound = roofline(shape, num_prompts=5, input_len=10, output_len=3, max_num_seqs=2, bandwidth_bytes_per_s=1e9,
                     matmul_flops_per_s=1e12)
    # waves of 2, 2 and 1 sequences; 2 decode steps each, over 11 then 12 tokens per sequence
    expected = sum(2 * w + kv * n * (11 + 12) for n in (2, 2, 1))
    assert bound.decode_bytes == expected
    assert bound.prefill_flops == 2 * shape.prefill_flops(2, 10) + shape.prefill_flops(1, 10)
    assert bound.decode_s == pytest.approx(expected / 1e9)
    assert bound.output_tokens_per_s == pytest.approx(15 / (expected / 1e9 + bound.prefill_flops / 1e12))
    assert bound.fraction(bound.output_tokens_per_s / 2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        roofline(shape, 0, 10, 3, 2, 1e9, 1e12)


def test_issue_31_figures_for_the_1b_shape():
    """2.15 GB of weights and 32 KB of KV per token; at the H200's measured 4,251 GB/s and
    790 TFLOP/s the ceiling for 256 x (256 in, 256 out) is near 130k output tokens/s."""
    assert LLAMA_3_2_1B.weight_bytes() == pytest.approx(2.15e9, rel=0.01)
    assert LLAMA_3_2_1B.kv_bytes_per_token() == 32 * 1024
    bound = roofline(LLAMA_3_2_1B, 256, 256, 256, 256, 4251e9, 790e12)
    assert 125_000 < bound.output_tokens_per_s < 140_000
