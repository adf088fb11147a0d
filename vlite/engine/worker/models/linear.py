"""The model's linear layers, with an optional packed-weight GEMM on CPU.

Three CPU GEMMs (``EngineConfig.cpu_gemm`` or ``VLITE_CPU_GEMM``):
  * "vlite": vlite's own C++ kernels (``vlite/kernels/cpu_gemm.cpp``) on a weight packed once at
    load: float32 on any CPU with AVX-512, bfloat16 on CPUs with AMX or AVX512-BF16. Each thread streams its
    share of the packed weight once per call and prefetches ahead; at a decode step's 1-64 rows a
    linear layer is a read of its weight from DRAM, and this is 1.3-1.9x oneDNN's speed there on
    this project's Sapphire Rapids machine (docs/kernels.md, "The packed GEMM").
  * "onednn": torch's own oneDNN ops on a prepacked weight (``torch.ops.mkldnn._reorder_linear_weight``
    and ``_linear_pointwise``, which torch.compile's CPU backend emits for the same purpose;
    vLLM's CPU backend also calls a oneDNN matmul on a weight reordered once at load,
    ``dispatch_cpu_unquantized_gemm`` in ``vllm/model_executor/layers/utils.py``). Why not plain
    ``F.linear``: in float32 it calls MKL's sgemm, which takes a path without AVX-512 on AMD CPUs
    (150 against 360 GFLOP/s at 64 rows on the Zen 5 machine, ``benchmarks/kernels/cpu_kernels.py``).
  * "torch": ``F.linear`` on the plain weight.
"auto" takes the first of these that runs the weights' dtype here.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from vlite.engine.config import CPU_GEMM_BACKENDS
from vlite.kernels import cpu_gemm


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


def vlite_gemm_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether vlite's packed GEMM (``cpu_gemm.cpp``) runs ``dtype`` here: the C++ extension
    built, and the CPU has AVX-512 (float32) or, for bfloat16, AMX-BF16 that this process may use or else AVX512-BF16.
    Building the extension the first time takes a while (``cpu_extension``)."""
    return cpu_gemm.available(dtype)


def resolve_cpu_gemm_backend(backend: str | None, dtype: torch.dtype = torch.float32) -> str:
    """Turn "auto"/None (or the ``VLITE_CPU_GEMM`` environment variable) into "vlite", "onednn"
    or "torch" for weights of ``dtype``: "auto" takes the first that runs that dtype on this CPU.

    Raises:
        ValueError: an unknown backend name, or "vlite" / "onednn" where it cannot run ``dtype``
            here.
    """
    source = "cpu_gemm" if backend else "VLITE_CPU_GEMM"
    backend = backend or os.environ.get("VLITE_CPU_GEMM") or "auto"
    if backend not in CPU_GEMM_BACKENDS:
        raise ValueError(f"{source} must be one of {CPU_GEMM_BACKENDS}, got {backend!r}")
    dtype_name = str(dtype).removeprefix("torch.")
    if backend == "auto":
        if vlite_gemm_available(dtype):
            return "vlite"
        return "onednn" if onednn_gemm_available(dtype) else "torch"
    if backend == "vlite" and not vlite_gemm_available(dtype):
        raise ValueError(f"{source}='vlite' cannot run {dtype_name} weights here: it needs the C++ extension "
                         "(g++ and ninja) and, for float32, a CPU with AVX-512, for bfloat16 one with AMX-BF16 or AVX512-BF16; "
                         "use 'onednn', 'torch' or 'auto' instead")
    if backend == "onednn" and not onednn_gemm_available(dtype):
        raise ValueError(f"{source}='onednn' cannot run {dtype_name} weights here: it needs a torch build with "
                         "oneDNN (mkldnn) and, for bfloat16, a CPU with AVX-512 (BW, VL, DQ) or "
                         f"AVX-NE-CONVERT; use 'torch' or 'auto' instead")
    return backend


class Linear(nn.Linear):
    """``nn.Linear`` (y = x W^T + b; x [..., in_features], W [out_features, in_features]) that
    can run on a packed copy of W on CPU: oneDNN's blocked layout or vlite's (``cpu_gemm.cpp``).

    After :meth:`prepack` the layer holds W only in the packed layout (``packed_by`` says whose)
    and, unless told to keep it, drops the plain weight, so weights are not held twice; the layer
    can then no longer be moved to another device or have weights loaded into it.
    """

    packed_weight: torch.Tensor | None = None
    packed_by: str | None = None  # "onednn" or "vlite" once packed

    def prepack(self, backend: str, keep_weight: bool = False) -> None:
        """Pack W once for ``backend`` ("onednn" or "vlite"). ``keep_weight``: keep the plain W
        too (it is shared, e.g. a tied embedding).

        Raises:
            RuntimeError: the weight is not on CPU, or the backend cannot pack it here.
            ValueError: an unknown backend.
        """
        if backend not in ("onednn", "vlite"):
            raise ValueError(f"prepack backend must be 'onednn' or 'vlite', got {backend!r}")
        if self.weight.device.type != "cpu":
            raise RuntimeError(f"{backend} prepacking needs CPU weights, this layer's are on {self.weight.device}")
        with torch.no_grad():
            weight = self.weight.detach()
            if backend == "onednn":
                self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            else:
                self.packed_weight = cpu_gemm.pack(weight)
        self.packed_by = backend
        if not keep_weight:
            del self.weight
            self.register_parameter("weight", None)

    def prepack_onednn(self, keep_weight: bool = False) -> None:
        """``prepack("onednn", keep_weight)``."""
        self.prepack("onednn", keep_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_by == "vlite":
            return cpu_gemm.linear(x, self.packed_weight, self.bias, self.out_features)
        if self.packed_by == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
