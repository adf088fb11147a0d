"""glibc malloc settings for the CPU engine (vlite/engine/worker/cpu_malloc.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vlite.engine.worker import cpu_malloc

# Growing step-sized buffers, as a forward's activations grow with the batch: with glibc's
# default each new size above its (dynamic) mmap threshold is mapped afresh and faulted in page
# by page; with the tuned thresholds the heap keeps what was freed and only the growth faults.
_GROWING_BUFFERS = """
import resource, sys, torch
from vlite.engine.worker.cpu_malloc import tune_malloc
tuned = tune_malloc()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mib in range(1, 25):
    buf = torch.empty(mib << 18)  # float32: mib MiB
    buf.fill_(1.0)
    del buf
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


def _page_faults(choice: str) -> tuple[str, int]:
    env = {"VLITE_CPU_MALLOC": choice, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _GROWING_BUFFERS], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_tuned_heap_reuses_freed_buffers_instead_of_faulting_them_in_again():
    tuned, tuned_faults = _page_faults("tuned")
    untouched, default_faults = _page_faults("default")
    assert (tuned, untouched) == ("True", "False")
    # 1 + 2 + ... + 24 MiB touched: 76,800 pages when every buffer is fresh; the tuned heap
    # faults in about the largest buffer's 6,144 pages
    assert default_faults > 50_000
    assert tuned_faults < default_faults / 4


def test_a_bad_value_fails_at_start_with_the_allowed_values(monkeypatch):
    monkeypatch.setenv("VLITE_CPU_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match=r"VLITE_CPU_MALLOC must be one of \('tuned', 'default'\), got 'jemalloc'"):
        cpu_malloc.tune_malloc()


def test_the_engine_refuses_a_bad_value_before_loading_anything(tiny_checkpoint, monkeypatch):
    from conftest import make_engine

    monkeypatch.setenv("VLITE_CPU_MALLOC", "bogus")
    with pytest.raises(ValueError, match="VLITE_CPU_MALLOC must be one of"):
        make_engine(tiny_checkpoint)


@pytest.mark.parametrize("name, value", [("VLITE_ATTENTION_BACKEND", "cuda"), ("VLITE_FUSED_OPS", "fast"),
                                         ("VLITE_CPU_GEMM", "mkl"), ("VLITE_CPU_MALLOC", "jemalloc")])
def test_every_switch_is_checked_before_the_weights_load(tiny_checkpoint, monkeypatch, name, value):
    from conftest import make_engine

    import vlite.engine.worker.model_runner as model_runner

    def must_not_build(*a, **k):
        raise AssertionError(f"the model was built although {name}={value!r} is refused")

    monkeypatch.setattr(model_runner, "build_model", must_not_build)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        make_engine(tiny_checkpoint)


def test_an_empty_switch_means_unset(monkeypatch):
    from vlite.env import env_choice

    monkeypatch.setenv("VLITE_CPU_MALLOC", "")
    assert cpu_malloc.malloc_choice() == "tuned"
    assert env_choice("VLITE_CPU_MALLOC", ("tuned", "default"), "tuned") == "tuned"
    monkeypatch.setenv("VLITE_CPU_GEMM", "")
    from vlite.engine.worker.models.linear import resolve_cpu_gemm_backend

    assert resolve_cpu_gemm_backend(None) in ("vlite", "onednn", "torch")
