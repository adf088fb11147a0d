"""The model's linear layers, with an optional oneDNN GEMM on CPU.

Why not plain ``F.linear`` on CPU: in float32 it calls MKL's sgemm, and MKL takes a code path
without AVX-512 on AMD CPUs. On this project's Zen 5 machine SmolLM2's linear layers run at
about 150 GFLOP/s with MKL at 64 rows (a decode step) and about 360 with oneDNN (also shipped
inside torch), with float32 rounding (errors of the same size as MKL's); see
``benchmarks/fp32_bound.py`` and ``benchmarks/cpu_kernels.py``. vLLM's CPU backend makes the same choice: its unquantized linear layers
call a oneDNN matmul on a weight that was reordered ("prepacked") once at load
(``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``).

The oneDNN ops used are torch's own (``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``, which torch.compile's CPU backend emits for the same purpose).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from vlite.engine.config import CPU_GEMM_BACKENDS


def onednn_gemm_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build, on this CPU, can run prepacked oneDNN linear layers in ``dtype``.

    bfloat16 also needs the CPU: oneDNN's bf16 reorder wants AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT and raises on plain AVX2 CPUs (Zen 3, for one), which torch reports through
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported``.
    """
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(getattr(ops, "_is_mkldnn_bf16_supported", lambda: False)())
    return dtype == torch.float32


def resolve_cpu_gemm_backend(backend: str | None, dtype: torch.dtype = torch.float32) -> str:
    """Turn "auto"/None (or the ``VLITE_CPU_GEMM`` environment variable) into "onednn" or "torch"
    for weights of ``dtype``: "auto" takes oneDNN where it can run that dtype on this CPU.

    Raises:
        ValueError: an unknown backend name, or "onednn" where this torch build or this CPU
            cannot run it in ``dtype``.
    """
    source = "cpu_gemm" if backend else "VLITE_CPU_GEMM"
    backend = backend or os.environ.get("VLITE_CPU_GEMM") or "auto"
    if backend not in CPU_GEMM_BACKENDS:
        raise ValueError(f"{source} must be one of {CPU_GEMM_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "onednn" if onednn_gemm_available(dtype) else "torch"
    if backend == "onednn" and not onednn_gemm_available(dtype):
        dtype_name = str(dtype).removeprefix("torch.")
        raise ValueError(f"{source}='onednn' cannot run {dtype_name} weights here: it needs a torch build with "
                         "oneDNN (mkldnn) and, for bfloat16, a CPU with AVX-512 (BW, VL, DQ) or "
                         f"AVX-NE-CONVERT; use 'torch' or 'auto' instead")
    return backend


class Linear(nn.Linear):
    """``nn.Linear`` (y = x W^T + b; x [..., in_features], W [out_features, in_features]) that
    can run on a oneDNN-prepacked copy of W on CPU.

    After :meth:`prepack_onednn` the layer holds W in oneDNN's blocked layout (an opaque tensor,
    CPU only) and, unless told to keep it, drops the plain weight, so weights are not held twice;
    the layer can then no longer be moved to another device or have weights loaded into it.
    """

    packed_weight: torch.Tensor | None = None

    def prepack_onednn(self, keep_weight: bool = False) -> None:
        """Reorder W for oneDNN once. ``keep_weight``: keep the plain W too (it is shared, e.g.
        a tied embedding).

        Raises:
            RuntimeError: the weight is not on CPU.
        """
        if self.weight.device.type != "cpu":
            raise RuntimeError(f"oneDNN prepacking needs CPU weights, this layer's are on {self.weight.device}")
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_weight:
            del self.weight
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
