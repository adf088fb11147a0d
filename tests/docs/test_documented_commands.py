"""Every command that README.md and docs/**/*.md show runs here and gives what its doc claims.

Each code block runs as a reader would run it, in order, in a scratch directory: ``vlite serve ... &``
starts a server the block's later commands use (on a free port in place of the doc's), and a
command that would load the default model runs on a tiny random model instead. A command's
trailing comment states its verdict and exit code (``# LEAK, exit 1``); with none it must exit 0.

A command that cannot run here (it needs a GPU, a real vLLM, a router, Prometheus, or it is this
test run itself) is listed in ``NOT_IN_CI`` with its reason and the script that runs it instead.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from doc_commands import DocCommand, documented_commands  # noqa: E402
from doc_runner import BlockSession, Outcome  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# What a command that cannot run here needs, as its doc marks it (``# needs: vLLM; ...``):
# why it does not run in CI, and the script that runs it instead.
NEEDS: dict[str, tuple[str, str]] = {
    "GPU": ("needs CUDA", "benchmarks/gpu/gpu_check.sh"),
    "vLLM": ("needs vLLM's own install", "tests/interop/vllm.sh"),
    "probe in vLLM": ("needs vLLM's own install with the probe", "tests/interop/vllm_probe.sh"),
    "router": ("needs a router in front of the replicas", "tests/interop/fleet.sh"),
    "Prometheus": ("needs a Prometheus server", "tests/interop/prometheus.sh"),
    "Ray cluster": ("needs a Ray cluster of several machines", "tests/engine/test_tensor_parallel.py"),
}
# Commands the docs show unmarked that still cannot run here: pattern -> (why, where instead).
NOT_IN_CI: dict[str, tuple[str, str]] = {
    r"^make test$": ("it is this test run itself", ".ci/run"),
    r"^st --config-file|^printf .*st\.toml": ("needs schemathesis's CLI against a live server",
                                             "tests/server/test_serve_schemathesis.py"),
}
_NEEDS = re.compile(r"^needs: ([^;,(]+?)(?:[;,(]|$)")
SETUP_NOISE = ("source .venv/bin/activate",)


def needs(cmd: DocCommand) -> str | None:
    """What the command's doc says it needs (``# needs: vLLM ...``), else None."""
    m = _NEEDS.match(cmd.comment)
    return m.group(1).strip() if m else None


def reason_not_in_ci(cmd: DocCommand) -> tuple[str, str] | None:
    """Why ``cmd`` does not run here and where it runs instead; None when it runs here."""
    kinds = [k.strip() for k in (needs(cmd) or "").split(",") if k.strip()]
    if kinds:
        return NEEDS.get(kinds[0], (f"needs {kinds[0]}", ""))
    for pattern, why in NOT_IN_CI.items():
        if re.search(pattern, cmd.text):
            return why
    return None


COMMANDS = documented_commands(ROOT)
BLOCKS: dict[tuple[str, int], list[DocCommand]] = {}
for _c in COMMANDS:
    BLOCKS.setdefault((_c.path, _c.block), []).append(_c)


def test_documented_commands_are_found():
    """The reader finds the README's commands (a broken reader would pass every other test vacuously)."""
    readme = [c.text for c in COMMANDS if c.path == "README.md"]
    assert "make run" in readme and "make test" in readme
    assert any(t.startswith("vlite leak-check") for t in readme)


def test_not_in_ci_entries_are_used_and_their_scripts_exist():
    """Each exemption matches a documented command, each ``needs:`` mark names a known need, and
    the place that runs such a command instead exists."""
    for pattern, (_, where) in NOT_IN_CI.items():
        assert any(re.search(pattern, c.text) for c in COMMANDS), f"no documented command matches {pattern!r}"
        assert (ROOT / where).exists(), f"{pattern!r} says it runs in {where}, which does not exist"
    for cmd in COMMANDS:
        for kind in filter(None, (k.strip() for k in (needs(cmd) or "").split(","))):
            assert kind in NEEDS, f"{cmd.where()}: '# needs: {kind}' is none of {', '.join(NEEDS)}"
    for _, where in NEEDS.values():
        assert (ROOT / where).exists(), f"{where} does not exist"


def _blocks_to_run():
    for (path, _block), cmds in BLOCKS.items():
        if any(reason_not_in_ci(c) is None and c.text not in SETUP_NOISE for c in cmds):
            yield pytest.param(cmds, id=f"{path}:{cmds[0].line}")


@pytest.fixture(scope="module")
def doc_model(tmp_path_factory) -> str:
    """A tiny random Llama whose 6 heads split over 1, 2, 3 or 6 tensor-parallel ranks."""
    from conftest import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("doc-model"), hidden_size=96, num_attention_heads=6,
                                    num_key_value_heads=6, intermediate_size=192))


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A scratch directory that looks like the repository root to a reader's relative paths."""
    for name in ("Makefile", "pyproject.toml", "vlite", "tests", "benchmarks", "docs", "README.md"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    return tmp_path


# Outcomes of commands already run in an earlier block, by the command as run: a page that repeats
# another's command (the README's tour and docs/distributed.md both show `vlite leak-check -tp 3`)
# checks the one outcome against its own claim instead of running it again. Only foreground vlite
# commands that use no server of their block and name no --report path are shared.
_OUTCOMES: dict[str, Outcome] = {}


def _shareable(text: str) -> bool:
    return (text.startswith("vlite ") and not text.endswith("&") and "--report" not in text
            and not re.search(r"localhost|127\.0\.0\.1|--url|--port", text))


@pytest.mark.parametrize("commands", list(_blocks_to_run()))
def test_documented_block(commands: list[DocCommand], doc_model: str, workdir: Path):
    """Run the block's commands in order; each gives the exit code and verdict its comment claims."""
    # one OpenMP thread a process, as the serve harness runs them: a server and the client that checks it
    # share 2 cores, and a server spinning on both delays the aborts it is judged on
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    session = BlockSession(workdir, doc_model, env)
    skipped, failures = [], []
    try:
        for cmd in commands:
            why = reason_not_in_ci(cmd)
            if why:
                skipped.append(f"{cmd.where()}: {why[0]} (runs in {why[1]})")
                continue
            prepared = session.prepare(cmd)
            out = _OUTCOMES.get(prepared) if _shareable(prepared) else None
            if out is None:
                out = session.run(cmd)
                if _shareable(prepared):
                    _OUTCOMES[prepared] = out
                print(f"{cmd.where()}: exit {out.exit_code} in {out.seconds:.1f} s: {out.ran}")
            else:
                print(f"{cmd.where()}: exit {out.exit_code}, as run for {out.command.where()}: {out.ran}")
            tail = out.output[-2000:]
            if out.exit_code != cmd.exit_code:
                failures.append(f"{cmd.where()}: `{out.ran}` exited {out.exit_code}, the doc says {cmd.exit_code}\n{tail}")
            elif cmd.verdict and not re.search(rf"(?<![\w-]){re.escape(cmd.verdict)}(?![\w-])", out.output):
                failures.append(f"{cmd.where()}: `{out.ran}` did not say {cmd.verdict}\n{tail}")
    finally:
        session.close()
    if skipped:
        print("not run here:\n  " + "\n  ".join(skipped))
    assert not failures, "\n\n".join(failures)
