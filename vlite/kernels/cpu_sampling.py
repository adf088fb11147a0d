"""Greedy sampling's argmax on CPU (``cpu_sampling.cpp``, one op of vlite's C++ CPU extension).

torch's CPU ``argmax`` compares one value at a time: about 4 ms for a 64-row decode step of
SmolLM2's 49,152 logits on the 2-core machine of docs/benchmarks.md, about 6% of a bfloat16 step. The C++
op gives the same indices (the first maximum of each row, the first NaN where a row has one)
16 lanes at a time.
"""

from __future__ import annotations

import torch

from vlite.kernels.cpu_extension import loaded

__all__ = ["argmax"]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum, as ``logits.argmax(-1)``: logits [N, V] -> [N] int64.

    Uses the C++ op for float32 CPU rows (each contiguous) once the extension is loaded (the
    engine loads it at start on CPU; this never builds it), torch's argmax for anything else.
    """
    module = loaded()
    if (module is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1):
        return module.argmax_rows(logits)
    return logits.argmax(-1)
