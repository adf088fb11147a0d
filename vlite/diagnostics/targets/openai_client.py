"""An OpenAI-compatible HTTP client that carries out a request's client action: the vlite-serve,
black-box and zombie targets send their requests through it.

Each request gets its own httpx connection, so closing the client closes the TCP connection:
that is the disconnect the server has to notice. The request id goes in ``X-Request-Id``, the
planned client action in ``X-Vlite-Client-Action`` and the tag in ``X-Vlite-Client-Tag``, so a
vlite server's ledger names the same origin the client planned.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from vlite.diagnostics.targets.base import TargetError
from vlite.diagnostics.workload.replay import RequestResult
from vlite.diagnostics.workload.sources import RequestSpec, engine_request_ids, expand_prompts

# A server whose max_model_len is unknown: a prompt over this many tokens stands for one too long.
FALLBACK_MAX_MODEL_LEN = 32768


def request_body(spec: RequestSpec, stream: bool, max_model_len: int | None = None) -> tuple[str, dict]:
    """The route and OpenAI body of one request: /v1/responses for a Responses API request,
    /v1/chat/completions for a chat request, else /v1/completions, with vLLM's extras (ignore_eos, min_tokens, stop_token_ids, and beam
    search as use_beam_search + best_of, the width). A multi-prompt request sends its prompts
    as a list (``sources.expand_prompts``, against ``max_model_len`` tokens when known)."""
    if spec.api == "responses":  # the Responses API: no n, stop or vLLM sampling extras
        return "/v1/responses", {"input": spec.prompt, "max_output_tokens": spec.max_tokens,
                                 "temperature": spec.temperature, "top_p": spec.top_p, "stream": stream,
                                 "store": spec.store}
    body = {"max_tokens": spec.max_tokens, "temperature": spec.temperature, "top_p": spec.top_p,
            "ignore_eos": spec.ignore_eos, "stream": stream, "n": spec.n}
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.stop:
        body["stop"] = list(spec.stop)
    if spec.stop_token_ids:
        body["stop_token_ids"] = list(spec.stop_token_ids)
    if spec.min_tokens:
        body["min_tokens"] = spec.min_tokens
    if spec.beam_width > 1:
        body.update(use_beam_search=True, best_of=spec.beam_width, temperature=0.0)
    extra = dict(spec.extra_params)
    if extra.get("logit_bias"):
        extra["logit_bias"] = {str(k): v for k, v in extra["logit_bias"].items()}  # JSON keys are strings
    body.update(extra)
    if spec.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        if spec.logprobs is not None:
            body.update(logprobs=True, top_logprobs=spec.logprobs)
        return "/v1/chat/completions", body
    body["prompt"] = (expand_prompts(spec, max_model_len or FALLBACK_MAX_MODEL_LEN) if spec.extra_prompts
                      else spec.prompt)
    if spec.logprobs is not None:
        body["logprobs"] = spec.logprobs
    return "/v1/completions", body


def _choice_text(choice: dict) -> str | None:
    """The text of a completions or chat (stream delta or message) choice."""
    if "text" in choice:
        return choice.get("text")
    part = choice.get("delta") or choice.get("message") or {}
    return part.get("content")


async def send_request(base: str, spec: RequestSpec, res: RequestResult, extra_headers: dict | None = None,
                       extra_body: dict | None = None, max_model_len: int | None = None) -> None:
    """Send one completion request and carry out its client action.

    ``extra_headers`` (e.g. ``Authorization``) and ``extra_body`` (e.g. ``model``) are added as
    given; ``max_model_len`` (tokens, the server's) sizes a multi-prompt request's over-long prompt.
    """
    a = spec.action
    route, body = request_body(spec, a.streams, max_model_len)
    if spec.extra_prompts:
        res.engine_request_ids = engine_request_ids(spec)
    body.update(extra_body or {})
    headers = {"X-Request-Id": spec.request_id, "X-Vlite-Client-Action": a.label, **(extra_headers or {})}
    if spec.client_tag:
        headers["X-Vlite-Client-Tag"] = spec.client_tag
    res.arrival_time = time.time()
    timeout = httpx.Timeout(a.timeout_s if a.kind == "client-timeout" else 300.0, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        req = client.build_request("POST", f"{base}{route}", json=body, headers=headers)
        try:
            if a.kind == "abort-waiting":
                # Leave once the request is written: usually before the engine schedules it.
                try:
                    await write_then_close(base, route, body, headers)
                except OSError as exc:
                    res.outcome, res.detail = "error", f"{type(exc).__name__}: {exc}"
                    return
                _aborted(res, "closed the connection once the request was written, before any byte of the response")
                return
            if not a.streams:
                resp = await client.send(req)
                _finished_json(res, resp)
                return
            resp = await client.send(req, stream=True)
            try:
                if resp.status_code != 200:
                    await resp.aread()
                    res.outcome, res.detail = ("rejected" if resp.status_code == 400 else "error",
                                               f"HTTP {resp.status_code}: {resp.text[:200]}")
                    return
                if a.kind == "abort-prefill":
                    _aborted(res, "closed the stream after the headers, before the first token")
                    return
                await _read_stream(resp, res, a.after_tokens if a.kind in ("abort-after-tokens",
                                                                           "disconnect-stream") else None)
            finally:
                await resp.aclose()
        except httpx.TimeoutException:
            _aborted(res, f"client timed out after {a.timeout_s:.2f} s and closed the connection")
        except httpx.HTTPError as exc:
            res.outcome, res.detail = "error", f"{type(exc).__name__}: {exc}"
        finally:
            res.end_time = res.end_time or time.time()
            if res.outcome == "rejected" and spec.extra_prompts:  # the client has its answer: nothing may run on
                res.abort_time = res.end_time


async def write_then_close(base: str, route: str, body: dict, headers: dict) -> None:
    """POST ``body`` to ``base + route`` whole on a fresh connection and close it at once, before
    any byte of the response: a client that leaves while the server is still admitting the
    request. (httpx cannot say when its body is written: a 10 ms give-up may leave before the
    server has the request at all.)

    Raises:
        OSError: the connection could not be made or the write failed.
    """
    url = httpx.URL(base)
    data = json.dumps(body).encode()
    head = {"Host": url.netloc.decode(), "Content-Type": "application/json", "Content-Length": str(len(data)),
            "Connection": "close", **headers}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    port = url.port or (443 if url.scheme == "https" else 80)
    _, writer = await asyncio.open_connection(url.host, port, ssl=url.scheme == "https")
    try:
        writer.write(f"POST {url.raw_path.decode().rstrip('/')}{route} HTTP/1.1\r\n{lines}\r\n".encode() + data)
        await writer.drain()
    finally:
        writer.close()


def _aborted(res: RequestResult, detail: str) -> None:
    res.outcome, res.finish_reason, res.detail = "aborted", "abort", detail
    res.abort_time = res.end_time = time.time()


def _finished_json(res: RequestResult, resp: httpx.Response) -> None:
    if resp.status_code != 200:
        res.outcome = "rejected" if resp.status_code == 400 else "error"
        res.detail = f"HTTP {resp.status_code}: {resp.text[:200]}"
        return
    data = resp.json()
    if "choices" not in data and "output" in data:  # a Responses API response
        res.outcome, res.finish_reason = _responses_end(data)
        res.num_output_tokens = (data.get("usage") or {}).get("output_tokens", 0)
        return
    choice = data["choices"][0]
    res.outcome, res.finish_reason = ("error" if choice.get("finish_reason") == "error" else "finished",
                                      choice.get("finish_reason"))
    res.num_output_tokens = data.get("usage", {}).get("completion_tokens", 0)


def _responses_end(response: dict) -> tuple[str, str]:
    """(outcome, finish_reason) of a Responses API response object: completed is "stop",
    incomplete for max_output_tokens "length", failed or cancelled an error."""
    status = response.get("status")
    if status == "completed":
        return "finished", "stop"
    if status == "incomplete":
        reason = (response.get("incomplete_details") or {}).get("reason")
        return "finished", "length" if reason == "max_output_tokens" else str(reason or "incomplete")
    return "error", "error"


async def _read_stream(resp: httpx.Response, res: RequestResult, stop_after: int | None) -> None:
    chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data.strip() == "[DONE]":
            res.outcome = res.outcome if res.outcome == "error" else "finished"
            return
        event = json.loads(data)
        kind = event.get("type", "") if isinstance(event, dict) else ""
        if kind.startswith("response."):  # a Responses API event stream (no [DONE]: it ends with the response)
            if kind == "response.output_text.delta" and event.get("delta"):
                chunks += 1
                res.num_output_tokens = chunks
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                res.outcome, res.finish_reason = _responses_end(event.get("response") or {})
                return
            if stop_after is not None and chunks >= stop_after:
                _aborted(res, f"disconnected after {chunks} chunks")
                return
            continue
        choice = (event.get("choices") or [{}])[0]
        if _choice_text(choice):
            chunks += 1
            res.num_output_tokens = chunks
        if choice.get("finish_reason"):
            res.finish_reason = choice["finish_reason"]
            if res.finish_reason == "error":
                res.outcome = "error"
        if stop_after is not None and chunks >= stop_after and not res.finish_reason:
            _aborted(res, f"disconnected after {chunks} chunks")
            return
    res.outcome = "finished" if res.finish_reason else "error"
    res.detail = res.detail or ("" if res.finish_reason else "stream ended without [DONE]")


def wait_ready(base: str, client: httpx.Client, timeout_s: float = 120.0) -> None:
    """Wait (bounded) for ``/health`` to answer 200: the server may still be loading its model
    (503, or a timeout). Anything that waiting cannot fix fails at once: a URL that is not
    http(s), a 4xx other than 429 (no health route here: not an LLM server's root URL), or a
    connection refused for more than 5 s (nothing listens there).

    Raises:
        TargetError: the server is not ready within ``timeout_s`` seconds, or cannot become ready.
    """
    start = time.time()
    deadline, last = start + timeout_s, "no answer"
    while time.time() < deadline:
        try:
            r = client.get(f"{base}/health")
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
            if 400 <= r.status_code < 500 and r.status_code != 429:
                raise TargetError(f"{base} is not an LLM server's root URL: GET /health answered HTTP {r.status_code}")
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            raise TargetError(f"{base} is not a server URL ({exc}); give http://host:port") from exc
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, httpx.ConnectError) and time.time() > start + 5:
                break  # nothing listens there
        time.sleep(0.2)
    raise TargetError(f"{base} is not ready: {last}")
