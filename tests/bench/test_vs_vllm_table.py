"""benchmarks/vs_vllm/vs_vllm_table.py: the ratio table that says whether the vs-vLLM targets are met."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_vllm" / "vs_vllm_table.py"


@pytest.fixture(scope="module")
def table_module():
    spec = importlib.util.spec_from_file_location("vs_vllm_table", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(d: Path, name: str, payload: dict) -> None:
    (d / name).write_text(json.dumps(payload))


def test_saturating_rate_is_the_first_rate_that_grows_under_5_percent(table_module):
    assert table_module.saturating_rate({2: 100.0, 4: 150.0, 8: 155.0, 16: 200.0}) == 8
    assert table_module.saturating_rate({2: 100.0, 4: 150.0, float("inf"): 200.0}) == float("inf")
    assert table_module.saturating_rate({}) is None


def test_w1_rows_give_each_engines_bfloat16_gain_over_its_own_float32(table_module, tmp_path):
    for engine, fp32, bf16 in (("vlite", 300.0, 540.0), ("vllm", 150.0, 450.0)):
        _write(tmp_path, f"w1_{engine}_float32.json", {"output_tokens_per_second": fp32})
        _write(tmp_path, f"w1_{engine}_bfloat16.json", {"output_tokens_per_second": bf16})
    rows = {work: (a, b, ratio) for work, a, b, ratio, _ in table_module.rows(tmp_path)}
    assert rows["W1 offline float32: output tok/s"] == (300.0, 150.0, "2.00x")
    assert rows["W1 offline bfloat16: output tok/s"] == (540.0, 450.0, "1.20x")
    gain = rows["W1 bfloat16 over the same engine's float32 (x)"]
    assert gain[0] == pytest.approx(1.8) and gain[1] == pytest.approx(3.0)


def test_a_subset_run_leaves_the_gain_row_out(table_module, tmp_path):
    _write(tmp_path, "w1_vlite_float32.json", {"output_tokens_per_second": 300.0})
    _write(tmp_path, "w1_vllm_float32.json", {"output_tokens_per_second": 150.0})
    works = [work for work, *_ in table_module.rows(tmp_path)]
    assert works == ["W1 offline float32: output tok/s"]


def test_saturating_rows_use_the_rate_where_vllm_stopped_growing(table_module, tmp_path):
    for rate, vllm_tps, vlite_tps in (("4", 100.0, 200.0), ("8", 140.0, 300.0), ("16", 141.0, 380.0)):
        _write(tmp_path, f"sat_vllm_{rate}.json", {"output_throughput": vllm_tps, "p99_ttft_ms": 1000.0})
        _write(tmp_path, f"sat_vlite_{rate}.json", {"output_throughput": vlite_tps, "p99_ttft_ms": 250.0})
    rows = {work: (a, b, ratio) for work, a, b, ratio, _ in table_module.rows(tmp_path)}
    assert rows["saturating (16 req/s): output tok/s"] == (380.0, 141.0, f"{380 / 141:.2f}x")
    assert rows["saturating (16 req/s): P99 TTFT (ms)"] == (250.0, 1000.0, "0.25x")


def test_a_missing_or_empty_folder_is_an_error_not_an_empty_table(tmp_path):
    for folder in (tmp_path / "nonexistent", tmp_path):
        run = subprocess.run([sys.executable, str(_SCRIPT), str(folder)], capture_output=True, text=True)
        assert run.returncode != 0
        assert str(folder) in run.stderr and "| work |" not in run.stdout
