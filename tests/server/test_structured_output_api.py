"""Structured output over HTTP: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` on
/v1/chat/completions and /v1/completions, streaming and not, n > 1, the 400s, and no matcher
left behind after a client disconnects (one ``vlite serve`` of a tiny random Llama).

A random model given a grammar that allows any whitespace between JSON tokens keeps emitting
whitespace (OpenAI warns of the same for JSON mode), so the schemas here that must finish ask
for compact JSON: ``structured_outputs.disable_any_whitespace``, or llguidance's own
``"x-guidance": {"whitespace_flexible": false}`` inside a ``response_format`` schema.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from conftest import build_tiny_model_dir
from serve_harness import ServerProcess, running, wait_drained, wait_until

MODEL = "tiny-llama"
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Describe a person as JSON"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("so-tiny"), max_position_embeddings=2048)
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("so-log") / "server.log", "--served-model-name", MODEL,
                        "--num-blocks", "128", "--enable-debug-endpoints")
    yield from running(srv)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def sse_events(lines):
    for line in lines:
        if line.startswith("data: "):
            if line == "data: [DONE]":
                return
            yield json.loads(line[len("data: "):])


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema | COMPACT, "strict": True}}


def matchers(http: httpx.Client) -> int:
    return http.get("/debug/blocks").json()["view"]["registries"]["structured_output.matchers"]


def test_chat_json_schema_non_streaming_and_streaming(server, http):
    for temperature in (0.0, 1.0):
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 64, "temperature": temperature, "seed": 3, "n": 2,
                "response_format": json_schema_format(PERSON)}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 2
        for choice in choices:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
        texts, reasons = ["", ""], [None, None]
        with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as resp:
            for event in sse_events(resp.iter_lines()):
                for c in event["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
                    reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
        assert reasons == ["stop", "stop"]
        for text in texts:
            jsonschema.validate(json.loads(text), PERSON)
        if temperature == 0.0:  # greedy: the stream carries the same text as the JSON body
            assert texts == [c["message"]["content"] for c in choices]
    wait_drained(server)
    assert matchers(http) == 0


def test_completions_response_format_and_structured_outputs(server, http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "JSON:", "max_tokens": 64, "temperature": 0,
                                           "response_format": json_schema_format(PERSON)})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop"
    jsonschema.validate(json.loads(c["text"]), PERSON)
    cases = [({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             ({"choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
             ({"json": PERSON, "disable_any_whitespace": True}, lambda t: jsonschema.validate(json.loads(t), PERSON)
              is None),
             ({"grammar": 'start: "a" | "b" "c"'}, lambda t: t in ("a", "bc"))]
    for structured, ok in cases:
        body = {"model": MODEL, "prompt": ["first", "second"], "max_tokens": 40, "temperature": 1.0, "n": 2,
                "structured_outputs": structured, "stream": True}
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            for event in sse_events(resp.iter_lines()):
                for ch in event["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                    if ch["finish_reason"]:
                        finish[ch["index"]] = ch["finish_reason"]
        assert sorted(texts) == [0, 1, 2, 3] and set(finish.values()) == {"stop"}, (structured, texts, finish)
        assert all(ok(t) for t in texts.values()), (structured, texts)


def test_json_object_forces_an_object(server, http):
    # JSON mode with any whitespace: a random model does not finish, but its first character is "{".
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 1.0, "seed": 1,
            "response_format": {"type": "json_object"}}
    for _ in range(2):
        c = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert c["message"]["content"].lstrip().startswith("{"), c
        body["seed"] += 1
    text = http.post("/v1/chat/completions", json=body | {"response_format": {"type": "text"}}).json()
    assert text["choices"][0]["message"]["content"]  # "text" is no constraint


def assert_400(r: httpx.Response, param: str, *fragments: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    for fragment in fragments:
        assert fragment in err["message"], err
    assert "\n" not in err["message"]


def test_invalid_constraints_are_400_before_queueing(server, http):
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 8}
    cases = [
        ({"response_format": json_schema_format({"type": "foo"})}, "response_format", "invalid JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "needs json_schema.schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "invalid regex", "unclosed character class"),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", "invalid grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice must be a non-empty list"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"json": "{oops"}}, "structured_outputs", "not valid JSON"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "not supported"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
         "not both"),
        ({"guided_json": PERSON}, "guided_json", "removed in vLLM 0.12", '"structured_outputs": {"json": ...}'),
        ({"guided_choice": ["a"]}, "guided_choice", "removed in vLLM 0.12"),
        ({"use_beam_search": True, "best_of": 2, "temperature": 0, "structured_outputs": {"regex": "a"}},
         "use_beam_search", "beam search does not support structured outputs"),
    ]
    for extra, param, *fragments in cases:
        assert_400(http.post("/v1/chat/completions", json=chat | extra), param, *fragments)
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 8, "response_format": json_schema_format({"type": 1})}
    assert_400(http.post("/v1/completions", json=completion), "response_format", "invalid JSON schema")
    r = http.post("/v1/chat/completions", json=chat | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad name!", "schema": {}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.name"  # OpenAI's pattern
    snap = http.get("/debug/blocks").json()
    assert snap["sequences"] == [] and snap["view"]["registries"]["structured_output.matchers"] == 0
    assert "ignored unknown request fields: 'guided" not in server.log()  # refused, not "ignored"


def test_contradicting_constraints_are_a_400_not_a_500(server, http):
    # The grammar allows only "d"; bad_words bans it: no token is left at the first step. That is
    # the client's contradiction (a 400, an error event when streaming), and nothing stays behind.
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0,
            "structured_outputs": {"choice": ["d"]}, "bad_words": ["d"]}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "leave no token to generate" in err["message"]
    assert "bad_words" in err["message"] and len(err["message"]) < 200  # one short line, no matcher dump
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
        events = list(sse_events(s.iter_lines()))
    errors = [e["error"] for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["type"] == "invalid_request_error", events
    assert "leave no token" in errors[0]["message"]
    wait_drained(server)
    assert matchers(http) == 0
    ok = http.post("/v1/completions", json=body | {"bad_words": []})  # the server keeps serving
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "d"


def test_disconnect_mid_stream_leaves_no_matcher(server, http):
    # An array of at least 1000 items cannot close within 900 tokens: both samples stream until
    # the client goes away.
    long_array = {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 1000},
                  "disable_any_whitespace": True}
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 900, "temperature": 1.0, "n": 2, "stream": True,
            "structured_outputs": long_array}
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "so-disconnect"}) as resp:
        events = sse_events(resp.iter_lines())
        wait_until(lambda: next(events)["choices"][0]["delta"].get("content"))
        snap = http.get("/debug/blocks").json()
        assert [q["request_id"] for q in snap["sequences"]] == ["so-disconnect"] * 2
        assert snap["view"]["registries"]["structured_output.matchers"] == 2  # one per sample
    wait_drained(server)
    assert matchers(http) == 0
    coverage = http.get("/debug/blocks").json()["view"]["coverage"]
    assert coverage["finish_reasons"].get("abort", 0) >= 2
