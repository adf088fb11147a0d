"""The one paged-attention interface the model calls.

Backends: Triton kernels (``triton_store_kvcache``, ``triton_paged_attention``) when the tensors
are on CUDA, the torch implementation (``torch_ref``) everywhere else, with its float32 decode
rows handed to the C++ CPU kernel (``cpu_attention``) when that kernel builds on this machine. ``backend="triton"``
forces the Triton path, e.g. on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before the kernel modules are first imported), which is how the tests run the kernels
without a GPU; ``backend="torch"`` or the environment variable ``VLITE_ATTENTION_BACKEND=torch``
forces the torch path (e.g. to compare the two on a GPU; on CPU it also leaves the C++ kernel out).

Shapes (T = tokens in the step, B = sequences, Hq/Hkv = query/KV heads, D = head dim):
  query   [T, Hq, D], key/value [T, Hkv, D]      (float32 / bfloat16)
  k_cache, v_cache [num_blocks, block_size, Hkv, D]
Sequences are packed decodes first: the first ``num_decodes`` sequences have one query token.
"""

from __future__ import annotations

import torch

from vlite.env import env_choice
from vlite.kernels import torch_ref
from vlite.kernels.metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "triton")


def default_backend() -> str:
    """The backend ``VLITE_ATTENTION_BACKEND`` names ("auto" when unset).

    Raises:
        ValueError: the variable holds something else than auto, torch or triton.
    """
    return env_choice("VLITE_ATTENTION_BACKEND", BACKENDS, "auto")


def _use_triton(x: torch.Tensor, backend: str | None) -> bool:
    backend = backend or default_backend()
    if backend == "auto":
        return x.is_cuda
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not x.is_cuda:
        from vlite.kernels.triton_paged_attention import INTERPRETED  # imported lazily: CPU needs no triton

        if not INTERPRETED:
            raise RuntimeError("the Triton path on CPU tensors needs TRITON_INTERPRET=1 set before "
                               "vlite.kernels.triton_* is first imported")
    return backend == "triton"


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, *, backend: str | None = None) -> None:
    """Write each token's K and V into its slot. Shapes as in the module docstring.

    backend: "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton"; None = the default.
    """
    if _use_triton(key, backend):
        from vlite.kernels import triton_store_kvcache

        triton_store_kvcache.store_kvcache(key, value, k_cache, v_cache, slot_mapping)
    else:
        torch_ref.store_kvcache(key, value, k_cache, v_cache, slot_mapping)


def prepare_backend(device: torch.device | str, fused_choice: str = "auto") -> str:
    """Build (or load) what the default backend needs on ``device`` before the first step, so
    no request waits for a compiler. Returns the attention path in words, for the log.
    ``fused_choice`` is ``fused_ops.default_choice()`` (the caller reads it, so that a bad
    ``VLITE_FUSED_OPS`` fails at start, not in every step), named in the returned words.

    Raises:
        ValueError: a bad ``VLITE_ATTENTION_BACKEND``.
    """
    backend = default_backend()
    if torch.device(device).type != "cpu":
        return "triton" if backend == "auto" else backend
    if backend == "auto":
        from vlite.kernels import cpu_attention

        if cpu_attention.load() is not None:
            fused = "torch elementwise ops (VLITE_FUSED_OPS=torch)" if fused_choice == "torch" \
                else "fused C++ elementwise ops"
            return f"C++ CPU kernel for float32 and bfloat16 decodes, {fused}, torch for the rest"
    return backend if backend == "triton" else "torch"


def _cpu_decode(query: torch.Tensor, k_cache: torch.Tensor, backend: str | None):
    """The C++ decode kernel when the default path is on, it is built and it takes these tensors."""
    if (backend or default_backend()) != "auto" or query.is_cuda:
        return None
    from vlite.kernels import cpu_attention

    if not cpu_attention.supports(query, k_cache) or cpu_attention.load() is None:
        return None
    return cpu_attention.paged_decode


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    backend: str | None = None) -> torch.Tensor:
    """Causal attention of the packed queries over each sequence's paged K/V.

    ``key``/``value`` are this step's new K/V (already stored in the cache); implementations
    may use them directly when a sequence has no earlier cached context (the Triton path
    reads everything from the cache).
    backend: "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton"; None = the default.
    Returns [T, Hq, D] in the query's dtype.
    """
    if _use_triton(query, backend):
        from vlite.kernels import triton_paged_attention

        return triton_paged_attention.paged_attention(query, k_cache, v_cache, meta, scale)
    # decided once per step: every layer has the same dtype, shapes and backend
    if "cpu_decode" not in meta.plan_cache:
        meta.plan_cache["cpu_decode"] = _cpu_decode(query, k_cache, backend)
    return torch_ref.paged_attention(query, key, value, k_cache, v_cache, meta, scale,
                                     decode_attention=meta.plan_cache["cpu_decode"])
