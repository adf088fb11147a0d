"""Options of another mode are refused at once, in one line naming the subcommand they belong to,
instead of being ignored by a full replay."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from vlite.cli.main import app


@pytest.mark.parametrize("args,says", [
    (["--job", "vllm"], "--job applies to --watch or --prometheus"),
    (["--duration", "5", "--interval", "2"], "--duration applies to --watch or --prometheus: it is an option of `vlite leak-check watch`, not of `replay`"),
    (["--since", "2h"], "--since applies to --watch or --prometheus"),
    (["--prometheus", "http://127.0.0.1:9", "--job", "j", "--url", "http://127.0.0.1:9"],
     "--url names a live server: it is an option of `vlite leak-check url`"),
    (["--watch", "--url", "http://127.0.0.1:9", "--from-log", "x.log"],
     "--watch and --from-log cannot be combined: --watch runs `vlite leak-check watch`, --from-log runs `vlite leak-check log`; pick one"),
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
