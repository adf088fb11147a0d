"""The timing line of an interrupted leak-check run counts only the requests that ended and says
what became of the others (sent and cut off by the Ctrl-C, never sent)."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from vlite.cli.leak_check_target import _timing
from vlite.diagnostics.workload.replay import ReplayResult, RequestResult, request_counts


def _replay(outcomes: list[tuple[str, str]], interrupted: str | None) -> ReplayResult:
    rs = [RequestResult(f"r{i}", "complete", "complete", 0.0, outcome=o, detail=d)
          for i, (o, d) in enumerate(outcomes)]
    return ReplayResult(rs, interrupted=interrupted)


def test_interrupted_run_counts_only_the_requests_that_ended():
    cut = ("aborted", "the run was interrupted (Ctrl-C): the client left")
    outcomes = [cut] * 3 + [("not-sent", "the run was interrupted before it was sent")] * 3000
    replay = _replay(outcomes, "interrupted (Ctrl-C) after 0 of 3003 requests had ended")
    run = SimpleNamespace(replay=replay, info={"replay_s": 0.6, "total_s": 2.0}, kind="in-process",
                          samples=pd.DataFrame({"t": range(5)}))
    line = _timing(run)
    assert line.startswith("0 of 3003 requests ended (3 sent: 3 in flight at Ctrl-C and aborted by it; 3000 never "
                           "sent) in 0.6 s"), line
    assert request_counts(replay) == {"total": 3003, "sent": 3, "ended": 0, "cut": 3, "in_flight": 0,
                                      "not_sent": 3000}


def test_a_full_run_counts_every_request_and_a_client_abort_as_ended():
    replay = _replay([("finished", ""), ("aborted", "the client disconnected after 2 chunks")], None)
    run = SimpleNamespace(replay=replay, info={"replay_s": 1.5, "total_s": 2.0}, kind="http",
                          samples=pd.DataFrame())
    assert _timing(run).startswith("2 requests in 1.5 s")
    assert request_counts(replay)["ended"] == 2
