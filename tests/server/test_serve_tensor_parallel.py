"""``vlite serve -tp 2`` with the openai client: the same greedy tokens as one rank, /metrics and
/debug/blocks as usual; then a worker killed mid-stream: the stream ends with an error naming the
rank, the server exits non-zero within seconds, and no worker is left behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import psutil
import pytest
from conftest import build_tiny_model_dir, make_engine
from serve_harness import ServerProcess, running, wait_drained

from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.loader import load_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7] * 9]


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny4kv-serve"), num_key_value_heads=4)


@pytest.fixture
def server(tiny4_dir, tmp_path):
    yield from running(ServerProcess(tiny4_dir, tmp_path / "serve.log", "-tp", "2", "--num-blocks", "64",
                                     "--enable-debug-endpoints"))


def _workers(pid: int) -> list[psutil.Process]:
    """The rank processes: spawned descendants of the server that start no processes of their own
    (the engine core process, the server's default, is their parent)."""
    spawned = [p for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
    parents = {p.ppid() for p in spawned}
    return [p for p in spawned if p.pid not in parents]


def test_serve_tp2_matches_one_rank_then_survives_nothing_of_a_killed_worker(server, tiny4_dir):
    one = make_engine(load_checkpoint(str(tiny4_dir)), num_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in one.generate(PROMPTS, params)]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    got = [client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for prompt in PROMPTS]
    assert got == expected
    m = wait_drained(server)  # /metrics reads the engine process's block manager, as with one rank
    assert m["vlite:num_total_blocks"] == 64
    blocks = httpx.get(server.base_url + "/debug/blocks", timeout=10).json()
    assert blocks["num_total_blocks"] == 64

    workers = _workers(server.proc.pid)
    assert len(workers) == 2
    stream = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError) as err:
        for i, _chunk in enumerate(stream):
            if i == 2:
                os.kill(workers[1].pid, signal.SIGKILL)
                killed = time.monotonic()
    assert "rank 1" in str(err.value)
    code = server.wait_exit(timeout=20)
    assert code != 0
    assert time.monotonic() - killed < 20
    assert "tensor-parallel rank 1" in server.log()
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert alive == []
