"""POST /v1/completions (OpenAI's legacy Completions API, as vLLM serves it).

Each prompt gets ``n`` choices; each choice is one engine request (``<X-Request-Id>-<index>``
when there are several, with index = prompt_index * n + j). Streaming sends OpenAI's
``text_completion`` chunks as Server-Sent Events, ending with ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vlite.engine.async_engine import EngineRequest, RequestGroup
from vlite.engine.outputs import RequestOutput
from vlite.entrypoints.errors import APIError
from vlite.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from vlite.entrypoints.serving import (
    SSE_DONE,
    AbortOnCloseStreamingResponse,
    RequestInfo,
    TextStreamer,
    add_to_engine,
    check_n,
    collect_final,
    sampling_params,
    served_model,
    sse,
    warn_ignored_fields,
)
from vlite.entrypoints.state import ServerState


def _prompts(req: CompletionRequest, tokenizer) -> list[tuple[str | None, list[int]]]:
    """Normalize ``prompt`` to a list of (text or None, token ids)."""
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "prompt must not be an empty string", param="prompt")
            out.append((item, tokenizer(item).input_ids))
        else:
            if not item:
                raise APIError(400, "prompt token ids must not be empty", param="prompt")
            out.append((None, list(item)))
    return out


def completion_logprobs(tokenizer, out: RequestOutput, start: int, end: int, num_top: int,
                        text_offset: int) -> CompletionLogprobs:
    """Legacy logprobs for output tokens [start, end): token text, its logprob, the top ``num_top``."""
    c = out.outputs[0]
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        token = tokenizer.decode([token_id])
        result.tokens.append(token)
        result.token_logprobs.append(entry.get(token_id))
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:max(num_top, 1)]
        result.top_logprobs.append({tokenizer.decode([t]): lp for t, lp in top})
        result.text_offset.append(offset)
        offset += len(token)
    return result


async def create_completion(req: CompletionRequest, request: Request, state: ServerState) -> Response:
    """Validate, queue and answer one completions request (JSON or an SSE stream).

    Raises:
        APIError: 400 for invalid parameters or a prompt the engine rejects, 404 for an unknown
            model, 503 while shutting down.
    """
    warn_ignored_fields(req)
    model = served_model(state, req.model)
    check_n(req.n)
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if req.max_tokens is None:
        raise APIError(400, "max_tokens must be an integer >= 1, got None", param="max_tokens")
    params = sampling_params(req, req.max_tokens, req.logprobs)
    tokenizer = state.engine.engine.tokenizer
    prompts = _prompts(req, tokenizer)
    info = RequestInfo.from_request(request)
    total = len(prompts) * req.n
    engine_requests = [
        EngineRequest(text, params, info.origin(info.engine_request_id(p * req.n + j, total)), ids)
        for p, (text, ids) in enumerate(prompts) for j in range(req.n)]
    group = await add_to_engine(state, engine_requests)
    response_id = f"cmpl-{info.request_id}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        stream = _stream(group, tokenizer, response_id, model, req.logprobs, include_usage,
                         sum(len(ids) for _, ids in prompts))
        return AbortOnCloseStreamingResponse(stream, group)
    finals = await collect_final(group)
    choices = []
    for i, out in enumerate(finals):
        c = out.outputs[0]
        logprobs = (completion_logprobs(tokenizer, out, 0, len(c.token_ids), req.logprobs, 0)
                    if req.logprobs is not None else None)
        choices.append(CompletionChoice(index=i, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                                        stop_reason=c.stop_reason))
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in finals)
    body = CompletionResponse(id=response_id, model=model, choices=choices,
                              usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                              total_tokens=prompt_tokens + completion_tokens))
    return JSONResponse(body.model_dump(mode="json"))


async def _stream(group: RequestGroup, tokenizer, response_id: str, model: str, num_logprobs: int | None,
                  include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    streamers = [TextStreamer() for _ in group.request_ids]
    completion_tokens = [0] * len(group.request_ids)
    try:
        async for i, out in group:
            c = out.outputs[0]
            offset = streamers[i].sent_chars
            delta, first, end = streamers[i].advance(out)
            completion_tokens[i] = len(c.token_ids)
            if c.finish_reason == "error":
                yield APIError(500, f"the engine failed on this request: {out.error}").sse()
                continue
            if not delta and not out.finished:
                continue
            logprobs = (completion_logprobs(tokenizer, out, first, end, num_logprobs, offset)
                        if num_logprobs is not None else None)
            chunk = CompletionResponse(id=response_id, model=model, choices=[CompletionChoice(
                index=i, text=delta, logprobs=logprobs, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason if out.finished else None)])
            yield sse(chunk.model_dump(mode="json", exclude={"usage"}))
    except RuntimeError as exc:  # the engine loop failed this request
        yield APIError(500, str(exc)).sse()
    if include_usage:
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=sum(completion_tokens),
                          total_tokens=prompt_tokens + sum(completion_tokens))
        yield sse(CompletionResponse(id=response_id, model=model, choices=[], usage=usage).model_dump(mode="json"))
    yield SSE_DONE
