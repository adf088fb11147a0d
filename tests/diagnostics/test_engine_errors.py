"""An exception from the engine under test is a finding, never a crash of leak-check: every path
the in-process client drives (add, the rollback of a refused multi-prompt request, abort, step,
the idle-point census) is guarded, the run goes on where the engine still can, and the verdict
and report name the path, the request and the exception."""

from __future__ import annotations

import json
from types import SimpleNamespace

from typer.testing import CliRunner

from vlite.diagnostics.targets.inprocess import MAX_STEP_FAILURES, InProcessClient
from vlite.diagnostics.workload.actions import ClientAction
from vlite.diagnostics.workload.sources import OVER_MAX_MODEL_LEN, RequestSpec
from vlite.engine import RequestRejectedError


class EngineBug(RuntimeError):
    """What the fake engine raises on the paths it is told to."""


class _RaisingEngine:
    """Finishes each request one step after it was added; raises ``EngineBug`` on the paths named
    in ``raise_on`` ("add", "abort", "step", "census"); ``step_failures`` bounds the raising steps
    (None: every step raises). A prompt longer than ``MAX_LEN`` words is refused, and a refused
    multi-prompt request aborts the siblings it had admitted (``LLMEngine.add_requests``)."""

    tokenizer = None
    MAX_LEN = 8

    def __init__(self, raise_on=(), step_failures: int | None = None) -> None:
        self.raise_on, self.step_failures = set(raise_on), step_failures
        self.waiting: list[str] = []
        self.aborted: list[str] = []
        self.num_steps = self.generation_tokens_total = 0

    def add_request(self, prompt, params, request_id, origin=None) -> str:
        if "add" in self.raise_on:
            raise EngineBug(f"add of {request_id!r} broke")
        if len(prompt.split()) > self.MAX_LEN:
            raise RequestRejectedError(f"prompt of {len(prompt.split())} tokens > max_model_len {self.MAX_LEN}")
        self.waiting.append(request_id)
        return request_id

    def add_requests(self, requests) -> list[str]:
        added = []
        try:
            for r in requests:
                added.append(self.add_request(r.prompt, r.sampling_params, r.origin.request_id, r.origin))
        except Exception:
            for rid in added:
                self.abort(rid)
            raise
        return added

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if "abort" in self.raise_on:
            raise EngineBug(f"abort of {request_id!r} skipped its free")
        self.waiting = [r for r in self.waiting if r != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def step(self):
        self.num_steps += 1
        if "step" in self.raise_on and (self.step_failures is None or self.num_steps <= self.step_failures):
            raise EngineBug(f"step {self.num_steps} broke")
        self.generation_tokens_total += len(self.waiting)
        done = [SimpleNamespace(request_id=r, finished=True, error=None,
                                outputs=[SimpleNamespace(token_ids=[1], finish_reason="length")]) for r in self.waiting]
        self.waiting = []
        return done


class _View:
    def __init__(self, engine: _RaisingEngine) -> None:
        self.engine = engine
        self.step = 0

    def stats(self):
        return SimpleNamespace(generation_tokens_total=self.engine.generation_tokens_total, num_running=0,
                               num_waiting=len(self.engine.waiting), num_free_blocks=4, num_total_blocks=4)

    def info(self):
        return SimpleNamespace(max_model_len=_RaisingEngine.MAX_LEN)

    def request_tokens(self, request_id: str) -> int:
        return 0

    def request_progress(self, request_id: str):
        return None


def _replay(engine, specs, probe=None):
    def census():
        if "census" in engine.raise_on:
            raise EngineBug("census walk broke")
        return 0, None

    client = InProcessClient(engine, probe or census, stall_steps=20, view=_View(engine))
    return client.replay(specs, max_concurrency=4, idle_every=0)


def _specs(n: int, **kw) -> list[RequestSpec]:
    return [RequestSpec(f"r{i}", 0.0, "hello there", 2, 4, **kw) for i in range(n)]


def test_a_raising_add_is_a_finding_and_the_replay_goes_on():
    out = _replay(_RaisingEngine(raise_on={"add"}), _specs(3))
    assert [r.outcome for r in out.requests] == ["engine-error"] * 3
    assert [(e["path"], e["request_id"]) for e in out.engine_errors] == [("add_request", f"r{i}") for i in range(3)]
    assert out.engine_errors[0]["exception"] == "EngineBug: add of 'r0' broke"
    assert "Traceback" in out.engine_errors[0]["traceback"] and "EngineBug" in out.engine_errors[0]["traceback"]


def test_a_rollback_that_raises_is_a_finding_and_the_request_is_rejected():
    engine = _RaisingEngine(raise_on={"abort"})
    spec = RequestSpec("multi", 0.0, "hello there", 2, 4, extra_prompts=("a short one", OVER_MAX_MODEL_LEN))
    out = _replay(engine, [spec, *_specs(2)])
    res = out.requests[0]
    assert res.outcome == "rejected" and "max_model_len" in res.detail and "rollback" in res.detail
    assert engine.aborted[0] == "multi-0"  # the engine tried to roll back the first admitted sibling
    err = out.engine_errors[0]
    assert (err["path"], err["request_id"]) == ("add_requests rollback", "multi")
    assert err["exception"] == "EngineBug: abort of 'multi-0' skipped its free"
    assert "RequestRejectedError" in err["traceback"]  # the refusal it was rolling back is in the chain
    assert [r.outcome for r in out.requests[1:]] == ["finished", "finished"]  # the replay went on


def test_a_raising_abort_is_a_finding_and_the_replay_goes_on():
    specs = _specs(3, action=ClientAction("abort-waiting"))
    out = _replay(_RaisingEngine(raise_on={"abort"}), specs)
    assert [r.outcome for r in out.requests] == ["abort-raised"] * 3
    assert [(e["path"], e["request_id"]) for e in out.engine_errors] == [("abort", f"r{i}") for i in range(3)]


def test_a_step_that_raises_a_few_times_is_retried():
    out = _replay(_RaisingEngine(raise_on={"step"}, step_failures=MAX_STEP_FAILURES - 1), _specs(2))
    assert [r.outcome for r in out.requests] == ["finished", "finished"]
    assert [e["path"] for e in out.engine_errors] == ["step"] * (MAX_STEP_FAILURES - 1)
    assert out.engine_errors[0]["request_id"] is None


def test_a_step_that_keeps_raising_stops_the_replay():
    engine = _RaisingEngine(raise_on={"step"})
    specs = _specs(2) + [RequestSpec("late", 30.0, "hello", 2, 4)]
    out = _replay(engine, specs)
    assert engine.num_steps == MAX_STEP_FAILURES  # no step after the bound, not even a drain
    assert [r.outcome for r in out.requests] == ["aborted", "aborted", "not-sent"]
    assert [e["path"] for e in out.engine_errors] == ["step"] * MAX_STEP_FAILURES
    assert any("step raised 3 times in a row" in n for n in out.notes), out.notes


def test_a_raising_census_at_an_idle_point_is_a_finding():
    out = _replay(_RaisingEngine(raise_on={"census"}), _specs(2))
    assert [r.outcome for r in out.requests] == ["finished", "finished"]
    assert out.idle_points == [] and {e["path"] for e in out.engine_errors} == {"idle-point census"}


def test_engine_errors_alone_are_the_engine_error_verdict_and_beside_a_leak_named_in_it():
    from vlite.diagnostics.checks.detect import detect
    from vlite.diagnostics.checks.snapshot import Snapshot

    snap = Snapshot(num_total_blocks=4, num_free_blocks=4, num_used_blocks=0, num_cached_blocks=0)
    f = detect(snap, [], [])
    assert f.verdict == "CLEAN"
    out = _replay(_RaisingEngine(raise_on={"abort"}), _specs(1, action=ClientAction("abort-waiting")))
    f.engine_errors = out.engine_errors
    assert f.verdict == "ENGINE-ERROR"
    assert f.summary().startswith("ENGINE-ERROR: 1 exception from the engine (abort 1; first: abort of r0: "
                                  "EngineBug: abort of 'r0' skipped its free)")
    f.leaked_blocks = [{"request_id": "r0", "block_id": 1}]
    assert f.verdict == "LEAK" and "1 exception from the engine (abort 1" in f.summary()


def test_skip_free_on_abort_on_the_all_paths_workload_is_a_leak_with_the_exceptions_listed(tiny_model_dir, tmp_path):
    """The all-paths workload's multi-prompt probe is refused for its length; the planted fault makes
    the rollback's abort raise. That is a LEAK (exit 1) whose report lists the exceptions."""
    from vlite.cli.main import app

    res = CliRunner().invoke(app, ["leak-check", "--model", str(tiny_model_dir), "--num-requests", "20",
                                   "--inject-fault", "skip-free-on-abort", "--report", str(tmp_path / "r")],
                             env={"COLUMNS": "200"})
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    assert res.exit_code == 1, res.output
    assert res.output.strip().splitlines()[-1].startswith("verdict: LEAK")
    assert "engine raised in add_requests rollback" in res.output and "PlantedFault" in res.output
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["verdict"] == "LEAK" and rep["drain"]["deficit_blocks"] > 0
    paths = {e["path"] for e in rep["engine_errors"]}
    assert {"add_requests rollback", "abort"} <= paths
    rollback = next(e for e in rep["engine_errors"] if e["path"] == "add_requests rollback")
    assert rollback["exception"].startswith("PlantedFault: planted fault skip-free-on-abort")
    assert "Traceback (most recent call last)" in rollback["traceback"]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## Exceptions from the engine" in md and "add_requests rollback" in md and "PlantedFault" in md


def test_a_client_that_replays_again_reports_each_replays_own_exceptions():
    # the cache probe replays its rounds through one client
    engine = _RaisingEngine(raise_on={"abort"})
    client = InProcessClient(engine, lambda: (0, None), stall_steps=20, view=_View(engine))
    first = client.replay(_specs(2, action=ClientAction("abort-waiting")), max_concurrency=4)
    again = client.replay([RequestSpec("x", 0.0, "hi", 1, 4, action=ClientAction("abort-waiting"))], max_concurrency=4)
    assert [e["request_id"] for e in first.engine_errors] == ["r0", "r1"]
    assert [e["request_id"] for e in again.engine_errors] == ["x"]
