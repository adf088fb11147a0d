"""Runs the capture-safety cases (``capture_safety_cases.py``: no step's forward syncs with the
host, the condition for CUDA-graph capture) in a fresh pytest process.

Without a GPU the Triton kernels run under Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1) before ``triton`` is first imported; in this process other tests have
usually imported it already (transformers does), so the cases get a process of their own. With
CUDA available they run compiled on the GPU and also capture the decode graphs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).with_name("capture_safety_cases.py")


def test_no_step_syncs_with_the_host():
    pytest.importorskip("triton")
    env = dict(os.environ, VLITE_ATTENTION_BACKEND="triton")
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                          cwd=CASES.parents[2], env=env, capture_output=True, text=True, timeout=600, check=False)
    summary = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert proc.returncode == 0, f"capture-safety cases failed ({summary[0]}):\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in summary[0] and "failed" not in summary[0]
