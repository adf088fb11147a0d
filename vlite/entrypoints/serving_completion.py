"""POST /v1/completions (OpenAI's legacy Completions API, as vLLM serves it).

Each prompt is one engine request (the X-Request-Id itself, or ``<X-Request-Id>-<prompt_index>``
when the request carries several prompts) with ``SamplingParams(n=n)``: its ``n`` samples (or
beams, with ``use_beam_search``) share the prompt's KV blocks. Choice ``j`` of prompt ``p`` is
the response's choice ``p * n + j``, as in OpenAI's and vLLM's servers. Streaming sends OpenAI's
``text_completion`` chunks (one choice per chunk) as Server-Sent Events, ending with
``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vlite.engine.async_engine import EngineRequest, RequestGroup
from vlite.engine.outputs import CompletionOutput
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
    GroupStreamer,
    RequestInfo,
    add_to_engine,
    check_limits,
    check_prompt_chars,
    clamp_logprob,
    collect_final,
    off_loop,
    sampling_params,
    served_model,
    sse,
    warn_ignored_fields,
)
from vlite.entrypoints.state import ServerState


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    """Normalize ``prompt`` to a list of prompts (each a text or token ids), refusing empty ones."""
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    for item in items:
        if isinstance(item, str) and not item:
            raise APIError(400, "prompt must not be an empty string", param="prompt")
        if not isinstance(item, str) and not item:
            raise APIError(400, "prompt token ids must not be empty", param="prompt")
    return items


def _tokenize(tokenizer, items: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt; runs in the tokenizer threads (serving.off_loop)."""
    return [(item, tokenizer(item).input_ids) if isinstance(item, str) else (None, list(item)) for item in items]


def completion_logprobs(tokenizer, c: CompletionOutput, start: int, end: int, num_top: int,
                        text_offset: int) -> CompletionLogprobs:
    """Legacy logprobs of one choice for output tokens [start, end): token text, its logprob
    and the top ``num_top``; ``text_offset`` is the character offset of token ``start``."""
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        token = tokenizer.decode([token_id])
        result.tokens.append(token)
        result.token_logprobs.append(clamp_logprob(entry[token_id]))
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:max(num_top, 1)]
        result.top_logprobs.append({tokenizer.decode([t]): clamp_logprob(lp) for t, lp in top})
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
    if req.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.max_tokens is None:
        req.max_tokens = 16  # OpenAI: "integer or null, defaults to 16"
    items = _prompts(req)
    check_limits(state, req, req.max_tokens, len(items))
    params = sampling_params(req, req.max_tokens, req.logprobs)
    for item in items:  # refuse an over-long text before paying for its tokenization
        if isinstance(item, str):
            check_prompt_chars(state, len(item), "prompt")
    tokenizer = state.engine.engine.tokenizer
    prompts = await off_loop(state, _tokenize, tokenizer, items)
    info = RequestInfo.from_request(request)
    engine_requests = [EngineRequest(text, params, info.origin(info.engine_request_id(p, len(prompts))), ids)
                       for p, (text, ids) in enumerate(prompts)]
    group = await add_to_engine(state, engine_requests)
    response_id = f"cmpl-{info.request_id}"
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        stream = _stream(group, req.n, tokenizer, response_id, model, req.logprobs, include_usage, prompt_tokens)
        return AbortOnCloseStreamingResponse(stream, group)
    finals = await collect_final(group)
    choices = []
    for p, out in enumerate(finals):
        for c in sorted(out.outputs, key=lambda c: c.index):
            logprobs = (completion_logprobs(tokenizer, c, 0, len(c.token_ids), req.logprobs, 0)
                        if req.logprobs is not None else None)
            choices.append(CompletionChoice(index=p * req.n + c.index, text=c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
    body = CompletionResponse(id=response_id, model=model, choices=choices,
                              usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                              total_tokens=prompt_tokens + completion_tokens))
    return JSONResponse(body.model_dump(mode="json"))


async def _stream(group: RequestGroup, n: int, tokenizer, response_id: str, model: str, num_logprobs: int | None,
                  include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    """SSE chunks, one choice per chunk (index = prompt_index * n + j); a choice's last chunk
    carries its finish_reason. Beam search choices arrive whole in one chunk at the end."""
    deltas = GroupStreamer(group, n)
    try:
        async for d in deltas:
            if d.error is not None:
                yield APIError(500, f"the engine failed on this request: {d.error}").sse()
                continue
            c = d.choice
            logprobs = (completion_logprobs(tokenizer, c, d.first_token, d.end_token, num_logprobs, d.text_offset)
                        if num_logprobs is not None else None)
            done = c.finish_reason is not None
            chunk = CompletionResponse(id=response_id, model=model, choices=[CompletionChoice(
                index=d.prompt_index * n + c.index, text=d.text, logprobs=logprobs, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason if done else None)])
            yield sse(chunk.model_dump(mode="json", exclude={"usage"}))
    except RuntimeError as exc:  # the engine loop failed this request
        yield APIError(500, str(exc)).sse()
    if include_usage:
        tokens = deltas.completion_tokens
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=tokens, total_tokens=prompt_tokens + tokens)
        yield sse(CompletionResponse(id=response_id, model=model, choices=[], usage=usage).model_dump(mode="json"))
    yield SSE_DONE
