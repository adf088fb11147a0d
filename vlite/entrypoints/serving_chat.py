"""POST /v1/chat/completions: the model's chat template (transformers) over ``messages``.

Streaming follows OpenAI: per choice a first chunk with ``delta.role``, then content deltas,
then a chunk with ``finish_reason``; ``stream_options.include_usage`` adds a usage chunk with
no choices; the stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vlite.engine.async_engine import EngineRequest, RequestGroup
from vlite.engine.outputs import RequestOutput
from vlite.entrypoints.errors import APIError
from vlite.entrypoints.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
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


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """Apply the tokenizer's chat template; returns (prompt text, token ids).

    The rendered text already holds the special tokens, so it is tokenized without adding
    more (as vLLM does). Raises APIError 400 for non-text content or a template error.
    """
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    plain = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                                   param="messages")
                parts.append(part.text)
            content = "".join(parts)
        plain.append({"role": m.role, "content": content or ""})
    if tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja errors (e.g. a role the template rejects)
        raise APIError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
    return text, tokenizer(text, add_special_tokens=False).input_ids


def chat_logprobs(tokenizer, out: RequestOutput, start: int, end: int, num_top: int) -> ChatChoiceLogprobs:
    """Chat logprobs for output tokens [start, end) (OpenAI's ``logprobs.content`` list)."""
    c = out.outputs[0]
    content = []
    for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        token = tokenizer.decode([token_id])
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        content.append(ChatTokenLogprob(
            token=token, logprob=entry.get(token_id, float("-inf")), bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=(s := tokenizer.decode([t])), logprob=lp, bytes=list(s.encode()))
                          for t, lp in top]))
    return ChatChoiceLogprobs(content=content)


async def create_chat_completion(req: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    """Validate, queue and answer one chat completions request (JSON or an SSE stream).

    Raises:
        APIError: 400 for invalid parameters or a prompt the engine rejects, 404 for an unknown
            model, 503 while shutting down.
    """
    warn_ignored_fields(req)
    model = served_model(state, req.model)
    check_n(req.n)
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    tokenizer = state.engine.engine.tokenizer
    text, ids = render_chat(tokenizer, req.messages, req.add_generation_prompt)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:  # OpenAI: up to the context length
        max_tokens = max(1, state.max_model_len - len(ids))
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, num_top)
    info = RequestInfo.from_request(request)
    engine_requests = [EngineRequest(text, params, info.origin(info.engine_request_id(j, req.n)), ids)
                       for j in range(req.n)]
    group = await add_to_engine(state, engine_requests)
    response_id = f"chatcmpl-{info.request_id}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return AbortOnCloseStreamingResponse(
            _stream(group, tokenizer, response_id, model, num_top, include_usage, len(ids)), group)
    finals = await collect_final(group)
    choices = []
    for i, out in enumerate(finals):
        c = out.outputs[0]
        logprobs = chat_logprobs(tokenizer, out, 0, len(c.token_ids), num_top) if num_top is not None else None
        choices.append(ChatCompletionChoice(index=i, message=ChatResponseMessage(content=c.text), logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in finals)
    body = ChatCompletionResponse(id=response_id, model=model, choices=choices,
                                  usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                                  total_tokens=len(ids) + completion_tokens))
    return JSONResponse(body.model_dump(mode="json"))


async def _stream(group: RequestGroup, tokenizer, response_id: str, model: str, num_top: int | None,
                  include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    def chunk(index: int, delta: DeltaMessage, finish_reason: str | None = None,
              logprobs: ChatChoiceLogprobs | None = None) -> str:
        body = ChatCompletionChunk(id=response_id, model=model, choices=[ChatStreamChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)])
        data = body.model_dump(mode="json", exclude={"usage"})
        for choice in data["choices"]:  # OpenAI omits unset delta fields (role after the first chunk)
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return sse(data)

    streamers = [TextStreamer() for _ in group.request_ids]
    completion_tokens = [0] * len(group.request_ids)
    for i in range(len(group.request_ids)):
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    try:
        async for i, out in group:
            c = out.outputs[0]
            delta, first, end = streamers[i].advance(out)
            completion_tokens[i] = len(c.token_ids)
            if c.finish_reason == "error":
                yield APIError(500, f"the engine failed on this request: {out.error}").sse()
                continue
            if not delta and not out.finished:
                continue
            logprobs = chat_logprobs(tokenizer, out, first, end, num_top) if num_top is not None else None
            yield chunk(i, DeltaMessage(content=delta) if delta else DeltaMessage(), c.finish_reason, logprobs)
    except RuntimeError as exc:  # the engine loop failed this request
        yield APIError(500, str(exc)).sse()
    if include_usage:
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=sum(completion_tokens),
                          total_tokens=prompt_tokens + sum(completion_tokens))
        body = ChatCompletionChunk(id=response_id, model=model, choices=[], usage=usage)
        yield sse(body.model_dump(mode="json"))
    yield SSE_DONE
