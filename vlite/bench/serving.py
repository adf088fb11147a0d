"""The ``bench serve`` client: streaming requests to an OpenAI-compatible ``/v1/completions``.

As in ``vllm bench serve``: requests are sent in dataset order, spaced by a gamma process
(``request_rate`` requests/s on average; ``burstiness`` 1 is Poisson, lower is burstier,
higher is more regular; ``inf`` sends them all at once), with at most ``max_concurrency`` in
flight. Each request streams; the client times every content chunk on arrival.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import numpy as np

from vlite.bench.datasets import SampleRequest
from vlite.bench.metrics import RequestFuncOutput


async def request_arrivals(requests: list[SampleRequest], request_rate: float, burstiness: float = 1.0,
                           seed: int = 0) -> AsyncIterator[tuple[int, SampleRequest]]:
    """Yield (index, request), sleeping gamma(shape=burstiness, scale=1/(rate*burstiness)) seconds
    between them, so the mean gap is 1/request_rate.

    Raises:
        ValueError: request_rate <= 0 or burstiness <= 0.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate} and {burstiness}")
    rng = np.random.default_rng(seed)
    for i, req in enumerate(requests):
        yield i, req
        if request_rate == float("inf") or i == len(requests) - 1:
            continue
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness))))


async def completions_request(client, url: str, model: str, req: SampleRequest, use_token_ids: bool = True,
                              api_key: str | None = None) -> RequestFuncOutput:
    """One streamed completion; never raises (a failure is ``success=False`` with ``error`` set).

    The prompt is sent as token ids (so the server sees exactly ``prompt_len`` tokens) unless
    ``use_token_ids`` is False. ``output_tokens`` comes from the final usage chunk, else from
    the number of content chunks.
    """
    payload = {"model": model, "prompt": req.prompt_token_ids if use_token_ids else req.prompt,
               "max_tokens": req.expected_output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = RequestFuncOutput(prompt_len=req.prompt_len)
    start = time.perf_counter()
    out.start_time = start
    last = start
    chunks = 0
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {body[:500]}"
                return out
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])[:500]
                    return out
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                    text.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    out.output_tokens = int(chunk["usage"]["completion_tokens"])
        out.latency = last - start if chunks else time.perf_counter() - start
        out.generated_text = "".join(text)
        out.output_tokens = out.output_tokens or chunks
        out.success = chunks > 0
        if not out.success:
            out.error = "the stream ended without any content"
    except Exception as exc:  # noqa: BLE001 - a benchmark records every failure and keeps going
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def run_requests(base_url: str, model: str, requests: list[SampleRequest], request_rate: float = float("inf"),
                       burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                       timeout_s: float = 600.0, api_key: str | None = None,
                       on_done=None, stop=None, drain_s: float = 5.0) -> tuple[list[RequestFuncOutput], float]:
    """Send every request as scheduled; returns (outputs in request order, duration seconds).

    ``on_done`` (optional) is called after each request finishes (progress bars). ``stop`` (a
    ``threading.Event``, set by a first Ctrl-C): no more requests are sent, those in flight get
    ``drain_s`` seconds to finish and are then cancelled; only the answered ones are returned.
    """
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    outputs: list[RequestFuncOutput | None] = [None] * len(requests)
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def one(i: int, req: SampleRequest) -> None:
            if sem is None:
                outputs[i] = await completions_request(client, url, model, req, api_key=api_key)
            else:
                async with sem:
                    outputs[i] = await completions_request(client, url, model, req, api_key=api_key)
            if on_done:
                on_done()

        async def send_all() -> None:
            tasks = []
            async for i, req in request_arrivals(requests, request_rate, burstiness, seed):
                if stop is not None and stop.is_set():
                    break
                tasks.append(asyncio.create_task(one(i, req)))
            await asyncio.gather(*tasks)

        start = time.perf_counter()
        main = asyncio.create_task(send_all())
        while stop is not None and not main.done() and not stop.is_set():
            await asyncio.wait({main}, timeout=0.1)
        if stop is not None and stop.is_set() and not main.done():
            await asyncio.wait({main}, timeout=drain_s)  # those in flight may finish
            main.cancel()  # cancels the gather, and so every request still open
        try:
            await main
        except asyncio.CancelledError:
            pass
        duration = time.perf_counter() - start
    return [o for o in outputs if o is not None], duration
