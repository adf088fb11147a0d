"""`vlite serve` over real HTTP: one server (tiny random Llama) for the whole module.

The official ``openai`` package for the happy paths (completions, chat, streaming, n=2),
raw httpx for the edge cases (error shapes, auth, sizes) and for disconnects.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import build_tiny_model_dir, make_engine
from serve_harness import ServerProcess, read_metrics, running, wait_drained, wait_until

from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.loader import load_checkpoint

API_KEY = "sk-vlite-test"
MODEL = "tiny-llama"
MAX_BODY = 64 * 1024
NUM_BLOCKS = 128
LONG = 2000  # max_tokens of requests meant to be cut short (they would run for seconds)
N_LONG = 500  # the same for n = 2 or 3: the engine admits n * blocks(prompt + max_tokens) <= NUM_BLOCKS
PROMPTS = [f"Request number {i}: tell me about block {i * 7} of the paged cache" for i in range(16)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("serve-tiny"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    srv = ServerProcess(model_dir, log, "--served-model-name", MODEL, "--num-blocks", str(NUM_BLOCKS),
                        "--max-num-batched-tokens", "256", "--max-request-body-bytes", str(MAX_BODY),
                        "--enable-debug-endpoints", api_key=API_KEY)
    yield from running(srv)


@pytest.fixture(scope="module")
def offline(model_dir):
    """The offline engine on the same weights: the reference for greedy outputs."""
    return make_engine(load_checkpoint(str(model_dir)), num_blocks=256)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c


def greedy(offline, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in offline.generate(prompts, params)]


def sse_events(lines):
    """Parse ``data:`` lines of an SSE stream into JSON objects; stop at [DONE]."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)


# ---- happy paths through the official client ---------------------------------------------------
def test_models_health_version(server, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200  # no key needed
    assert http.get("/version").json()["version"]


def test_completion_greedy_equals_offline(client, offline):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion"
    assert out.choices[0].text == greedy(offline, [PROMPTS[0]], 12)[0]
    assert out.choices[0].finish_reason == "length"
    n_prompt = len(offline.tokenizer(PROMPTS[0]).input_ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        n_prompt, 12, n_prompt + 12)


def test_completion_prompt_list_and_token_ids(client, offline):
    ids = offline.tokenizer(PROMPTS[2]).input_ids
    out = client.completions.create(model=MODEL, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    ref = greedy(offline, [PROMPTS[1], PROMPTS[2]], 6)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == ref
    assert by_ids.choices[0].text == ref[1]


def test_chat_greedy_and_streaming_agree(client, offline):
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    text = offline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = offline.tokenizer(text, add_special_tokens=False).input_ids
    ref = offline.generate([ids], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10

def test_chat_without_max_tokens_fills_the_kv_cache_share_of_each_choice(client):
    """No max_tokens: OpenAI's "up to the context length", capped so that all n choices fit the
    KV cache at once: (num_blocks // n) * block_size tokens each, prompt included (16-token
    blocks, the server's default; the context, 4096 tokens, is not the bound here)."""
    n = 8
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "block " * 200}], n=n,
                                         temperature=1.0, seed=0, extra_body={"ignore_eos": True})
    per_choice = (NUM_BLOCKS // n) * 16 - out.usage.prompt_tokens
    assert 0 < per_choice < 40  # the prompt fills most of each choice's share
    assert sorted(c.index for c in out.choices) == list(range(n))
    assert {c.finish_reason for c in out.choices} == {"length"}
    assert out.usage.completion_tokens == n * per_choice



def test_streaming_completion_n2(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, n=2, temperature=1.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts, finish = {0: "", 1: ""}, {}
    usage = None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "length", 1: "length"}
    assert all(texts.values())
    assert usage.completion_tokens == 16

    out = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=5, n=2, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 10


def test_sixteen_concurrent_streams_equal_offline(server, offline):
    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == greedy(offline, PROMPTS, 16)
    wait_drained(server)


def test_stop_string_streaming_and_not(client, offline):
    ref = greedy(offline, [PROMPTS[4]], 20)[0]
    stop = ref[len(ref) // 2: len(ref) // 2 + 3]
    want = ref[: ref.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=20, temperature=0, stop=[stop])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=20, temperature=0, stop=[stop],
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want


def test_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=4, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0 and value == pytest.approx(max(top.values()))  # greedy = top-1
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_tokenize_detokenize(http, offline):
    r = http.post("/tokenize", json={"prompt": "Hello paged world"})
    assert r.status_code == 200
    assert r.json()["tokens"] == offline.tokenizer("Hello paged world").input_ids
    assert r.json()["count"] == len(r.json()["tokens"]) and r.json()["max_model_len"] == 4096
    assert http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"] == "Hello paged world"


def test_metrics_names(http):
    text = http.get("/metrics").text
    for name in ("vlite:num_requests_running", "vlite:num_requests_waiting", "vlite:kv_cache_usage_perc",
                 "vlite:num_preemptions_total", "vlite:prompt_tokens_total", "vlite:generation_tokens_total",
                 "vlite:num_free_blocks", "vlite:num_cached_blocks", "vlite:num_total_blocks"):
        assert f'{name}{{model_name="{MODEL}"}}' in text, name
    assert f'vlite:request_success_total{{finished_reason="length",model_name="{MODEL}"}}' in text
    for hist in ("vlite:time_to_first_token_seconds", "vlite:inter_token_latency_seconds",
                 "vlite:request_time_per_output_token_seconds", "vlite:e2e_request_latency_seconds"):
        assert f'{hist}_bucket{{le="+Inf",model_name="{MODEL}"}}' in text, hist
    assert f'vlite:num_total_blocks{{model_name="{MODEL}"}} {float(NUM_BLOCKS)}' in text
    rss = [line for line in text.splitlines() if line.startswith("process_resident_memory_bytes ")]
    assert len(rss) == 1 and float(rss[0].split()[1]) > 10e6  # the server process, as on vLLM's /metrics


def _histogram_count_sum(text: str, name: str) -> tuple[float, float]:
    values = {}
    for line in text.splitlines():
        for part in ("_count", "_sum"):
            if line.startswith(f'{name}{part}{{model_name="{MODEL}"}} '):
                values[part] = float(line.split()[-1])
    return values["_count"], values["_sum"]


def test_request_phase_histograms_add_up(http):
    phases = ("queue", "prefill", "decode", "inference")
    names = [f"vlite:request_{p}_time_seconds" for p in phases] + ["vlite:e2e_request_latency_seconds"]
    before = {n: _histogram_count_sum(http.get("/metrics").text, n) for n in names}
    r = http.post("/v1/completions", json={"prompt": "phase timing", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200
    after = {n: _histogram_count_sum(http.get("/metrics").text, n) for n in names}
    delta = {n.split(":")[1]: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in names}
    assert all(count == 1 for count, _ in delta.values()), delta
    t = {k.removeprefix("request_").removesuffix("_time_seconds"): v[1] for k, v in delta.items()}
    assert all(v >= 0 for v in t.values())
    # prefill + decode lie inside inference, and queue + inference inside the end-to-end latency
    assert t["prefill"] + t["decode"] <= t["inference"] + 1e-6
    assert t["queue"] + t["inference"] <= t["e2e_request_latency_seconds"] + 1e-3
    assert t["decode"] > 0  # 4 tokens: three decode steps


def test_request_tpot_histogram_is_decode_time_per_token_after_the_first(http):
    """vLLM's vllm:request_time_per_output_token_seconds: one observation per finished request,
    its decode time / (output tokens - 1); a one-token request observes 0."""
    names = ["vlite:request_time_per_output_token_seconds", "vlite:request_decode_time_seconds"]
    before = {n: _histogram_count_sum(http.get("/metrics").text, n) for n in names}
    r = http.post("/v1/completions", json={"prompt": "tpot timing", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    mid = {n: _histogram_count_sum(http.get("/metrics").text, n) for n in names}
    (tpot_n, tpot_s), (dec_n, dec_s) = ((mid[n][0] - before[n][0], mid[n][1] - before[n][1]) for n in names)
    assert tpot_n == 1 and dec_n == 1 and dec_s > 0
    assert abs(tpot_s - dec_s / 4) <= 1e-6 * max(1.0, dec_s)
    r = http.post("/v1/completions", json={"prompt": "one token", "max_tokens": 1})
    assert r.status_code == 200
    after = _histogram_count_sum(http.get("/metrics").text, names[0])
    assert after[0] - mid[names[0]][0] == 1 and after[1] == mid[names[0]][1]


# ---- request id and origin -----------------------------------------------------------------------
def test_request_id_echo_and_origin_in_debug_blocks(server, http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert len(r.headers["x-request-id"]) >= 16  # generated
    headers = {"X-Request-Id": "origin-test-1", "X-Vlite-Client-Tag": "tagged"}
    body = {"model": MODEL, "prompt": "A prompt used once, so no block of it is cached yet", "max_tokens": LONG,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        assert resp.headers["x-request-id"] == "origin-test-1"
        events = sse_events(resp.iter_lines())  # keep a reference: dropping it closes the connection
        next(events)  # running: it has produced a token
        snap = http.get("/debug/blocks").json()
        seqs = [s for s in snap["sequences"] if s["request_id"] == "origin-test-1"]
        assert len(seqs) == 1 and seqs[0]["status"] == "running" and seqs[0]["block_table"]
        origin = seqs[0]["origin"]
        assert (origin["request_id"], origin["route"], origin["client_tag"]) == (
            "origin-test-1", "/v1/completions", "tagged")
        held = [e for e in snap["ledger"] if e["request_id"] == "origin-test-1"]
        assert sorted(e["block_id"] for e in held) == sorted(seqs[0]["block_table"])
        assert all(snap["ref_counts"][str(b)] == 1 for b in seqs[0]["block_table"])  # held by this sequence alone
        assert held[0]["origin"]["route"] == "/v1/completions" and held[0]["site"] in ("prefill", "prefix cache hit")
        assert snap["num_used_blocks"] >= len(seqs[0]["block_table"]) and snap["num_running"] == 1
        assert set(snap) >= {"num_total_blocks", "num_free_blocks", "num_cached_blocks", "kv_cache_usage",
                             "num_waiting", "anomalies", "live_state"}
        assert "origin-test-1" in snap["live_state"]["live_request_ids"]
    wait_drained(server)
    after = http.get("/debug/blocks").json()
    assert after["sequences"] == [] and after["ledger"] == [] and after["anomalies"] == []
    assert after["ref_counts"] == {}  # every block back to 0: free or cached


# ---- bad input: OpenAI error shapes, nothing reaches the engine ------------------------------------
def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 5}, None),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),  # more than the model's context length
    ({"prompt": "word " * 4100, "max_tokens": 1}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "logit_bias": {"1": 500}}, "logit_bias"),  # bias outside [-100, 100]
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),  # best_of sampling: only with use_beam_search
    ({"prompt": "x", "use_beam_search": True, "best_of": 3, "temperature": 0.7}, "temperature"),
    ({"prompt": "x", "use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "x", "use_beam_search": True}, "best_of"),  # width n = 1 is no beam search
    ({"prompt": "x", "use_beam_search": True, "best_of": 2, "stop": ["."]}, "stop"),
    ({"prompt": "x", "use_beam_search": True, "best_of": 2, "logprobs": 1}, "logprobs"),
    ({"prompt": "x", "use_beam_search": True, "best_of": 2, "presence_penalty": 1}, "presence_penalty"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[str(i) for i in range(len(BAD_COMPLETIONS))])
def test_invalid_completion_is_400_and_never_reaches_engine(server, http, body, param):
    before = read_metrics(server)
    err = assert_error(http.post("/v1/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"
    after = read_metrics(server)
    assert after["vlite:prompt_tokens_total"] == before["vlite:prompt_tokens_total"]
    assert after["vlite:num_free_blocks"] + after["vlite:num_cached_blocks"] == NUM_BLOCKS
    assert http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 1}).status_code == 200


def test_invalid_chat_and_json_are_400(http):
    chat_beam = {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "best_of": 2}
    assert_error(http.post("/v1/chat/completions", json=dict(chat_beam, temperature=1.0)), 400, "temperature")
    assert_error(http.post("/v1/chat/completions", json=dict(chat_beam, n=3)), 400, "best_of")
    assert_error(http.post("/v1/chat/completions", json=dict(chat_beam, stop="x")), 400, "stop")
    assert_error(http.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(http.post("/v1/chat/completions", json={"messages": "hello"}), 400, "messages")
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "max_completion_tokens": -3}), 400,
                 "max_completion_tokens")
    assert_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "messages")
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400)


def test_auth_401(server):
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers)
        assert assert_error(r, 401)["code"] == "invalid_api_key"
    assert_error(httpx.get(server.base_url + "/metrics"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_model_and_route_404(http, client):
    err = assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/debug/nothing"), 404)


def test_oversized_body_413(http):
    r = http.post("/v1/completions", json={"prompt": "y" * (MAX_BODY + 1), "max_tokens": 1})
    assert assert_error(r, 413)["code"] == "request_too_large"
    assert http.post("/v1/completions", json={"prompt": "after 413", "max_tokens": 1}).status_code == 200


# ---- disconnects: the request is aborted and every block comes back ----------------------------------
def _long_body(stream: bool) -> dict:
    return {"model": MODEL, "prompt": PROMPTS[7], "max_tokens": LONG, "ignore_eos": True, "stream": stream}


def _disconnects(server) -> dict[str, int]:
    """vlite:client_disconnects{route, when} as {"<route> <when>": count} (the leak check's API checklist)."""
    from vlite.diagnostics.checks.coverage import from_metrics_text

    text = httpx.get(server.base_url + "/metrics", headers=server.headers, timeout=10).text
    return from_metrics_text(text).get("disconnects", {})


def _rejections(server) -> dict[str, int]:
    """vlite:request_rejected{stage} as {stage: count}."""
    from vlite.diagnostics.checks.coverage import from_metrics_text

    text = httpx.get(server.base_url + "/metrics", headers=server.headers, timeout=10).text
    return from_metrics_text(text).get("rejections", {})


def _counted_once(before: dict[str, int], after: dict[str, int], key: str) -> None:
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {key: 1}


def test_stream_closed_after_three_chunks_frees_blocks(server, http):
    before = wait_drained(server)
    left = _disconnects(server)
    with http.stream("POST", "/v1/completions", json=_long_body(True)) as resp:
        events = sse_events(resp.iter_lines())
        chunks = [next(events) for _ in range(3)]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        assert read_metrics(server)["vlite:num_requests_running"] == 1
    after = wait_drained(server)
    assert after["vlite:request_success_total{abort}"] == before["vlite:request_success_total{abort}"] + 1
    assert after["vlite:generation_tokens_total"] - before["vlite:generation_tokens_total"] < LONG
    _counted_once(left, _disconnects(server), "/v1/completions mid-stream")


def test_stream_closed_before_first_token_frees_blocks(server, http):
    before = wait_drained(server)
    # A long prompt: chunked prefill takes several steps, so the client leaves before any token.
    body = dict(_long_body(True), prompt="tok " * 1500, max_tokens=500)
    left = _disconnects(server)
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200  # headers only: the request is in the engine; no chunk read
    after = wait_drained(server)
    assert after["vlite:request_success_total{abort}"] == before["vlite:request_success_total{abort}"] + 1
    assert after["vlite:request_success_total{length}"] == before["vlite:request_success_total{length}"]
    _counted_once(left, _disconnects(server), "/v1/completions before first token")


def test_non_streaming_client_timeout_frees_blocks(server):
    before = wait_drained(server)
    left = _disconnects(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=_long_body(False), headers=server.headers,
                   timeout=httpx.Timeout(10, read=0.5))
    after = wait_drained(server)
    assert after["vlite:request_success_total{abort}"] == before["vlite:request_success_total{abort}"] + 1
    assert after["vlite:generation_tokens_total"] - before["vlite:generation_tokens_total"] < LONG
    _counted_once(left, _disconnects(server), "/v1/completions non-streaming")


def test_multi_prompt_with_one_prompt_too_long_is_400_and_nothing_of_it_runs(server, http):
    # sglang#28380 / vllm#27420: the prompt that fits is admitted first, then the engine refuses
    # the one over max_model_len (found only after tokenizing): the first must not run on
    before = wait_drained(server)
    refused_before = _rejections(server)
    m = http.get("/v1/models").json()["data"][0]["max_model_len"]
    body = {"model": MODEL, "prompt": [PROMPTS[3], "tok " * (m + 8)], "max_tokens": 64, "ignore_eos": True}
    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": "multi-refused"})
    assert_error(r, 400, "prompt")
    assert "maximum context length" in r.json()["error"]["message"]
    after = wait_drained(server)
    assert after["vlite:generation_tokens_total"] == before["vlite:generation_tokens_total"]
    history = _debug_blocks(server)["view"]["request_history"]
    assert history["multi-refused-0"]["num_output_tokens"] == 0 and history["multi-refused-0"]["finished"]
    refused = _rejections(server)
    assert {k: v - refused_before.get(k, 0) for k, v in refused.items()} == {"at admission": 1, "sibling rejected": 1}


def test_chat_stream_disconnect_frees_blocks(server, http):
    before = wait_drained(server)
    # No max_tokens: the chat default (context length, capped so that both samples fit the
    # 128-block cache at once, which the engine requires) must be admitted, and runs long.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "ignore_eos": True,
            "stream": True, "n": 2}
    left = _disconnects(server)
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "chat-n2"}) as resp:
        events = sse_events(resp.iter_lines())
        wait_until(lambda: next(events)["choices"][0]["delta"].get("content"))
        seqs = http.get("/debug/blocks").json()["sequences"]
        assert [s["request_id"] for s in seqs] == ["chat-n2", "chat-n2"]  # one request, two sequences
    after = wait_drained(server)
    assert after["vlite:request_success_total{abort}"] == before["vlite:request_success_total{abort}"] + 1
    _counted_once(left, _disconnects(server), "/v1/chat/completions mid-stream")


def test_duplicate_live_request_id_is_400(server, http):
    body = {"model": MODEL, "prompt": PROMPTS[8], "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "dup-1"}) as resp:
        events = sse_events(resp.iter_lines())
        next(events)
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "dup-1"})
        assert assert_error(r, 400, "X-Request-Id")["code"] == "duplicate_request_id"
        assert next(events)["choices"][0]["finish_reason"] is None  # the first one goes on
    wait_drained(server)


# ---- parallel sampling (n > 1) and beam search: one engine request, shared blocks -------------------
def _debug_blocks(server) -> dict:
    return httpx.get(server.base_url + "/debug/blocks", headers=server.headers, timeout=10).json()


def test_n4_forks_one_request_sharing_the_prompt_blocks(server, http):
    # 20 prompt tokens = one full block (16) + a partial one: the samples share both after the
    # fork, and each one's first write into the partial block copies it (copy-on-write).
    prompt = [1000 + 37 * i for i in range(20)]  # used by no other test: nothing of it is cached
    rid, max_tokens = "n4-fork", 200
    body = {"model": MODEL, "prompt": prompt, "n": 4, "max_tokens": max_tokens, "temperature": 1.0, "seed": 7,
            "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(http.post, "/v1/completions", json=body, headers={"X-Request-Id": rid})

        def forked():
            snap = _debug_blocks(server)
            seqs = [s for s in snap["sequences"] if s["request_id"] == rid]
            sites = {e["site"] for e in snap["ledger"] if e["request_id"] == rid}
            if len(seqs) == 4 and {"fork", "copy-on-write"} <= sites:
                return seqs
            assert not fut.done(), f"request finished before its fork was seen: {fut.result().text[:300]}"
            return None

        seqs = wait_until(forked, timeout=30)
        tables = [s["block_table"] for s in seqs]
        assert len({t[0] for t in tables}) == 1  # the full prompt block: one physical block, ref_count 4
        assert len({t[1] for t in tables}) == 4  # the partial one: copied on each sample's first write
        r = fut.result()
    assert r.status_code == 200, r.text
    out = r.json()
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": 20, "completion_tokens": 4 * max_tokens,
                            "total_tokens": 20 + 4 * max_tokens}
    m = wait_drained(server)  # free + cached == total and kv_cache_usage_perc == 0
    assert m["vlite:num_free_blocks"] + m["vlite:num_cached_blocks"] == NUM_BLOCKS
    snap = _debug_blocks(server)
    assert snap["kv_cache_usage"] == 0 and snap["anomalies"] == []
    assert not [e for e in snap["ledger"] if e["request_id"] == rid]


def test_greedy_n2_equals_n1_with_per_choice_stop_holdback(client, offline):
    ref = greedy(offline, [PROMPTS[9]], 20)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=20, n=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [ref, ref]
    assert out.usage.completion_tokens == 40

    stop = ref[len(ref) // 2: len(ref) // 2 + 3]
    want = ref[: ref.index(stop)]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=20, n=2, temperature=0,
                                       stop=[stop], stream=True, extra_body={"ignore_eos": True})
    texts, finish = {0: "", 1: ""}, {}
    for chunk in stream:
        for c in chunk.choices:
            assert c.index not in finish  # nothing after a choice's finish_reason
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: want, 1: want} and finish == {0: "stop", 1: "stop"}

    # Several prompts: choice index = prompt_index * n + j.
    ref2 = greedy(offline, [PROMPTS[1], PROMPTS[2]], 6)
    out = client.completions.create(model=MODEL, prompt=[PROMPTS[1], PROMPTS[2]], max_tokens=6, n=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [ref2[0], ref2[0], ref2[1], ref2[1]]


def test_beam_search_equals_offline(client, offline):
    params = SamplingParams(max_tokens=8, temperature=0, beam_width=3, n=2, length_penalty=1.0)
    ref = offline.generate([PROMPTS[10]], params)[0]
    want = [(c.text, c.finish_reason) for c in ref.outputs]
    assert len(want) == 2
    out = client.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=8, n=2, best_of=3,
                                    temperature=0, extra_body={"use_beam_search": True})
    assert [(c.text, c.finish_reason) for c in sorted(out.choices, key=lambda c: c.index)] == want
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)

    # Streaming: each beam arrives whole, in one chunk, when the search ends.
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=8, n=2, best_of=3,
                                       temperature=0, stream=True, extra_body={"use_beam_search": True})
    chunks = [c for chunk in stream for c in chunk.choices]
    assert sorted((c.index, c.text, c.finish_reason) for c in chunks) == [(i, t, f) for i, (t, f) in enumerate(want)]

    messages = [{"role": "user", "content": "Name a cache."}]
    text = offline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = offline.tokenizer(text, add_special_tokens=False).input_ids
    ref = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0, beam_width=2, n=1))[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"use_beam_search": True, "best_of": 2})
    assert [c.message.content for c in chat.choices] == [ref.outputs[0].text]


def test_n3_stream_disconnect_frees_every_block(server, http):
    before = wait_drained(server)
    body = dict(_long_body(True), n=3, max_tokens=N_LONG, temperature=1.0, seed=11)
    with http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "n3-gone"}) as resp:
        events = sse_events(resp.iter_lines())
        seen: set[int] = set()
        wait_until(lambda: seen.update(c["index"] for c in next(events)["choices"]) or seen == {0, 1, 2})
        seqs = [s for s in _debug_blocks(server)["sequences"] if s["request_id"] == "n3-gone"]
        assert len(seqs) == 3 and all(s["block_table"] for s in seqs)
    after = wait_drained(server)
    assert after["vlite:request_success_total{abort}"] == before["vlite:request_success_total{abort}"] + 1
    snap = _debug_blocks(server)
    assert snap["sequences"] == [] and snap["ledger"] == [] and snap["anomalies"] == []


def test_prefix_cache_metrics_count_a_repeated_prompt(server, client):
    prompt = "A prompt long enough to fill several KV blocks of sixteen tokens each, repeated twice " * 3
    before = read_metrics(server)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = wait_drained(server)
    queried = after["vlite:prefix_cache_queries_total"] - before["vlite:prefix_cache_queries_total"]
    hits = after["vlite:prefix_cache_hits_total"] - before["vlite:prefix_cache_hits_total"]
    assert queried > 0 and 16 <= hits < queried  # the second request hit the first's full blocks
    assert after["vlite:num_cached_blocks"] > 0 and after["vlite:kv_cache_usage_perc"] == 0
    assert "_created" not in httpx.get(server.base_url + "/metrics", headers=server.headers).text
