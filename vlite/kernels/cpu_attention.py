"""The C++ paged decode-attention kernel for CPU (``cpu_paged_attention.cpp``), built on first use.

torch's ``cpp_extension`` compiles it with the machine's own vector instructions
(``-march=native``) into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); the first build takes about 20 s, later processes load it in
well under a second. The build needs a C++ compiler and ninja (a dependency of vlite). When it
cannot be built, ``load()`` logs why once and returns None, and the torch path
(``torch_ref``) does all the attention.

Only float32 and bfloat16 decodes go through the kernel; prefill chunks, other dtypes and head
shapes it does not take stay on the torch path (``supports``).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger("vlite.kernels")

_SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
_lock = threading.Lock()
_state: dict = {}
_DTYPES = (torch.float32, torch.bfloat16)  # what the kernel takes


def _cpu_tag() -> str:
    """Short hash of the CPU's model and flags: a build made with -march=native on one machine
    is never loaded on another (a shared home directory would otherwise do that)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor(), platform.machine()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]


def load():
    """The compiled module (with ``paged_decode``), or None when it cannot be built here."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build():
    # the source's and the Python environment's hash in the name: the build command holds the
    # venv's torch paths, so two checkouts (or venvs) sharing one cache each keep their own build
    # instead of rebuilding over each other at every start
    source_tag = hashlib.sha256(_SOURCE.read_bytes() + sys.prefix.encode()).hexdigest()[:8]
    name = f"vlite_cpu_paged_attention_{_cpu_tag()}_{source_tag}"
    try:
        from torch.utils.cpp_extension import load as load_extension

        if not _already_built(name):  # a first start would otherwise look like a slow model load
            logger.warning("building the C++ CPU attention kernel (once per machine and venv, about 20 s) ...")
        return load_extension(name=name, sources=[str(_SOURCE)],
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path still works
        logger.warning("the C++ CPU attention kernel could not be built (%s: %s); using the torch path",
                       type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


def _already_built(name: str) -> bool:
    """Whether torch's extension cache holds a build of ``name`` (it rebuilds by itself if the
    source changed; this only decides whether to announce a build)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory(name, False)) / f"{name}.so").exists()
    except Exception:  # a private torch helper: if it moves, only the notice is lost
        return True


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode`` takes these tensors: CPU float32 or bfloat16 (query and cache
    alike), contiguous caches, head_dim a multiple of 16 up to 256, at most 8 query heads per
    KV head."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (query.device.type == "cpu" and query.dtype in _DTYPES and k_cache.dtype == query.dtype
            and k_cache.is_contiguous() and head_dim % 16 == 0 and head_dim <= 256
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 8)


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """query [n, Hq, D] float32 or bfloat16 (the caches' dtype), one token per sequence, over
    its first seq_lens[i] cached tokens of block_tables[i] ([n, max_blocks] int64); returns
    [n, Hq, D] in the query's dtype (float32 accumulation either way).

    Raises:
        RuntimeError: the kernel is not built (call ``load()`` first) or the tensors break its
            assumptions (``supports``).
    """
    module = _state.get("module")
    if module is None:
        raise RuntimeError("the C++ CPU attention kernel is not loaded; call cpu_attention.load() first")
    return module.paged_decode(query.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens, scale)
