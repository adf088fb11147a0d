"""vlite's packed-weight GEMM for the CPU linear layers (``cpu_gemm.cpp``; the algorithm and the
packed layouts are described there, the measurements in docs/kernels.md).

Shapes: x [M, K], W [N, K] (``nn.Linear``'s layout), bias [N], y [M, N]; float32 on CPUs with
AVX-512, bfloat16 on CPUs with AMX-BF16 or AVX512-BF16; M any (0 included).
"""

from __future__ import annotations

import torch

from vlite.kernels import cpu_extension


def available(dtype: torch.dtype) -> bool:
    """Whether ``pack``/``linear`` run ``dtype`` here (builds or loads the C++ extension)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    module = cpu_extension.load()
    return module is not None and bool(module.packed_gemm_supported(str(dtype).removeprefix("torch.")))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (contiguous CPU, float32 or bfloat16) in the layout ``linear`` reads: float32
    [ceil(N/48), K, 48], bfloat16 [ceil(N/32)*2, K/2, 16, 2] (zero-padded past N).

    Raises:
        RuntimeError: the extension is not built, or it cannot run this dtype or shape here
            (bfloat16 needs K a multiple of 32).
    """
    module = cpu_extension.load()
    if module is None:
        raise RuntimeError("vlite's packed GEMM needs the C++ CPU extension, which could not be built here")
    return module.pack_linear_weight(weight.contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """y [..., N] = x [..., K] W^T + bias, W packed by ``pack``; x in W's dtype.

    Raises:
        RuntimeError: shapes or dtypes that do not match the packed weight.
    """
    module = cpu_extension.loaded()
    if module is None:  # pack() loaded it; only a caller that skipped pack() gets here
        raise RuntimeError("packed linear called before the C++ CPU extension was loaded (call pack() first)")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return module.packed_linear(rows, packed, bias, out_features).view(*x.shape[:-1], out_features)


__all__ = ["available", "linear", "pack"]
