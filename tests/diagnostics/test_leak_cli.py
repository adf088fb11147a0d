"""`vlite leak-check` end to end on a tiny model: exit codes, the report directory, scenarios."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from vlite.cli.main import app

runner = CliRunner()


def _invoke(*args):
    return runner.invoke(app, ["leak-check", *map(str, args)], env={"COLUMNS": "200"})


def test_clean_run_exits_0_and_writes_the_report(tiny_model_dir, tmp_path):
    out = tmp_path / "rep"
    res = _invoke("--model", tiny_model_dir, "--num-requests", 10, "--abort-rate", 0.4, "--input-len", "8:24", "--output-len",
                  "4:10", "--num-blocks", 64, "--report", out, "--sample-interval-ms", 50)
    assert res.exit_code == 0, res.output
    assert "CLEAN" in res.output and "no GPU" in res.output
    assert res.output.strip().splitlines()[-1].startswith("verdict: CLEAN")  # the verdict again, last
    assert "(sequences, not requests" in res.output and " ms, p90 " in res.output  # aborts' latency in ms
    assert {p.name for p in out.iterdir()} >= {"report.json", "samples.csv", "report.md", "blocks.png",
                                               "memory.png", "leaks_by_action.png", "troughs.png"}
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"] == "CLEAN" and rep["drain"]["sign"] == "balanced"
    assert rep["run"]["num_requests"] == 10 and len(rep["client"]["requests"]) == 10
    import pandas as pd

    samples = pd.read_csv(out / "samples.csv")
    assert {"t_s", "num_free_blocks", "num_used_blocks", "rss_bytes"} <= set(samples.columns)
    assert (samples["num_total_blocks"] == 64).all() and samples["num_free_blocks"].iloc[-1] + \
        samples["num_cached_blocks"].iloc[-1] == 64


def test_planted_leak_exits_1_and_names_the_action(tiny_model_dir, tmp_path):
    res = _invoke("--model", tiny_model_dir, "--num-requests", 6, "--abort-rate", 1.0, "--abort-mode", "disconnect-stream",
                  "--input-len", "8:24", "--output-len", "8:10", "--num-blocks", 64,
                  "--inject-fault", "skip-free-on-abort", "--report", tmp_path / "r")
    assert res.exit_code == 1, res.output
    assert "LEAK:" in res.output and "disconnect-stream" in res.output
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["verdict"] == "LEAK" and rep["drain"]["deficit_blocks"] > 0
    assert {g["action_kind"] for g in rep["by_action"]} == {"disconnect-stream"}


def test_usage_errors_exit_2(tiny_model_dir, tmp_path):
    assert _invoke("--abort-mode", "explode").exit_code == 2
    assert _invoke("--inject-fault", "nope").exit_code == 2
    assert _invoke("--scenario", "nope", "--model", tiny_model_dir).exit_code == 2
    assert _invoke("--workload", tmp_path / "missing.jsonl").exit_code == 2
    assert _invoke("--abort-rate", 2).exit_code == 2
    res = _invoke("--url", "http://127.0.0.1:1", "--trace-allocations")
    assert res.exit_code == 2 and "in-process replay only" in res.output


def test_all_scenarios_pass_on_a_clean_engine(tiny_model_dir):
    res = _invoke("--model", tiny_model_dir, "--scenario", "all")
    assert res.exit_code == 0, res.output
    assert "15/15 scenarios passed" in res.output


def test_scenarios_catch_a_planted_fault(tiny_model_dir):
    res = _invoke("--model", tiny_model_dir, "--scenario", "disconnect-mid-stream", "--inject-fault",
                  "skip-free-on-abort")
    assert res.exit_code == 1, res.output
    assert "0/1 scenarios passed" in res.output and "disconnect after 3 chunks" in res.output


def test_every_request_failing_in_the_engine_exits_3_inconclusive(tiny_model_dir, tmp_path, monkeypatch):
    from vlite.engine.worker.models.llama import LlamaForCausalLM

    def broken_forward(self, *args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(LlamaForCausalLM, "forward", broken_forward)
    res = _invoke("--model", tiny_model_dir, "--num-requests", 6, "--abort-rate", 0, "--workload", "synthetic",
                  "--input-len", "8:16", "--output-len", "4:8", "--num-blocks", 64, "--report", tmp_path / "r")
    assert res.exit_code == 3, res.output
    assert "INCONCLUSIVE" in res.output
