"""POST /v1/chat/completions: the model's chat template (transformers) over ``messages``.

The prompt is one engine request (id: the X-Request-Id) with ``SamplingParams(n=n)``: its
``n`` choices (samples, or beams with ``use_beam_search``) share the prompt's KV blocks.
Streaming follows OpenAI: per choice a first chunk with ``delta.role``, then content deltas,
then a chunk with ``finish_reason``; ``stream_options.include_usage`` adds a usage chunk with
no choices; the stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from vlite.engine.async_engine import EngineRequest, RequestGroup
from vlite.engine.outputs import CompletionOutput
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


def chat_plain_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """``messages`` as the chat template takes them: {"role", "content"} with text content.

    Raises:
        APIError: 400 naming the message and part, for empty messages, a part that is not text
            or a text part without ``text``.
    """
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    plain = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                where = f"messages.{i}.content.{j}"
                if part.type != "text":
                    raise APIError(400, f"{where}: content parts of type {part.type!r} are not supported (only "
                                   "'text' parts)", param="messages")
                if part.text is None:
                    raise APIError(400, f"{where}: a part of type 'text' needs a 'text' field holding a string",
                                   param="messages")
                parts.append(part.text)
            content = "".join(parts)
        plain.append({"role": m.role, "content": content or ""})
    return plain


def render_chat(tokenizer, messages: list[ChatMessage] | list[dict[str, str]],
                add_generation_prompt: bool = True) -> tuple[str, list[int]]:
    """Apply the tokenizer's chat template; returns (prompt text, token ids).

    ``messages`` are ChatMessage models or chat_plain_messages' dicts. The rendered text already
    holds the special tokens, so it is tokenized without adding more (as vLLM does). Slow for a
    long conversation: servers call it through ``serving.off_loop``.

    Raises:
        APIError: 400 for non-text content or a template error.
    """
    plain = messages if messages and isinstance(messages[0], dict) else chat_plain_messages(messages)
    if tokenizer.chat_template is None:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - jinja errors (e.g. a role the template rejects)
        raise APIError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
    return text, tokenizer(text, add_special_tokens=False).input_ids


def check_chat_chars(state: ServerState, plain: list[dict[str, str]]) -> None:
    """400 before rendering when the messages' text alone cannot fit the context (serving.check_prompt_chars)."""
    check_prompt_chars(state, sum(len(m["content"]) for m in plain), "messages")


def chat_logprobs(tokenizer, c: CompletionOutput, start: int, end: int, num_top: int) -> ChatChoiceLogprobs:
    """Chat logprobs of one choice for output tokens [start, end) (OpenAI's ``logprobs.content``)."""
    content = []
    for token_id, entry in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
        token = tokenizer.decode([token_id])
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        content.append(ChatTokenLogprob(
            token=token, logprob=clamp_logprob(entry[token_id]), bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=(s := tokenizer.decode([t])), logprob=clamp_logprob(lp),
                                     bytes=list(s.encode())) for t, lp in top]))
    return ChatChoiceLogprobs(content=content)


def _default_max_tokens(state: ServerState, req: ChatCompletionRequest, num_prompt_tokens: int) -> int:
    """Output tokens (count) when the client gives no limit: OpenAI's "up to the context length",
    capped so that all n samples (or W beams) of the request fit the KV cache at once, which
    the engine requires of a request it admits (LLMEngine._check_fits). At least 1; a prompt
    that leaves no room is then refused by the engine with its own message."""
    width = max(req.n, (req.best_of or req.n) if req.use_beam_search else 1, 1)
    engine = state.engine.engine  # block_size and the block count are fixed once loaded
    cache_tokens = (engine.block_manager.num_total_blocks // width) * engine.block_size
    return max(1, min(state.max_model_len, cache_tokens) - num_prompt_tokens)


async def create_chat_completion(req: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    """Validate, queue and answer one chat completions request (JSON or an SSE stream).

    Raises:
        APIError: 400 for invalid parameters or a prompt the engine rejects, 404 for an unknown
            model, 503 while shutting down.
    """
    warn_ignored_fields(req)
    model = served_model(state, req.model)
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    tokenizer = state.engine.engine.tokenizer
    plain = chat_plain_messages(req.messages)
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    check_limits(state, req, max_tokens or 1, max_tokens_param=max_tokens_param)
    check_chat_chars(state, plain)
    text, ids = await off_loop(state, render_chat, tokenizer, plain, req.add_generation_prompt)
    if max_tokens is None:
        max_tokens = _default_max_tokens(state, req, len(ids))
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, num_top)
    info = RequestInfo.from_request(request)
    group = await add_to_engine(state, [EngineRequest(text, params, info.origin(info.request_id), ids)])
    response_id = f"chatcmpl-{info.request_id}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return AbortOnCloseStreamingResponse(
            _stream(group, req.n, tokenizer, response_id, model, num_top, include_usage, len(ids)), group)
    (final,) = await collect_final(group)
    choices = []
    for c in sorted(final.outputs, key=lambda c: c.index):
        logprobs = chat_logprobs(tokenizer, c, 0, len(c.token_ids), num_top) if num_top is not None else None
        choices.append(ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                            logprobs=logprobs, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    body = ChatCompletionResponse(id=response_id, model=model, choices=choices,
                                  usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                                  total_tokens=len(ids) + completion_tokens))
    return JSONResponse(body.model_dump(mode="json"))


async def _stream(group: RequestGroup, n: int, tokenizer, response_id: str, model: str, num_top: int | None,
                  include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    """SSE chunks: the role chunk of every choice, then one choice per chunk; a choice's last
    chunk carries its finish_reason. Beam search choices arrive whole in one chunk at the end."""
    def chunk(index: int, delta: DeltaMessage, finish_reason: str | None = None,
              logprobs: ChatChoiceLogprobs | None = None) -> str:
        body = ChatCompletionChunk(id=response_id, model=model, choices=[ChatStreamChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)])
        data = body.model_dump(mode="json", exclude={"usage"})
        for choice in data["choices"]:  # OpenAI omits unset delta fields (role after the first chunk)
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return sse(data)

    for j in range(n):
        yield chunk(j, DeltaMessage(role="assistant", content=""))
    deltas = GroupStreamer(group, n)
    try:
        async for d in deltas:
            if d.error is not None:
                yield APIError(500, f"the engine failed on this request: {d.error}").sse()
                continue
            c = d.choice
            logprobs = chat_logprobs(tokenizer, c, d.first_token, d.end_token, num_top) if num_top is not None else None
            yield chunk(c.index, DeltaMessage(content=d.text) if d.text else DeltaMessage(), c.finish_reason, logprobs)
    except RuntimeError as exc:  # the engine loop failed this request
        yield APIError(500, str(exc)).sse()
    if include_usage:
        tokens = deltas.completion_tokens
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=tokens, total_tokens=prompt_tokens + tokens)
        body = ChatCompletionChunk(id=response_id, model=model, choices=[], usage=usage)
        yield sse(body.model_dump(mode="json"))
    yield SSE_DONE
