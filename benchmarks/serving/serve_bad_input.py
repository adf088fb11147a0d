"""Send examples of bad input to a running `vlite serve`; one line per example.

    vlite serve --port 8000 &
    python benchmarks/serving/serve_bad_input.py http://127.0.0.1:8000

Prints the status and the start of the body (or, for streams, whether each event is JSON). The
output before and after the input checks is in benchmarks/results/serve_bad_input_{before,after}.txt.
Each example is also a test in tests/server/test_serve_hardening.py. Takes about 15 s (it waits 12 s
to see whether half-sent request heads are closed). Not part of CI.
"""
import json
import socket
import sys
import time

import httpx

base = sys.argv[1]
c = httpx.Client(base_url=base, timeout=120, limits=httpx.Limits(max_keepalive_connections=0))


def raw(path, data):
    return c.post(path, content=data if isinstance(data, bytes) else json.dumps(data).encode(),
                  headers={"content-type": "application/json"})


def strict(text):
    def refuse(x):
        raise ValueError(x)
    try:
        json.loads(text, parse_constant=refuse)
        return "valid JSON"
    except ValueError as e:
        return f"NOT JSON ({e})"


def show(name, r, extra=""):
    print(f"{name:55s} {r.status_code} {extra} {r.text[:90]!r}")


chat = lambda content="hi", role="user", **kw: {"messages": [{"role": role, "content": content}], "max_tokens": 1, **kw}  # noqa
show("1 prompt lone surrogate", raw("/v1/completions", {"prompt": "\ud800", "max_tokens": 1}))
show("1 raw bytes ED A0 80", raw("/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}'))
show("1 chat content surrogate", raw("/v1/chat/completions", chat("\ud800")))
show("1 chat role surrogate", raw("/v1/chat/completions", chat(role="\ud800")))
show("1 /tokenize surrogate", raw("/tokenize", {"prompt": "\ud800"}))
r = raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_k": 1, "logprobs": 2})
show("2 top_k 1 logprobs 2", r)
if r.status_code == 200:
    print("     token_logprobs", r.json()["choices"][0]["logprobs"]["token_logprobs"], "top", r.json()["choices"][0]["logprobs"]["top_logprobs"])
show("2 top_p 0.01 logprobs 2", raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "top_p": 0.01, "logprobs": 2}))
show("2 chat top_k 1 logprobs", raw("/v1/chat/completions", chat(top_k=1, logprobs=True, top_logprobs=2)))
with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "top_k": 1, "logprobs": 2, "stream": True}) as s:
    events = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
print(f"{'2 streamed top_k 1 logprobs 2':55s} {s.status_code} events: {[strict(e) for e in events]}")
show("3 seed 2**64", raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": 2**64}))
show("3 seed 2**63", raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": 2**63}))
show("3 stop_token_ids [1e9]", raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop_token_ids": [10**9]}))
show("3 prompt [[false]]", raw("/v1/completions", {"prompt": [[False]], "max_tokens": 1}))
show("4 temperature Infinity", raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": float("inf")}))
show("4 temperature 1e308", raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": 1e308}))
show("4 temperature 1e-300", raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": 1e-300}))
show("4 repetition_penalty Infinity", raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "repetition_penalty": float("inf")}))
for role in ("unknownrole", "", "tool", "function"):
    show(f"5 role {role!r}", raw("/v1/chat/completions", chat(role=role)))
show("5 text part without text", raw("/v1/chat/completions", chat([{"type": "text"}])))
r = raw("/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 1000})
show("6 n=1000", r, f"choices={len(r.json().get('choices', []))}" if r.status_code == 200 else "")


def chunked():
    yield b'{"prompt": "'
    for _ in range(9):
        yield b" " * (1 << 20)
    yield b'", "max_tokens": 1}'


show("8 chunked 9 MiB body", c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"}))
socks = []
for _ in range(20):
    s = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Half: ")
    s.settimeout(0.1)
    socks.append(s)
time.sleep(12)
still_open = 0
for s in socks:
    try:
        still_open += s.recv(10) != b""
    except TimeoutError:
        still_open += 1
    except ConnectionResetError:
        pass
    s.close()
print(f"{'8 half-header connections still open after 12 s':55s} {still_open}/20")
doc = c.get("/openapi.json").json()
print(f"{'9 /v1/completions documented statuses':55s} {sorted(doc['paths']['/v1/completions']['post']['responses'])}")
