"""POST /v1/responses and GET /v1/responses/{id} on a real `vlite serve` (tiny random Llama):
the answer equals the chat route's on the same messages (greedy), previous_response_id carries
the conversation, a stream's deltas add up to its final response, a disconnect mid-stream gives
every block back, and the store is bounded by size and by age."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from conftest import build_tiny_model_dir
from serve_harness import ServerProcess, running, wait_drained

from vlite.entrypoints.response_store import ResponseStore

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("responses-tiny"))
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("responses-log") / "server.log", "--served-model-name",
                        MODEL, "--num-blocks", "128")
    yield from running(srv)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def _chat(client, messages, max_tokens=8) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def test_a_response_is_the_chat_answer_and_previous_response_id_continues_it(client, server):
    first = client.responses.create(model=MODEL, input="Name a colour.", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert first.id.startswith("resp_") and first.status in ("completed", "incomplete")
    assert first.output_text == _chat(client, [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Name a colour."}])
    assert first.usage.output_tokens == 8 or first.status == "completed"
    second = client.responses.create(model=MODEL, input="And another?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.output_text == _chat(client, [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"}])
    stored = httpx.get(f"{server.base_url}/v1/responses/{first.id}").json()
    assert stored["id"] == first.id and stored["output"][0]["content"][0]["text"] == first.output_text
    wait_drained(server)


def test_a_stream_adds_up_to_its_response(client):
    events = list(client.responses.create(model=MODEL, input="Count to five.", max_output_tokens=6,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == _chat(client, [{"role": "user", "content": "Count to five."}], 6)


def test_store_false_unknown_ids_and_background(client, server):
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2, store=False)
    assert httpx.get(f"{server.base_url}/v1/responses/{r.id}").status_code == 404
    with pytest.raises(openai.NotFoundError, match="previous response"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_0000", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=2)


def test_a_client_that_leaves_mid_stream_gives_every_block_back(server):
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 400, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http, http.stream("POST", "/v1/responses",
                                                                                json=body) as resp:
        assert resp.status_code == 200
        deltas = 0
        for line in resp.iter_lines():
            deltas += '"response.output_text.delta"' in line
            if deltas >= 3:
                break  # leaves: closing the connection aborts the engine request
    m = wait_drained(server)
    assert m["vlite:num_free_blocks"] + m["vlite:num_cached_blocks"] == m["vlite:num_total_blocks"]


def test_the_store_is_bounded_by_size_and_by_age(monkeypatch):
    store = ResponseStore(max_entries=3, ttl_s=10.0)
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    for i in range(5):
        store.put({"id": f"resp_{i}"}, [])
    assert len(store) == 3 and store.get("resp_0") is None and store.get("resp_4") is not None
    now[0] += 10.5
    assert store.get("resp_4") is None and len(store) == 0
