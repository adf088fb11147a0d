"""Options that only mean something with --watch or --prometheus are refused without them, at
once, instead of being ignored by a full replay (found by a fresh user's trial)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from vlite.cli.main import app


@pytest.mark.parametrize("args,says", [
    (["--job", "vllm"], "--job applies to --watch or --prometheus"),
    (["--duration", "5", "--interval", "2"], "--duration, --interval apply to --watch or --prometheus"),
    (["--since", "2h"], "--since applies to --watch or --prometheus"),
    (["--prometheus", "http://127.0.0.1:9", "--job", "j", "--url", "http://127.0.0.1:9"], "pick one"),
    (["--watch", "--url", "http://127.0.0.1:9", "--from-log", "x.log"], "--from-log reads a server's log"),
])
def test_watch_options_without_watch_are_one_line_errors(args, says):
    res = CliRunner().invoke(app, ["leak-check", *args])
    assert res.exit_code == 2, res.output
    assert says in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("args,says", [
    (["--prompt-source", "lorem"], "unknown --prompt-source 'lorem'; choose one of: distinct, word-list"),
    (["--cache-probe-requests", "10", "--url", "http://127.0.0.1:9"], "--cache-probe-requests applies to the in-process"),
    (["--n", "2"], "--n applies to --workload synthetic; all-paths sets each request's n itself"),
    (["--n", "3", "--workload", "kind-waves"], "--n applies to --workload synthetic; kind-waves sets"),
])
def test_workload_variety_options_refuse_bad_values_in_one_line(args, says):
    res = CliRunner().invoke(app, ["leak-check", *args])
    assert res.exit_code == 2, res.output
    assert says in res.output and "Traceback" not in res.output
