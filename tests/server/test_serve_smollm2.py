"""`vlite serve` with the real default model (SmolLM2-135M-Instruct): chat through the official client
answers correctly, streaming gives the same greedy text, and a disconnect frees every block.

(Greedy parity with the offline engine is checked on tiny models in test_serve_api.py; loading
SmolLM2 a second time in the test process would double this test's cost.)"""

from __future__ import annotations

import openai
import pytest
from serve_harness import ServerProcess, read_metrics, running, wait_drained

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess("SmolLM2-135M-Instruct", tmp_path_factory.mktemp("smol-log") / "server.log",
                        "--num-blocks", "128")
    yield from running(srv)


def test_smollm2_chat_stream_and_disconnect(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert 0 < chat.usage.completion_tokens <= 16 and chat.usage.prompt_tokens > 10
    # streaming gives the same greedy text as the non-streaming call
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content

    # a streaming client that leaves after 3 chunks: aborted, every block back
    before = read_metrics(server)
    stream = client.completions.create(model=model, prompt="Write a long story about a dragon.", max_tokens=1000,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    after = wait_drained(server)
    assert after["vlite:request_success_total{abort}"] == before["vlite:request_success_total{abort}"] + 1


def test_readme_structured_output_example_finishes_with_valid_json(server):
    """The README's structured-output curl, sent as written: it ends by itself ("stop"), not at
    max_tokens, and its text is JSON valid against the schema."""
    import json
    import re
    from pathlib import Path

    import httpx

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    body = json.loads(re.search(r"-d '(\{\"messages\".*?\})'  # structured output", readme, re.DOTALL).group(1))
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    schema = body["response_format"]["json_schema"]["schema"]
    assert set(value) == set(schema["required"]) and isinstance(value["name"], str) and isinstance(value["age"], int)
