"""glibc malloc settings for the CPU engine (vlite/engine/cpu_malloc.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vlite.engine import cpu_malloc

# Growing step-sized buffers, as a forward's activations grow with the batch: with glibc's
# default each new size above its (dynamic) mmap threshold is mapped afresh and faulted in page
# by page; with the tuned thresholds the heap keeps what was freed and only the growth faults.
_GROWING_BUFFERS = """
import resource, sys, torch
from vlite.engine.cpu_malloc import tune_malloc
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
