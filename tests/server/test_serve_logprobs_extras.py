"""`vlite serve`: echo and prompt_logprobs (completions and chat, streaming and not, n > 1), and
logit_bias / allowed_token_ids / bad_words, with their 400s. One tiny-Llama server per module;
the offline engine on the same weights is the reference."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import build_tiny_model_dir, make_engine
from serve_harness import ServerProcess, running, wait_drained

from vlite.engine.sampling_params import SamplingParams
from vlite.engine.worker.loader import load_checkpoint

PROMPT = "The paged KV cache holds blocks of sixteen tokens each, shared by prefix"
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("extras-tiny"), max_position_embeddings=512)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, tmp_path_factory.mktemp("extras-log") / "server.log", "--num-blocks", "64",
                        "--max-num-batched-tokens", "16", "--max-n", "4")  # 16: chunked prefill
    yield from running(srv)


@pytest.fixture(scope="module")
def offline(model_dir):
    return make_engine(load_checkpoint(str(model_dir)), num_blocks=64)


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def ref_prompt_logprobs(offline, prompt, k: int):
    out = offline.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k))[0]
    return out.prompt_token_ids, out.prompt_logprobs


def stream(http, path, body):
    events = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def test_echo_with_logprobs_non_streaming_n2(server, http, offline):
    ids, ref = ref_prompt_logprobs(offline, PROMPT, 1)
    tok = offline.tokenizer
    body = {"prompt": PROMPT, "max_tokens": 5, "echo": True, "logprobs": 1, "n": 2, "temperature": 1.0, "seed": 7}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for c in choices:
        assert c["text"].startswith(PROMPT) and len(c["text"]) > len(PROMPT)
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 5 == len(lp["token_logprobs"]) == len(lp["text_offset"])
        assert lp["tokens"][:len(ids)] == [tok.decode([t]) for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert abs(lp["token_logprobs"][i] - ref[i][ids[i]].logprob) < TOL
            top_id = max(ref[i].items(), key=lambda kv: kv[1].logprob)[0]
            assert lp["top_logprobs"][i] == pytest.approx({tok.decode([top_id]): ref[i][top_id].logprob}, abs=TOL)
        assert lp["text_offset"][0] == 0 and lp["text_offset"][len(ids)] == len(PROMPT)
        assert lp["text_offset"] == sorted(lp["text_offset"])
        assert "prompt_logprobs" not in c or c["prompt_logprobs"] is None  # not asked for
    # echo without logprobs: text only
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "echo": True, "temperature": 0})
    c = r.json()["choices"][0]
    assert c["text"].startswith(PROMPT) and c["logprobs"] is None
    # a token-id prompt is echoed as its decoded text
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "echo": True, "temperature": 0})
    assert r.json()["choices"][0]["text"].startswith(tok.decode(ids))


def test_echo_several_prompts_n2(server, http):
    prompts = [PROMPT, "Another prompt, shorter"]
    body = {"prompt": prompts, "max_tokens": 3, "echo": True, "logprobs": 0, "n": 2, "temperature": 0}
    for choices in (http.post("/v1/completions", json=body).json()["choices"],
                    [e["choices"][0] for e in stream(http, "/v1/completions", body)
                     if e["choices"] and e["choices"][0]["text"].startswith(tuple(prompts))]):
        assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
        for c in choices:
            prompt = prompts[c["index"] // 2]
            assert c["text"].startswith(prompt)
            assert c["logprobs"]["token_logprobs"][0] is None and c["logprobs"]["text_offset"][0] == 0


def test_echo_streaming_equals_non_streaming(server, http):
    body = {"prompt": PROMPT, "max_tokens": 6, "echo": True, "logprobs": 2, "n": 2, "temperature": 0,
            "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()["choices"]
    events = stream(http, "/v1/completions", body)
    for c in full:
        chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == c["index"]]
        assert chunks[0]["text"].startswith(PROMPT)
        assert all(not ch["text"].startswith(PROMPT) for ch in chunks[1:])
        assert "".join(ch["text"] for ch in chunks) == c["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for ch in chunks for x in ch["logprobs"][key]] == c["logprobs"][key], key


def test_prompt_logprobs_completions(server, http, offline):
    ids, ref = ref_prompt_logprobs(offline, PROMPT, 2)
    body = {"prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 2, "n": 2, "temperature": 0.5, "seed": 1}
    choices = http.post("/v1/completions", json=body).json()["choices"]
    for c in choices:
        plp = c["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i in range(1, len(ids)):
            assert set(plp[i]) == {str(t) for t in ref[i]}
            for tid, entry in ref[i].items():
                got = plp[i][str(tid)]
                assert abs(got["logprob"] - entry.logprob) < TOL and got["rank"] == entry.rank
                assert got["decoded_token"] == offline.tokenizer.decode([tid])
        assert c["text"] and not c["text"].startswith(PROMPT)  # no echo
    # streaming: only each choice's first chunk carries them
    events = stream(http, "/v1/completions", body)
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert chunks[0]["prompt_logprobs"] == choices[index]["prompt_logprobs"]
        assert all("prompt_logprobs" not in ch for ch in chunks[1:])


def test_prompt_logprobs_chat(server, http):
    body = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 3, "prompt_logprobs": 1,
            "n": 2, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    plp = data["prompt_logprobs"]
    num_prompt = data["usage"]["prompt_tokens"]
    assert len(plp) == num_prompt and plp[0] is None and all(1 <= len(e) <= 2 for e in plp[1:])
    events = stream(http, "/v1/chat/completions", body)
    carrying = [e for e in events if "prompt_logprobs" in e]
    assert len(carrying) == 1 and carrying[0]["prompt_logprobs"] == plp
    assert carrying[0]["choices"][0]["delta"].get("content") is not None
    no_ask = http.post("/v1/chat/completions", json={**body, "prompt_logprobs": None}).json()
    assert no_ask["prompt_logprobs"] is None


def test_logit_bias_allowed_token_ids_bad_words(server, http, offline):
    tok = offline.tokenizer
    target = tok.encode(" cache", add_special_tokens=False)[0]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                           "logit_bias": {str(target): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([target]) * 4
    a, b = tok.encode("a", add_special_tokens=False)[0], tok.encode("b", add_special_tokens=False)[0]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "n": 2,
                                           "seed": 3, "ignore_eos": True, "allowed_token_ids": [a, b]})
    for c in r.json()["choices"]:
        assert set(c["text"]) <= {"a", "b"} and len(c["text"]) == 8
    greedy = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    first = http.post("/v1/completions", json=greedy).json()["choices"][0]["logprobs"]["tokens"][0]
    r = http.post("/v1/completions", json={**greedy, "bad_words": [first]})
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert first not in tokens and first.strip() not in [t.strip() for t in tokens]


def test_disconnect_mid_stream_leaves_nothing(server, http):
    """A client that goes away after the first chunk of an echo + prompt_logprobs + logit_bias +
    bad_words stream (n = 2): every block and request is released."""
    body = {"prompt": PROMPT * 3, "max_tokens": 400, "ignore_eos": True, "n": 2, "echo": True, "logprobs": 2,
            "prompt_logprobs": 3, "logit_bias": {"5": 3}, "bad_words": ["cache"], "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["text"].startswith(PROMPT)
    wait_drained(server)


VOCAB = 49152


@pytest.mark.parametrize("fields,param", [
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"1": -100.5}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"1": "x"}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"use_beam_search": True, "best_of": 2, "logit_bias": {"1": 1}}, "logit_bias"),
    ({"use_beam_search": True, "best_of": 2, "bad_words": ["x"]}, "bad_words"),
])
def test_bad_extras_are_400(server, http, fields, param):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param, r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                                **{k: v for k, v in fields.items() if k != "echo"}})
    assert r.status_code == 400 or "echo" in fields, r.text
    wait_drained(server)
