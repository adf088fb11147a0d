"""EngineArgs: one set of engine flags on every command, one validated path to EngineConfig."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from vlite.cli import common
from vlite.cli.main import app
from vlite.engine.arg_utils import EngineArgs
from vlite.engine.config import EngineConfig

runner = CliRunner()

# Commands that build an engine, and whether they take --inject-fault.
COMMANDS = {("generate",): False, ("serve",): True, ("bench", "throughput"): False, ("bench", "latency"): False,
            ("leak-check",): True}

# Every EngineArgs flag with a value different from its default.
FLAGS = ["--model", "/no/such/model", "--dtype", "bfloat16", "--device", "cpu", "--seed", "7", "--block-size", "32",
         "--num-blocks", "77", "--kv-cache-memory-bytes", "12345", "--gpu-memory-utilization", "0.5",
         "--no-enable-prefix-caching", "--max-num-seqs", "9", "--max-num-batched-tokens", "333",
         "--max-model-len", "99", "--enforce-eager", "-tp", "2", "--distributed-executor-backend", "ray"]


class _Built(Exception):
    pass


@pytest.fixture
def captured(monkeypatch):
    """Record the EngineConfig a command builds, then stop the command before it loads a model."""
    configs: list[EngineConfig] = []
    real = common.create_engine_config

    def capture(engine_args):
        configs.append(real(engine_args))
        raise _Built

    monkeypatch.setattr(common, "create_engine_config", capture)
    return configs


def _invoke(*args):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def test_engine_args_defaults_are_engine_config_defaults():
    assert EngineArgs().create_engine_config() == EngineConfig()


@pytest.mark.parametrize("command", list(COMMANDS), ids=" ".join)
def test_every_command_accepts_every_engine_flag(command, captured):
    faults = ["--inject-fault", "double-free"] if COMMANDS[command] else []
    extra = ["--num-requests", "2", "--workload", "synthetic"] if command == ("leak-check",) else []
    res = _invoke(*command, *FLAGS, *faults, *extra)
    assert isinstance(res.exception, _Built), res.output
    [cfg] = captured
    assert (cfg.model, cfg.dtype, cfg.device) == ("/no/such/model", "bfloat16", "cpu")
    # generate's --seed is the per-request sampling seed; the engine keeps seed 0 there.
    assert cfg.seed == (0 if command == ("generate",) else 7)
    assert (cfg.cache.block_size, cfg.cache.num_blocks, cfg.cache.kv_cache_memory_bytes) == (32, 77, 12345)
    assert (cfg.cache.gpu_memory_utilization, cfg.cache.enable_prefix_caching) == (0.5, False)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_model_len) == \
        (9, 333, 99)
    assert cfg.enforce_eager is True
    assert (cfg.parallel.tensor_parallel_size, cfg.parallel.distributed_executor_backend) == (2, "ray")
    assert cfg.inject_faults == (("double-free",) if COMMANDS[command] else ())


@pytest.mark.parametrize("command", list(COMMANDS), ids=" ".join)
def test_help_lists_every_engine_flag_with_its_help(command):
    # leak-check's engine options are the replay's; its --help-all has their whole help
    res = _invoke(*command, "replay", "--help-all") if command == ("leak-check",) else _invoke(*command, "--help")
    assert res.exit_code == 0
    squeezed = "".join(res.output.split())  # help is wrapped (also after hyphens): compare without whitespace
    for f in EngineArgs.cli_fields():
        if f.name == "inject_faults" and not COMMANDS[command]:
            assert "--inject-fault" not in res.output
            continue
        for flag in f.metadata["flags"]:
            for name in flag.split("/"):
                assert name in res.output, (command, name)
        if f.name not in ("seed", "max_num_batched_tokens"):  # leak-check / bench / generate word these their own way
            assert "".join(f.metadata["help"].split()) in squeezed, (command, f.name)


def test_tp_short_flag_reaches_parallel_config(captured):
    res = _invoke("generate", "--model", "x", "-tp", "2")
    assert isinstance(res.exception, _Built), res.output
    assert captured[0].parallel.tensor_parallel_size == 2
    assert captured[0].parallel.distributed_executor_backend == "mp"


@pytest.mark.parametrize("args, message", [
    (["--distributed-executor-backend", "slurm"], "--distributed-executor-backend must be one of ('mp', 'ray')"),
    (["-tp", "0"], "--tensor-parallel-size must be >= 1, got 0"),
    (["--block-size", "12"], "--block-size must be a positive power of two, got 12"),
    (["--dtype", "int8"], "--dtype must be float32, bfloat16 or float16"),
    (["--num-blocks", "0"], "--num-blocks must be >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
])
@pytest.mark.parametrize("command", [("generate",), ("leak-check",), ("leak-check", "scenario", "all")], ids=" ".join)
def test_a_bad_engine_flag_is_exit_2_with_one_line_naming_the_flag(command, args, message):
    res = _invoke(*command, "--model", "/no/such/model", *args)
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.output


def test_serve_rejects_an_unknown_fault_before_anything_else():
    res = _invoke("serve", "--model", "/no/such/model", "--inject-fault", "nope")
    assert res.exit_code == 2
    assert "unknown fault 'nope'; known faults: skip-free-on-abort" in res.output


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from conftest import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("cli-tiny"))  # 4 query heads, 2 KV heads


@pytest.mark.parametrize("args, message", [
    (["-tp", "3"], "tensor_parallel_size 3 cannot split this model"),
    (["--dtype", "float16", "--device", "cpu"], "--dtype float16 needs CUDA"),
])
def test_serve_refuses_what_the_model_or_host_cannot_run_before_binding(tiny_dir, args, message, monkeypatch):
    # the check runs before the port is bound: a listener that would be reached means it did not
    from vlite.cli import serve

    monkeypatch.setattr(serve, "_check_can_listen", lambda *a: pytest.fail("got past the engine checks"))
    res = _invoke("serve", "--model", str(tiny_dir), *args)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output


def test_device_cuda_without_cuda_is_one_line(tiny_dir, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch, as in CI
    res = _invoke("generate", "hi", "--model", str(tiny_dir), "--device", "cuda")
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "sees no CUDA device; use --device cpu" in lines[0], res.output


def test_uvicorn_log_level_is_a_choice():
    res = _invoke("serve", "--model", "/no/such/model", "--uvicorn-log-level", "loud")
    assert res.exit_code == 2 and "'loud' is not one of" in res.output and "Traceback" not in res.output


def test_output_to_a_file_keeps_each_text_line_whole_and_tables_160_wide(capsys):
    from rich.table import Table

    console = common.make_console()  # captured stdout is not a terminal, as with `make run > file`
    verdict = "CLEAN: " + "a long verdict line " * 20  # 407 characters
    console.print(verdict)
    table = Table()
    table.add_column("request_id", overflow="fold")
    table.add_row("r" * 300)
    console.print(table)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].rstrip() == verdict.rstrip()  # not folded at 160 (or 80) columns
    assert max(len(line) for line in lines[1:]) == 160
