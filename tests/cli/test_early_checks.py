"""Checks that need no model weights run before the model loads, and a KV cache that cannot fit
in memory is one line naming the option and the largest value that fits."""

from __future__ import annotations

import re
import time

import pytest
from typer.testing import CliRunner

from vlite.cli.main import app
from vlite.engine.kv_cache_fit import MemoryAvailable, check_kv_cache_fits

runner = CliRunner()
GiB = 1 << 30


def _invoke(*args):
    return runner.invoke(app, [*map(str, args)], env={"COLUMNS": "300"})


def _one_error_line(res) -> str:
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert "Traceback" not in res.output
    return lines[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from conftest import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("early-tiny"))


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if any command gets as far as loading the weights."""
    import vlite.engine.llm_engine as llm_engine

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", refuse)


def test_empty_prompt_fails_at_once_in_cli_words(no_model_load):
    t0 = time.perf_counter()
    # a model that does not exist: the prompt is checked first, before any model look-up
    line = _one_error_line(_invoke("generate", "", "--model", "/no/such/model"))
    assert time.perf_counter() - t0 < 2.0
    assert "PROMPT 1 of 1 is empty" in line and "prompt_token_ids" not in line
    line = _one_error_line(_invoke("generate", "fine", "  ", "--model", "/no/such/model"))
    assert "PROMPT 2 of 2 is empty" in line


def test_prompt_longer_than_max_model_len_fails_before_the_load(tiny_dir, no_model_load):
    line = _one_error_line(_invoke("generate", "hello there", "--model", tiny_dir, "--max-model-len", 10))
    assert "exceeds the model length of 10 tokens (--max-model-len)" in line
    n = int(re.search(r"(\d+) tokens\) \+ --max-tokens 64", line).group(1))
    assert f"lower --max-tokens to {10 - n} or less or raise --max-model-len" in line
    line = _one_error_line(_invoke("generate", "hi", "--model", tiny_dir, "--max-model-len", 100000))
    assert "--max-model-len 100000 exceeds the model's limit of 512 tokens" in line
    assert "the largest that fits is 512" in line


@pytest.mark.parametrize("args, option", [
    (["--kv-cache-memory-bytes", 10**15], "--kv-cache-memory-bytes"),
    (["--num-blocks", 10**10], "--num-blocks"),
])
def test_a_kv_cache_larger_than_memory_is_one_line_before_the_load(tiny_dir, no_model_load, args, option):
    import psutil

    line = _one_error_line(_invoke("generate", "hi", "--model", tiny_dir, *args))
    assert f"{option} {args[1]}" in line and "does not fit" in line and "available memory (psutil)" in line
    largest = int(re.search(rf"the largest {option} that fits is (\d+)", line).group(1))
    assert 0 < largest * (1 if option == "--kv-cache-memory-bytes" else 8192) <= psutil.virtual_memory().total


def test_serve_says_which_option_does_not_fit_before_binding(tiny_dir, monkeypatch):
    from vlite.cli import serve

    monkeypatch.setattr(serve, "_check_can_listen", lambda *a: pytest.fail("got past the engine checks"))
    line = _one_error_line(_invoke("serve", "--model", tiny_dir, "--num-blocks", 10**10))
    assert "--num-blocks 10000000000 does not fit" in line and "the largest --num-blocks that fits is" in line
    assert "RuntimeError" not in line


def test_the_largest_value_named_is_one_that_fits():
    avail = MemoryAvailable(10 * GiB, "available memory (test)")
    per_block = 1 << 20
    with pytest.raises(ValueError, match=r"^--num-blocks 100000 does not fit") as err:
        check_kv_cache_fits(num_blocks=100_000, kv_cache_memory_bytes=None, bytes_per_block=per_block, block_size=16,
                            device_type="cpu", weights_to_load=1 * GiB, available=avail)
    largest = int(re.search(r"the largest --num-blocks that fits is (\d+)", str(err.value)).group(1))
    assert largest == int(9 * GiB * 0.9) // per_block
    check_kv_cache_fits(num_blocks=largest, kv_cache_memory_bytes=None, bytes_per_block=per_block, block_size=16,
                        device_type="cpu", weights_to_load=1 * GiB, available=avail)  # fits: no error
    with pytest.raises(ValueError, match="--num-blocks"):
        check_kv_cache_fits(num_blocks=largest + 1, kv_cache_memory_bytes=None, bytes_per_block=per_block,
                            block_size=16, device_type="cpu", weights_to_load=1 * GiB, available=avail)
    with pytest.raises(ValueError, match=r"^--kv-cache-memory-bytes \d+ \(.*GiB\) does not fit") as err:
        check_kv_cache_fits(num_blocks=None, kv_cache_memory_bytes=100 * GiB, bytes_per_block=per_block,
                            block_size=16, device_type="cpu", available=avail)
    largest = int(re.search(r"the largest --kv-cache-memory-bytes that fits is (\d+)", str(err.value)).group(1))
    assert largest % per_block == 0 and largest <= 9 * GiB
    check_kv_cache_fits(num_blocks=None, kv_cache_memory_bytes=largest, bytes_per_block=per_block, block_size=16,
                        device_type="cpu", available=avail)
    # a GPU: the free memory torch reports; the byte budget is a CPU option, so only --num-blocks is checked
    gpu = MemoryAvailable(2 * GiB, "free GPU memory (torch.cuda.mem_get_info)")
    check_kv_cache_fits(num_blocks=None, kv_cache_memory_bytes=100 * GiB, bytes_per_block=per_block, block_size=16,
                        device_type="cuda", available=gpu)
    with pytest.raises(ValueError, match=r"free GPU memory \(torch.cuda.mem_get_info\) is 2.0 GiB"):
        check_kv_cache_fits(num_blocks=4096, kv_cache_memory_bytes=None, bytes_per_block=per_block, block_size=16,
                            device_type="cuda", available=gpu)


def test_the_engine_checks_again_right_before_allocating(tiny_checkpoint, monkeypatch):
    """LLMEngine itself (the API, and `vlite serve`'s engine core) refuses before torch.zeros."""
    import vlite.engine.kv_cache_fit as fit
    from vlite.engine import LLMEngine
    from vlite.engine.config import CacheConfig, EngineConfig

    monkeypatch.setattr(fit, "available_memory", lambda device_type: MemoryAvailable(64 << 20, "available memory"))
    config = EngineConfig(model="tiny", device="cpu", cache=CacheConfig(num_blocks=1_000_000))
    with pytest.raises(ValueError, match=r"--num-blocks 1000000 does not fit.*the largest --num-blocks that fits is"):
        LLMEngine(config, checkpoint=tiny_checkpoint)


def test_weight_estimate_matches_the_loaded_model(tiny_checkpoint):
    from vlite.engine.kv_cache_fit import estimate_weight_bytes

    params = sum(t.numel() for t in tiny_checkpoint.state_dict.values())
    assert estimate_weight_bytes(tiny_checkpoint.config, "float32") == pytest.approx(params * 4, rel=0.01)
