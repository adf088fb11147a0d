"""The bare `vlite leak-check` tests client aborts, and a run that did not says so:
defaults, the verdict line's caveat, exit code 4, and calibration that a Ctrl-C stops."""

from __future__ import annotations

import json
import threading

from conftest import make_engine
from typer.testing import CliRunner

from vlite.cli.main import app
from vlite.diagnostics.checks.coverage import HEADLINE, PATHS, caveat, no_client_abort
from vlite.diagnostics.targets.base import EXIT_HEADLINE_NOT_EXERCISED, TargetRun


def test_caveat_names_the_headline_paths_and_counts_the_rest():
    assert caveat([]) is None
    assert caveat(["abort during decode"]) == "abort during decode was not exercised"
    assert caveat(["EOS finish", "abort during decode", "fork"]) == \
        "abort during decode was not exercised, nor 2 other checklist paths"
    assert caveat(list(HEADLINE) + ["fork"]) == ("abort while waiting, abort during prefill and abort during decode "
                                                 "were not exercised, nor 1 other checklist path")
    assert caveat(["fork", "EOS finish"]) == "fork was not exercised, nor 1 other checklist path"
    assert set(HEADLINE) <= set(PATHS)  # the headline paths are checklist paths
    assert no_client_abort(list(PATHS)) and not no_client_abort(["abort while waiting", "abort during prefill"])


def test_a_clean_run_without_client_aborts_exits_4():
    run = TargetRun("in-process", "CLEAN", "CLEAN, but ...", None, None, {}, [], headline_not_exercised=True)
    assert run.exit_code == EXIT_HEADLINE_NOT_EXERCISED == 4
    assert TargetRun("in-process", "LEAK", "LEAK: ...", None, None, {}, [], headline_not_exercised=True).exit_code == 1
    assert TargetRun("in-process", "CLEAN", "CLEAN: ...", None, None, {}, []).exit_code == 0


def test_defaults_abort_as_make_run_does_with_the_documented_request_count():
    # README, docs/leak-check/ and --help agree on them: tests/cli/test_help_texts.py
    import typer

    params = {p.name: p for p in typer.main.get_command(app).commands["leak-check"].commands["replay"].params}
    assert params["num_requests"].default == 60 and params["abort_rate"].default == 0.3
    assert params["abort_mode"].default == "mix"  # as `make run`: --abort-rate 0.3 --abort-mode mix


def test_no_client_abort_is_not_a_plain_clean(tiny_model_dir, tmp_path):
    # a fault on the abort path, and no abort to walk it
    res = CliRunner().invoke(app, ["leak-check", "--model", str(tiny_model_dir), "--num-requests", "20",
                                   "--abort-rate", "0", "--inject-fault", "skip-free-on-abort", "--report",
                                   str(tmp_path / "r")], env={"COLUMNS": "200"})
    assert res.exit_code == 4, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("verdict: CLEAN, but abort while waiting, abort during prefill and abort during decode "
                           "were not exercised, nor "), last
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["verdict"] == "CLEAN" and rep["summary"].startswith("CLEAN, but abort while waiting")
    assert "**CLEAN**, but abort while waiting" in (tmp_path / "r" / "report.md").read_text()


def test_calibration_stops_at_the_stop_event_and_frees_its_blocks(tiny_checkpoint):
    from vlite.diagnostics.workload.calibrate import calibrate, engine_greedy
    from vlite.diagnostics.workload.sources import RequestSpec
    from vlite.engine import EngineView

    engine = make_engine(tiny_checkpoint, num_blocks=64)
    specs = [RequestSpec(f"r{i}", 0.0, f"hello number {i}", 4, 8, stop_token_at=300) for i in range(6)]
    stop, seen = threading.Event(), []

    def progress(done, total):
        seen.append((done, total))
        stop.set()  # a Ctrl-C as soon as calibration starts

    out = calibrate(specs, engine_greedy(engine), stop=stop, on_progress=progress)
    assert seen == [(0, 6)]  # no greedy run finished: each was cut short
    assert all(s.stop_token_at is None and s.stop_token_ids == () for s in out)  # left without a stop
    assert not engine.has_unfinished_requests()
    stats = EngineView(engine).stats()
    assert stats.num_used_blocks == 0


def test_calibration_reports_its_progress(tiny_checkpoint):
    from vlite.diagnostics.workload.calibrate import calibrate, engine_greedy
    from vlite.diagnostics.workload.sources import RequestSpec

    engine = make_engine(tiny_checkpoint, num_blocks=64)
    specs = [RequestSpec(f"r{i}", 0.0, f"hello number {i}", 4, 8, stop_token_at=3) for i in range(3)]
    seen = []
    out = calibrate(specs, engine_greedy(engine), on_progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (0, 3) and seen[-1] == (3, 3) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert all(len(s.stop_token_ids) == 1 for s in out)
