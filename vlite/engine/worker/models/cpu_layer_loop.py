"""A step's decoder layers in one C++ call on CPU (``vlite/kernels/cpu_decoder.cpp``).

The Python loop over the layers (``LlamaForCausalLM.forward``) calls nine C++ kernels per layer;
between them go module calls, dispatch and argument checks, about 0.1 ms per layer, while the
other OpenMP thread waits. Without them a SmolLM2 decode step on two cores takes 6-14% less time
(``benchmarks/throughput/layer_loop.py``; docs/kernels.md, "The decoder layers in one C++ call"). ``CpuLayerLoop`` hands
the whole loop to C++, which calls the same kernels with the same arguments in the same order:
its hidden states equal the Python loop's bit for bit (tests/engine/test_cpu_layer_loop.py). It
also releases the GIL for the whole forward, not once per kernel.

It takes a model when (``CpuLayerLoop.build``): CPU tensors, float32 or bfloat16, one
tensor-parallel rank (no all-reduce between layers), every layer's linear weights packed by
vlite's GEMM, the C++ decode kernel built and taking the model's heads, and the switches left
at their defaults (``VLITE_ATTENTION_BACKEND``, ``VLITE_FUSED_OPS``, and
``VLITE_CPU_LAYER_LOOP=auto|python``, where ``python`` keeps every step on the Python loop).
It takes a step when the decode kernel attends every query token (``kernel_rows_of_every_token``:
decode steps and short prefill chunks); a step with a longer prefill chunk (SDPA) runs the
Python loop.
"""

from __future__ import annotations

import torch

from vlite.env import env_choice
from vlite.kernels import attention, cpu_attention, cpu_extension, fused_ops
from vlite.kernels.torch_ref import kernel_rows_of_every_token

LAYER_LOOP_CHOICES = ("auto", "python")


def default_choice() -> str:
    """What ``VLITE_CPU_LAYER_LOOP`` asks for ("auto" when unset).

    Raises:
        ValueError: the variable holds something else than auto or python.
    """
    return env_choice("VLITE_CPU_LAYER_LOOP", LAYER_LOOP_CHOICES, "auto")


class CpuLayerLoop:
    """Every decoder layer and the final norm of a ``LlamaForCausalLM`` as one C++ call per step.

    Holds references to the model's packed weights and norms (no copies); build it after
    ``prepack_cpu_gemm("vlite")``.
    """

    def __init__(self, layers) -> None:
        self._layers = layers  # the extension's CpuDecoderLayers

    @classmethod
    def build(cls, model: torch.nn.Module, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> CpuLayerLoop | None:
        """The loop for ``model`` whose first layer's cache is ``kv_cache``, or None where it
        does not apply (see the module docstring)."""
        first = model.layers[0].self_attn
        final_norm = model.norm.weight
        if (default_choice() != "auto" or model.tp.size != 1 or final_norm.device.type != "cpu"
                or final_norm.dtype not in (torch.float32, torch.bfloat16)
                or attention.default_backend() != "auto" or fused_ops.default_choice() != "auto"):
            return None
        linears = [m for layer in model.layers
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(m.packed_by != "vlite" for m in linears):
            return None
        probe = torch.empty(0, first.num_heads, first.head_dim, dtype=final_norm.dtype)  # a step's query
        if (not fused_ops.cpp_takes(probe, model.config.hidden_size, first.head_dim, model.layers[0].mlp.intermediate_size)
                or not cpu_attention.supports(probe, kv_cache[0])):
            return None
        module = cpu_extension.load()
        if module is None:
            return None
        eps = {model.norm.eps} | {n.eps for layer in model.layers
                                  for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        if len(eps) != 1:
            return None
        layers = module.CpuDecoderLayers(first.num_heads, first.num_kv_heads, first.head_dim, first.scale,
                                         eps.pop(), final_norm)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.add_layer(layer.input_layernorm.weight, attn.qkv_proj.packed_weight, attn.qkv_proj.bias,
                             attn.o_proj.packed_weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                             mlp.gate_up_proj.packed_weight, mlp.down_proj.packed_weight, mlp.intermediate_size)
        return cls(layers)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: attention.AttentionMetadata) -> torch.Tensor | None:
        """x [T, hidden] the embeddings; cos, sin [T, head_dim] in x's dtype (``LlamaForCausalLM.forward``).
        Returns the final hidden states [T, hidden], or None when the step needs the Python loop
        (a prefill chunk the decode kernel does not attend)."""
        rows = kernel_rows_of_every_token(meta)
        if rows is None:
            return None
        k_caches = [k for k, _ in kv_caches]
        v_caches = [v for _, v in kv_caches]
        return self._layers.forward(x, cos, sin, meta.slot_mapping, k_caches, v_caches, *rows)


__all__ = ["CpuLayerLoop", "LAYER_LOOP_CHOICES", "default_choice"]
