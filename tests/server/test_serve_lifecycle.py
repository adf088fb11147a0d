"""Life cycle: 503 while loading, SIGINT/SIGTERM with requests in flight, and the AsyncLLMEngine
loop itself (aborts, rejected adds, planted faults), in-process on a tiny model."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading

import httpx
import pytest
from conftest import build_tiny_model_dir, make_engine
from serve_harness import ServerProcess

from vlite.engine import AsyncLLMEngine, EngineNotRunningError, EngineRequest
from vlite.engine.core.sequence import RequestOrigin
from vlite.engine.llm_engine import RequestRejectedError
from vlite.engine.sampling_params import SamplingParams
from vlite.entrypoints.api_server import create_app
from vlite.entrypoints.state import ServerSettings


def _request(rid: str, prompt: str = "hello there", max_tokens: int = 400, **kw) -> EngineRequest:
    return EngineRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw),
                         RequestOrigin(rid, route="test"))


def _run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ---- AsyncLLMEngine ------------------------------------------------------------------------------
def test_abort_mid_stream_frees_blocks_and_loop_keeps_serving(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=64)

    async def main():
        aengine = AsyncLLMEngine(engine)
        aengine.start()
        try:
            group = await aengine.add_requests([_request("a")])
            outputs = []
            async for _, out in group:
                outputs.append(out)
                if len(outputs) == 3:
                    group.abort()
                    break
            assert group.all_finished
            stats = await aengine.run_on_engine(lambda e: e.stats())
            assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
            assert await aengine.run_on_engine(lambda e: e.live_state()["live_request_ids"]) == []
            # the loop still serves
            async with await aengine.add_requests([_request("b", max_tokens=5)]) as g2:
                finals = [out async for _, out in g2 if out.finished]
            assert finals[0].outputs[0].finish_reason == "length" and len(finals[0].outputs[0].token_ids) == 5
        finally:
            await aengine.shutdown()
        assert not aengine.is_running

    _run(main())


def test_engine_abort_ends_the_stream_with_abort_and_observes_it(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=64)
    seen = []

    async def main():
        aengine = AsyncLLMEngine(engine, on_output=seen.append)
        aengine.start()
        try:
            group = await aengine.add_requests([_request("x-0"), _request("x-1")])
            finals = {}
            async for i, out in group:
                if len(out.outputs[0].token_ids) == 2 and not finals:
                    aengine.abort(["x-0", "x-1"])  # from the engine's side, as shutdown does
                if out.finished:
                    finals[i] = out
            assert {i: o.outputs[0].finish_reason for i, o in finals.items()} == {0: "abort", 1: "abort"}
            assert aengine.latest_stats.num_used_blocks == 0
        finally:
            await aengine.shutdown()

    _run(main())
    assert [o.request_id for o in seen if o.finished] == ["x-0", "x-1"]


def test_abort_of_n3_and_beam_requests_ends_every_choice_once(tiny_checkpoint):
    """An abort ends the one engine request of n samples (or W beams) with one output per
    choice, and every block comes back with no ledger anomaly (no double free)."""
    engine = make_engine(tiny_checkpoint, num_blocks=64)

    async def main():
        aengine = AsyncLLMEngine(engine)
        aengine.start()
        try:
            sampled = EngineRequest("hello there", SamplingParams(max_tokens=200, temperature=1.0, seed=3, n=3,
                                                                  ignore_eos=True), RequestOrigin("s", route="test"))
            beams = EngineRequest("hello there", SamplingParams(max_tokens=200, temperature=0, beam_width=3, n=2,
                                                                ignore_eos=True), RequestOrigin("b", route="test"))
            group = await aengine.add_requests([sampled, beams])
            finals = {}
            async for i, out in group:
                if i == 0 and len(out.outputs) == 3 and len(out.outputs[2].token_ids) >= 2 and not finals:
                    aengine.abort(["s", "b"])  # as shutdown does; the beams are mid-search (no outputs yet)
                if out.finished:
                    finals[i] = out
            assert [(c.index, c.finish_reason) for c in finals[0].outputs] == [(0, "abort"), (1, "abort"),
                                                                               (2, "abort")]
            assert [(c.index, c.finish_reason) for c in finals[1].outputs] == [(0, "abort"), (1, "abort")]
            stats = await aengine.run_on_engine(lambda e: e.stats())
            assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)
            assert await aengine.run_on_engine(lambda e: e.ledger_anomalies()) == []
        finally:
            await aengine.shutdown()

    _run(main())


def test_rejected_add_is_atomic(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, num_blocks=64)

    async def main():
        aengine = AsyncLLMEngine(engine)
        aengine.start()
        try:
            with pytest.raises(RequestRejectedError, match="maximum context length"):
                await aengine.add_requests([_request("ok"), _request("too-long", max_tokens=100_000)])
            live = await aengine.run_on_engine(lambda e: e.live_state()["live_request_ids"])
            assert live == [] and aengine.latest_stats.num_used_blocks == 0
        finally:
            await aengine.shutdown()
        with pytest.raises(EngineNotRunningError):
            await aengine.add_requests([_request("late")])

    _run(main())


def test_planted_fault_in_abort_is_logged_and_loop_lives(tiny_checkpoint, caplog):
    engine = make_engine(tiny_checkpoint, num_blocks=64, faults=("skip-free-on-abort",))

    async def main():
        aengine = AsyncLLMEngine(engine)
        aengine.start()
        try:
            group = await aengine.add_requests([_request("leak")])
            async for _ in group:
                group.abort()
                break
            leaked = await aengine.run_on_engine(lambda e: [r.request_id for r in e.ledger()])
            assert leaked and set(leaked) == {"leak"}
            async with await aengine.add_requests([_request("next", max_tokens=3)]) as g2:
                finals = [out async for _, out in g2 if out.finished]
            assert finals[0].outputs[0].finish_reason == "length"
        finally:
            await aengine.shutdown()

    with caplog.at_level(logging.ERROR, logger="vlite.async_engine"):
        _run(main())
    assert any("abort of request 'leak' failed" in r.getMessage() and r.exc_info for r in caplog.records)


# ---- the app: 503 while loading and after shutdown ----------------------------------------------
def test_503_while_loading_then_ready_then_shutting_down(tiny_checkpoint):
    release = threading.Event()

    def load():
        release.wait(30)
        return make_engine(tiny_checkpoint, num_blocks=32)

    app = create_app(ServerSettings(), load)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                r = await http.get("/health")
                assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
                r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 503 and set(r.json()["error"]) == {"message", "type", "param", "code"}
                assert (await http.get("/version")).status_code == 200
                release.set()
                for _ in range(300):
                    if (await http.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        # lifespan exited: shutting down
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]

    _run(main())
    assert not app.state.server.engine.is_running


# ---- signals: abort in flight, exit 0 ----------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_aborts_in_flight_and_exits_zero(tmp_path_factory, sig):
    model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("sig-tiny"), max_position_embeddings=2048)
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("sig-log") / "server.log", "--num-blocks", "160")
    try:
        srv.wait_ready()
        body = {"prompt": "keep going", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            srv.send_signal(sig)
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        assert srv.wait_exit(timeout=30) == 0
        log = srv.log()
        assert "aborting 1 request(s) in flight" in log and "engine loop stopped" in log
    finally:
        srv.stop()


def test_a_port_in_use_is_a_one_line_error_before_the_model_loads(tiny_model_dir, monkeypatch):
    import socket

    from typer.testing import CliRunner

    import vlite.engine.llm_engine as llm_engine
    from vlite.cli.main import app

    def must_not_load(*a, **k):
        raise AssertionError("the engine was started although the port is taken")

    monkeypatch.setattr(llm_engine, "LLMEngine", must_not_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model_dir), "--port", str(port)])
    assert result.exit_code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.output and "pick another --port" in result.output


def test_a_max_model_len_beyond_the_model_is_refused_before_binding(tiny_model_dir, monkeypatch):
    import socket

    from typer.testing import CliRunner

    import vlite.cli.serve as serve_cli
    from vlite.cli.main import app

    def must_not_bind(*a, **k):
        raise AssertionError("the port was bound although max_model_len cannot be served")

    monkeypatch.setattr(serve_cli, "_check_can_listen", must_not_bind)
    with socket.socket() as probe:  # a free port, so only the length can fail
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = CliRunner().invoke(app, ["serve", "--model", str(tiny_model_dir), "--port", str(port),
                                      "--max-model-len", "100000"])
    assert result.exit_code == 2, result.output
    assert "--max-model-len 100000 exceeds the model's limit of" in result.output
