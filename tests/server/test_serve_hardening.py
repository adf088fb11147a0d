"""`vlite serve` against bad input: a 4xx for every bad request, never a 5xx, never a stall.

One server (tiny random Llama) for the module. Each kind of fault has its issue's example plus
the rest of its kind: every text field, every integer field, every float field.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import httpx
import pytest
from conftest import build_tiny_model_dir
from serve_harness import ServerProcess, read_metrics, running, wait_drained

MODEL = "tiny-llama"
NUM_BLOCKS = 128
MAX_MODEL_LEN = 1024
MAX_N = 8
LIMIT_CONCURRENCY = 16
HEADER_TIMEOUT_S = 1.0
VOCAB = 49152  # SmolLM2's tokenizer, used by the tiny model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("hardening-tiny"), max_position_embeddings=MAX_MODEL_LEN)
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("hardening-log") / "server.log",
                        "--served-model-name", MODEL, "--num-blocks", str(NUM_BLOCKS), "--max-n", str(MAX_N),
                        "--header-read-timeout", str(HEADER_TIMEOUT_S),
                        "--limit-concurrency", str(LIMIT_CONCURRENCY))
    yield from running(srv)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def post_raw(http: httpx.Client, path: str, raw: bytes | str) -> httpx.Response:
    """POST bytes as they are (httpx's json= cannot encode a lone surrogate)."""
    if isinstance(raw, str):
        raw = raw.encode()
    return http.post(path, content=raw, headers={"content-type": "application/json"})


def post_json(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST ``body`` as JSON with ASCII escapes (so "\\ud800" goes out as the escape) and
    Python's Infinity/NaN literals, which Python's JSON decoder (the server's) accepts."""
    return post_raw(http, path, json.dumps(body))


def assert_400(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def chat(content="hi", role="user", **extra) -> dict:
    return {"messages": [{"role": role, "content": content}], "max_tokens": 1, **extra}


# ---- kind 1: text that is not valid Unicode ----------------------------------------------------------
SURROGATE = "\ud800"
TEXT_FIELDS = [
    ("/v1/completions", {"prompt": SURROGATE, "max_tokens": 1}, "prompt"),  # the example
    ("/v1/completions", {"prompt": ["fine", "x" + SURROGATE], "max_tokens": 1}, "prompt.1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "model": SURROGATE}, "model"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stop": SURROGATE}, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stop": ["ok", SURROGATE]}, "stop.1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "user": SURROGATE}, "user"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "suffix": SURROGATE}, "suffix"),
    ("/v1/chat/completions", chat(SURROGATE), "messages.0.content"),
    ("/v1/chat/completions", chat(role=SURROGATE), "messages.0.role"),
    ("/v1/chat/completions", chat([{"type": "text", "text": SURROGATE}]), "messages.0.content.0.text"),
    ("/v1/chat/completions", chat([{"type": SURROGATE, "text": "x"}]), "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": SURROGATE}]},
     "messages.0.name"),
    ("/v1/chat/completions", chat(model=SURROGATE), "model"),
    ("/v1/chat/completions", chat(stop=[SURROGATE]), "stop.0"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages.0.content"),
    ("/tokenize", {"prompt": "x", "model": SURROGATE}, "model"),
    ("/detokenize", {"tokens": [1], "model": SURROGATE}, "model"),
]


@pytest.mark.parametrize("path,body,param", TEXT_FIELDS, ids=[p for _, _, p in TEXT_FIELDS])
def test_lone_surrogate_in_any_text_field_is_400_naming_it(http, path, body, param):
    err = assert_400(post_json(http, path, body), param)
    assert "not valid Unicode" in err["message"] or "Input should be" in err["message"]


def test_raw_invalid_utf8_bytes_are_400(http):
    # ED A0 80 is the UTF-8-style encoding of U+D800, which UTF-8 forbids.
    err = assert_400(post_raw(http, "/v1/completions", b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 1}'), "prompt")
    assert "not valid Unicode" in err["message"]
    assert_400(post_raw(http, "/v1/chat/completions",
                        b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 1}'),
               "messages.0.content")
    # a valid surrogate *pair* is one character, and fine
    assert post_raw(http, "/v1/completions", '{"prompt": "\\ud83d\\ude00", "max_tokens": 1}').status_code == 200


def test_surrogate_in_a_field_name_is_400(http):
    err = assert_400(post_json(http, "/v1/completions", {"prompt": "x", "max_tokens": 1, SURROGATE: 1}), None)
    assert "unicode" in err["message"].lower()
    assert post_json(http, "/v1/completions", {"prompt": "x", "max_tokens": 1, "unknown": 1}).status_code == 200


# ---- kind 2: non-finite numbers in responses ----------------------------------------------------------
def strict_json(text: str):
    """json.loads that refuses Infinity / NaN, as a JSON parser other than Python's does."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def greedy_logprob(http, prompt: str) -> tuple[str, float]:
    out = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                             "logprobs": 2}).json()["choices"][0]["logprobs"]
    return out["tokens"][0], out["token_logprobs"][0]


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"top_p": 0.01}, {"min_p": 1.0}],
                         ids=["top_k", "top_p", "min_p"])
def test_filtered_logprobs_are_the_models_and_finite(http, extra):
    token, want = greedy_logprob(http, "hi")
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 2, "seed": 3, **extra})
    assert r.status_code == 200, r.text  # the example (top_k 1) was a 500
    lp = strict_json(r.text)["choices"][0]["logprobs"]
    # only the top token survives the filter: it is sampled, with the model's own log-probability
    assert lp["tokens"][0] == token and lp["token_logprobs"][0] == pytest.approx(want, abs=1e-4)
    assert lp["token_logprobs"][0] < 0  # not the filtered distribution's 0.0
    top = lp["top_logprobs"][0]
    assert len(top) == 2 and all(-9999.0 <= v <= 0 and math.isfinite(v) for v in top.values())
    assert top[token] == pytest.approx(want, abs=1e-4)


def test_filtered_chat_logprobs_are_finite_with_the_requested_count(http):
    r = http.post("/v1/chat/completions", json=chat("hi", max_tokens=3, top_k=1, logprobs=True, top_logprobs=2,
                                                    ignore_eos=True))
    assert r.status_code == 200, r.text
    content = strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for t in content:
        assert -9999.0 <= t["logprob"] < 0 and len(t["top_logprobs"]) == 2
        assert t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"], abs=1e-4)  # top_k 1 picks the top


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "top_k": 1, "logprobs": 5, "ignore_eos": True}),
    ("/v1/chat/completions", chat("hi", max_tokens=4, top_p=0.01, logprobs=True, top_logprobs=5, ignore_eos=True)),
], ids=["completions", "chat"])
def test_streamed_logprob_events_are_valid_json(http, path, body):
    with http.stream("POST", path, json=dict(body, stream=True)) as resp:
        assert resp.status_code == 200
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [strict_json(d) for d in data[:-1]]  # a bare -Infinity fails here
    if path == "/v1/completions":
        tops = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["top_logprobs"]]
        assert len(tops) == 4 and all(len(t) == 5 for t in tops)
    else:
        tokens = [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["content"]]
        assert len(tokens) == 4 and all(len(t["top_logprobs"]) == 5 for t in tokens)


# ---- kind 3: integers out of range; booleans are not integers -------------------------------------------
BAD_INTEGERS = [
    ({"seed": 2**64}, "seed"),  # the example (was a 500)
    ({"seed": 2**63}, "seed"),  # was accepted and wrapped to -2**63
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": True}, "seed"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"stop_token_ids": [False]}, "stop_token_ids.0"),
    ({"prompt": [[False]]}, "prompt.0.0"),
    ({"prompt": [True, 5]}, "prompt.0"),
    ({"prompt": [2**63]}, "prompt"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"prompt": [-1]}, "prompt.0"),
    ({"n": 0}, "n"),
    ({"n": MAX_N + 1}, "n"),
    ({"n": True}, "n"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": MAX_N + 1, "n": 1, "use_beam_search": True}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logit_bias": {"1": 5, "99999999": 1}}, "logit_bias"),  # a token id outside the vocabulary
]


@pytest.mark.parametrize("fields,param", BAD_INTEGERS, ids=[f"{p}={v}"[:40] for f, p in BAD_INTEGERS
                                                             for v in [list(f.values())[0]]])
def test_integer_out_of_range_is_400_with_param(server, http, fields, param):
    before = read_metrics(server)
    assert_400(post_json(http, "/v1/completions", {"prompt": "x", "max_tokens": 1, **fields}), param)
    assert read_metrics(server)["vlite:prompt_tokens_total"] == before["vlite:prompt_tokens_total"]


BAD_CHAT_INTEGERS = [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                     ({"top_logprobs": -1, "logprobs": True}, "top_logprobs"),
                     ({"max_completion_tokens": 0}, "max_completion_tokens"),
                     ({"max_completion_tokens": MAX_MODEL_LEN + 1}, "max_completion_tokens"),
                     ({"n": MAX_N + 1}, "n"), ({"seed": 2**63}, "seed")]


@pytest.mark.parametrize("fields,param", BAD_CHAT_INTEGERS, ids=[p for _, p in BAD_CHAT_INTEGERS])
def test_chat_integer_out_of_range_is_400_with_param(http, fields, param):
    assert_400(post_json(http, "/v1/chat/completions", chat(**fields)), param)


@pytest.mark.parametrize("tokens,param", [([True], "tokens.0"), ([-1], "tokens.0"), ([VOCAB], "tokens"),
                                          ([2**63], "tokens")])
def test_detokenize_token_out_of_range_is_400(http, tokens, param):
    assert_400(post_json(http, "/detokenize", {"tokens": tokens}), param)


def test_integer_bounds_themselves_are_accepted(http):
    for fields in ({"seed": 2**63 - 1}, {"seed": -(2**63)}, {"stop_token_ids": [VOCAB - 1]}, {"top_k": 2**31 - 1},
                   {"n": MAX_N}, {"logprobs": 20}, {"prompt": [VOCAB - 1]}, {"max_tokens": 100, "min_tokens": 100}):
        r = post_json(http, "/v1/completions", {"prompt": "x", "max_tokens": 1, **fields})
        assert r.status_code == 200, (fields, r.text)


# ---- kind 4: floats out of range ----------------------------------------------------------------------
INF, NAN = float("inf"), float("nan")
BAD_FLOATS = [
    ("temperature", INF), ("temperature", NAN), ("temperature", 1e308), ("temperature", 1e-300),
    ("temperature", -0.5), ("temperature", 100.5), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", NAN), ("top_p", INF),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", NAN),
    ("repetition_penalty", INF), ("repetition_penalty", 0.0), ("repetition_penalty", 1e-300),
    ("repetition_penalty", 1e7), ("repetition_penalty", NAN),
    ("presence_penalty", 2.5), ("presence_penalty", -INF), ("frequency_penalty", -2.5), ("frequency_penalty", NAN),
    ("length_penalty", 10.5), ("length_penalty", INF),
]


@pytest.mark.parametrize("name,value", BAD_FLOATS, ids=[f"{n}={v}" for n, v in BAD_FLOATS])
def test_float_out_of_range_is_400_with_param(http, name, value):
    assert_400(post_json(http, "/v1/completions", {"prompt": "x", "max_tokens": 1, name: value}), name)
    assert_400(post_json(http, "/v1/chat/completions", chat(**{name: value})), name)


def test_float_bounds_themselves_are_accepted(http):
    for fields in ({"temperature": 0.01}, {"temperature": 100}, {"temperature": 0}, {"top_p": 1e-9},
                   {"repetition_penalty": 0.01}, {"repetition_penalty": 1e6}, {"presence_penalty": -2},
                   {"min_p": 1.0}):
        r = post_json(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, **fields})
        assert r.status_code == 200, (fields, r.text)


# ---- kind 5: chat roles and content parts ---------------------------------------------------------------
@pytest.mark.parametrize("role", ["unknownrole", "", "tool", "function", "USER"])
def test_unsupported_role_is_400(http, role):
    err = assert_400(post_json(http, "/v1/chat/completions", chat(role=role)), "messages.0.role")
    assert "'system', 'user' or 'assistant'" in err["message"]


def test_malformed_content_parts_say_what_is_wrong(http):
    err = assert_400(post_json(http, "/v1/chat/completions", chat([{"type": "text"}])), "messages")
    assert "'text' field" in err["message"] and "not supported" not in err["message"]
    err = assert_400(post_json(http, "/v1/chat/completions", chat([{"type": "image_url"}])), "messages")
    assert "'image_url' are not supported" in err["message"]
    assert_400(post_json(http, "/v1/chat/completions", chat([{"text": "no type"}])), "messages.0.content.0.type")
    ok = post_json(http, "/v1/chat/completions", chat([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]))
    assert ok.status_code == 200
    for role in ("system", "assistant"):
        body = {"messages": [{"role": role, "content": "x"}, {"role": "user", "content": "y"}], "max_tokens": 1}
        assert post_json(http, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize("role", ["user", "system"])
def test_a_user_or_system_message_without_content_is_400(http, role):
    for message in ({"role": role}, {"role": role, "content": None}):
        body = {"messages": [message, {"role": "user", "content": "y"}] if role == "system" else [message],
                "max_tokens": 1}
        err = assert_400(post_json(http, "/v1/chat/completions", body), "messages.0.content")
        assert f"a '{role}' message needs content" in err["message"]
    # empty text is content (OpenAI accepts it), and an assistant turn may omit it
    assert post_json(http, "/v1/chat/completions", chat("")).status_code == 200
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None},
                         {"role": "user", "content": "y"}], "max_tokens": 1}
    assert post_json(http, "/v1/chat/completions", body).status_code == 200


# ---- kind 6: fan-out ------------------------------------------------------------------------------------
def test_fan_out_is_bounded_by_max_n(server, http):
    assert_400(post_json(http, "/v1/completions", {"prompt": "x", "max_tokens": 1, "n": 1000}), "n")  # issue's
    err = assert_400(post_json(http, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 3}), "n")
    assert "9 choices" in err["message"] and f"at most {MAX_N}" in err["message"]
    assert_400(post_json(http, "/v1/completions", {"prompt": [[1]] * (MAX_N + 1), "max_tokens": 1}), "n")
    assert_400(post_json(http, "/v1/chat/completions", chat(n=1000)), "n")
    r = post_json(http, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1, "n": MAX_N // 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_N
    wait_drained(server)


# ---- kind 7: expensive work off the event loop ------------------------------------------------------------
def _health_latencies(base_url: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=base_url, timeout=30) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            out.append(time.perf_counter() - t0)
            time.sleep(0.02)


@pytest.mark.parametrize("path,make_body,param", [
    ("/v1/completions", lambda big: {"prompt": big, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", lambda big: chat(big), "messages"),
    ("/tokenize", lambda big: {"prompt": big}, "prompt"),
], ids=["completions", "chat", "tokenize"])
def test_huge_prompt_is_refused_at_once_and_health_stays_fast(server, http, path, make_body, param):
    big = "word " * 1_260_000  # 6.3 MB, under the 8 MiB body limit: 1.26M tokens, far over 1024
    latencies: list[float] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_health_latencies, args=(server.base_url, stop, latencies))
    watcher.start()
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            err = assert_400(http.post(path, json=make_body(big)), param)
            assert "characters" in err["message"]
            assert time.perf_counter() - t0 < 3.0  # not tokenized: before, 4-7 s each
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert latencies and max(latencies) < 1.0, latencies  # before, /health stalled for seconds


def test_long_prompt_under_the_character_bound_is_tokenized_then_refused(http):
    # 3000 tokens: few enough characters to pass the cheap bound, too many tokens for the model
    err = assert_400(http.post("/v1/completions", json={"prompt": "word " * 3000, "max_tokens": 1}), "prompt")
    assert "maximum context length is 1024" in err["message"]


# ---- kind 8: limits and HTTP semantics ------------------------------------------------------------------
def test_chunked_body_over_the_limit_is_413(http):
    chunk = b" " * (1 << 20)

    def body():  # no Content-Length: httpx sends it chunked
        yield b'{"prompt": "'
        for _ in range(9):  # 9 MiB > the 8 MiB default limit
            yield chunk
        yield b'", "max_tokens": 1}'

    r = http.post("/v1/completions", content=body(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text  # was 400 "There was an error parsing the body"
    assert r.json()["error"]["code"] == "request_too_large" and r.headers["connection"] == "close"
    assert http.post("/v1/completions", json={"prompt": "after", "max_tokens": 1}).status_code == 200


def _half_header_socket(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ")
    return s


def _closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_half_sent_header_is_closed_after_the_header_timeout(server):
    socks = [_half_header_socket(server.port) for _ in range(5)]
    try:
        t0 = time.monotonic()
        assert all(_closed_by_server(s, HEADER_TIMEOUT_S + 5) for s in socks)  # was: open forever
        assert time.monotonic() - t0 < HEADER_TIMEOUT_S + 5
    finally:
        for s in socks:
            s.close()
    # a keep-alive connection that starts a second request and stalls is closed too
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert _closed_by_server(s, HEADER_TIMEOUT_S + 5)
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_limit_concurrency_refuses_new_requests_with_503(server):
    socks = [_half_header_socket(server.port) for _ in range(LIMIT_CONCURRENCY)]
    try:
        time.sleep(0.2)
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 503
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(server.base_url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_unhandled_exception_is_500_with_connection_close():
    """Starlette re-raises an unhandled exception after the 500 and uvicorn drops the connection:
    the 500 must say ``Connection: close`` (in-process app, no server needed)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vlite.entrypoints.errors import install_error_handlers
    from vlite.entrypoints.middleware import RequestIdMiddleware

    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500 and r.headers["connection"] == "close"
    assert r.json()["error"]["type"] == "server_error" and "RuntimeError: a bug" in r.json()["error"]["message"]


# ---- kind 9: the OpenAPI document -------------------------------------------------------------------------
def test_openapi_documents_real_statuses_and_media_types(http):
    doc = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"200", "400", "401", "404", "413", "503"} <= set(responses), path
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"} and "500" in doc["paths"][path]["post"][
            "responses"]
    assert doc["paths"]["/health"]["get"]["responses"]["200"].get("content", {}) == {}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    seed = doc["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (-(2**63), 2**63 - 1)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    r = http.get("/health")
    assert r.status_code == 200 and r.content == b""
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_400(http, path):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = http.post(path, json=body | {"max_tokens": 2, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    assert "stream: true" in r.json()["error"]["message"]
    ok = http.post(path, json=body | {"max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert ok.status_code == 200


@pytest.mark.parametrize("content, content_type, said", [
    (b"prompt=hi&max_tokens=2", "application/x-www-form-urlencoded", "sent as application/x-www-form-urlencoded"),
    (b'["hi"]', "application/json", "must be a JSON object"),
])
def test_a_body_that_is_not_a_json_object_says_so(http, content, content_type, said):
    r = http.post("/v1/completions", content=content, headers={"Content-Type": content_type})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "must be a JSON object with Content-Type: application/json" in message and said in message
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
