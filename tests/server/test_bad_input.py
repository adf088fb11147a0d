"""Bad input raises a clear error and leaves no block allocated."""

from __future__ import annotations

import pytest
from conftest import make_engine
from typer.testing import CliRunner

from vlite.cli.main import app
from vlite.engine.config import CacheConfig, SchedulerConfig
from vlite.engine.llm_engine import RequestRejectedError
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.loader import ModelNotFoundError, resolve_model


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"min_p": 2.0}, r"min_p must be in \[0, 1\]"),
    ({"top_k": -5}, "top_k must be"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"stop": [""]}, "stop must be non-empty"),
    # non-finite and out-of-range floats, int64 seeds, booleans are not integers
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": 1e-300}, r"temperature must be 0 \(greedy\) or in \[0.01, 100\]"),
    ({"temperature": 1e308}, r"temperature must be 0 \(greedy\) or in \[0.01, 100\]"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
    ({"repetition_penalty": 1e-300}, r"repetition_penalty must be in \[0.01, 1e\+06\]"),
    ({"top_p": float("nan")}, "top_p must be a finite number"),
    ({"length_penalty": 11.0}, r"length_penalty must be in \[-10, 10\]"),
    ({"seed": 2**63}, r"seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"),
    ({"seed": -(2**63) - 1}, "seed must be an integer in"),
    ({"seed": True}, "seed must be an integer in"),
    ({"top_k": True}, "top_k must be an integer"),
    ({"top_k": 2**31}, "top_k must be"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"stop_token_ids": [False]}, "stop_token_ids must be non-negative integers"),
    ({"logprobs": True}, "logprobs must be an integer in"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_param_bounds_are_accepted():
    for kwargs in ({"temperature": 0.01}, {"temperature": 100}, {"seed": 2**63 - 1}, {"seed": -(2**63)},
                   {"repetition_penalty": 0.01}, {"repetition_penalty": 1e6}, {"length_penalty": -10.0},
                   {"top_k": 2**31 - 1}, {"logprobs": 20}):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"block_size": 12}, {"block_size": 0}, {"num_blocks": 0},
                                    {"gpu_memory_utilization": 1.5}])
def test_invalid_cache_config(kwargs):
    with pytest.raises(ValueError):
        CacheConfig(**kwargs)


def test_invalid_scheduler_config():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_rejected_requests_allocate_nothing_and_do_not_block_the_queue(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=8, block_size=4, max_model_len=256)
    ok = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    cases = [
        (dict(prompt=""), "non-empty"),
        (dict(prompt=None, prompt_token_ids=[]), "empty"),
        (dict(prompt=None, prompt_token_ids=[10**9]), "outside the vocabulary"),
        (dict(prompt="x " * 300), "maximum context length is 256"),
        (dict(prompt=None, prompt_token_ids=list(range(10, 40))), "whole KV cache has 8"),  # 34 tokens > 32 slots
    ]
    for kwargs, match in cases:
        with pytest.raises(RequestRejectedError, match=match):
            engine.add_request(sampling_params=ok, **kwargs)
        s = engine.stats()
        assert s.num_free_blocks == s.num_total_blocks and s.num_waiting == 0
    engine.add_request("fits", ok, request_id="dup")
    with pytest.raises(RequestRejectedError, match="already in use"):
        engine.add_request("again", ok, request_id="dup")
    out = engine.generate(["still serving"], ok)[0]
    assert len(out.outputs[0].token_ids) == 4
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    assert s.num_free_blocks + s.num_cached_blocks == 8 and s.num_used_blocks == 0


def test_unknown_model_gives_a_clear_error():
    with pytest.raises(ModelNotFoundError, match="no model hub is reachable"):
        resolve_model("meta-llama/Llama-3-8B")


def test_a_file_that_is_not_a_model_is_named_as_such(tmp_path):
    not_a_model = tmp_path / "README.md"
    not_a_model.write_text("# hello\n")
    with pytest.raises(ModelNotFoundError, match="is a file but not a .gguf model"):
        resolve_model(str(not_a_model))


def test_cli_reports_bad_input_with_exit_code_2():
    runner = CliRunner()
    res = runner.invoke(app, ["generate", "hi", "--model", "/nonexistent/model"])
    assert res.exit_code == 2 and "not found" in res.output
    res = runner.invoke(app, ["generate", "hi", "--temperature", "-1"])
    assert res.exit_code == 2 and "temperature must be >= 0" in res.output
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("vlite ")
