"""The fused elementwise ops of a Llama decoder layer: RMSNorm (with the residual add), SiLU-and-mul,
and rotary embedding with the KV-cache store, as vLLM fuses them (``rms_norm``,
``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding`` + ``reshape_and_cache`` in
``vllm/_custom_ops.py``).

Two implementations with one interface:
  * ``TorchOps``: plain torch ops, exactly the numerics of transformers' Llama (RMSNorm in
    float32, ``x * cos + rotate_half(x) * sin``, SiLU); runs on any device and is the reference.
  * ``CppOps``: the C++ CPU extension (``cpu_fused_ops.cpp``), one call per op instead of 2-12
    torch ops. At decode sizes those ops are mostly torch's per-op dispatch cost: one decode step
    of SmolLM2 runs about 1,500 of them. Its results equal the reference's except for the order
    of the float32 sum in RMSNorm and the last bits of SiLU's exp (a few ulp; tested in
    ``tests/kernels/test_cpu_fused_ops.py``).

``ops_for(x)`` picks one per step: ``CppOps`` for float32/bfloat16 CPU tensors whose sizes it
takes (hidden and intermediate sizes multiples of 16, an even head_dim), when the extension is built,
``VLITE_FUSED_OPS`` is not ``torch`` and ``VLITE_ATTENTION_BACKEND`` is ``auto``.

The KV store follows the attention backend, not the device: ``TorchOps.rotary_store`` writes the
cache through ``attention.store_kvcache`` (the Triton kernel on CUDA, or on CPU tensors with
``VLITE_ATTENTION_BACKEND=triton`` under ``TRITON_INTERPRET=1``; the torch reference otherwise),
and ``CppOps`` (whose store is C++) is only picked on the default CPU path. So a CPU run with the
Triton backend calls the same ops as a CUDA run, and none of them syncs with the host: what a
CUDA graph captures (``tests/engine/test_capture_safety.py``).

Shapes: T tokens; H hidden size; I intermediate size; Hq/Hkv query/KV heads of head_dim D.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlite.env import env_choice
from vlite.kernels import attention

FUSED_OPS_CHOICES = ("auto", "torch")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, ``x * cos + rotate_half(x) * sin`` as transformers computes it.

    x: [T, H, D]; cos, sin_signed: [T, 1, D] with ``sin_signed = cat(-sin[:D/2], sin[D/2:])``,
    so ``rotate_half(x) * sin == roll(x, D/2) * sin_signed`` exactly (negating a factor is exact
    in IEEE arithmetic) and the negation is done once per model, not once per layer.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class TorchOps:
    """The reference: torch ops with transformers' numerics (any device, any float dtype)."""

    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm (Zhang & Sennrich 2019) of x [T, H] in float32, scaled by weight [H] in x's dtype."""
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @classmethod
    def fused_add_rms_norm(cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> None:
        """In place: ``residual += x`` (rounded to the dtype), then ``x = rms_norm(residual)``."""
        residual.add_(x)
        x.copy_(cls.rms_norm(residual, weight, eps))

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate, up side by side) -> SiLU(gate) * up, [T, I]."""
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one [T, I] temporary, not two

    @staticmethod
    def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slot_mapping: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                     num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotary on the q and k heads of qkv [T, (Hq + 2 Hkv) D], then k and v written into
        their slots of the paged caches ([blocks, block_size, Hkv, D]; slot -1 = skip) by
        ``attention.store_kvcache`` (the attention backend's store). cos, sin_signed: [T, D] in
        qkv's dtype (see ``rotate``). Returns q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]."""
        t, head_dim = qkv.shape[0], k_cache.shape[-1]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # q and k heads side by side get their rotary in one pass: [T, Hq + Hkv, D]
        qk = rotate(qkv[:, :q_size + kv_size].view(t, -1, head_dim), cos[:, None], sin_signed[:, None])
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim)
        attention.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
        return q, k, v


class CppOps:
    """The C++ CPU extension's fused ops (float32 or bfloat16, contiguous CPU tensors); same
    interface and semantics as ``TorchOps``.

    Raises (every op):
        RuntimeError: tensors it does not take (``ops_for`` only picks it when they fit), or a
            slot past the cache's end.
    """

    name = "cpp"

    def __init__(self, module) -> None:
        self._m = module

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._m.rms_norm(out, x, weight, eps)
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        self._m.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._m.silu_and_mul(gate_up)

    def rotary_store(self, qkv, cos, sin_signed, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads):
        q, k = self._m.rotary_store(qkv, cos, sin_signed, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads)
        head_dim = k_cache.shape[-1]
        v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(qkv.shape[0], num_kv_heads, head_dim)
        return q, k, v


def default_choice() -> str:
    """What ``VLITE_FUSED_OPS`` asks for ("auto" when unset).

    Raises:
        ValueError: the variable holds something else than auto or torch.
    """
    return env_choice("VLITE_FUSED_OPS", FUSED_OPS_CHOICES, "auto")


def cpp_takes(x: torch.Tensor, hidden_size: int, head_dim: int, intermediate_size: int) -> bool:
    """Whether ``CppOps`` takes a model of these sizes on x's device and dtype."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and hidden_size % 16 == 0
            and head_dim % 2 == 0 and intermediate_size % 16 == 0)


def ops_for(x: torch.Tensor, hidden_size: int, head_dim: int, intermediate_size: int) -> TorchOps | CppOps:
    """The implementation for a step whose hidden states are x (see the module docstring).
    intermediate_size: this rank's share (the MLP's SiLU-and-mul width)."""
    if (default_choice() == "auto" and attention.default_backend() == "auto"
            and cpp_takes(x, hidden_size, head_dim, intermediate_size)):
        from vlite.kernels import cpu_extension

        module = cpu_extension.load()
        if module is not None:
            return CppOps(module)
    return TorchOps()
