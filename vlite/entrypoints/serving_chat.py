"""POST /v1/chat/completions: the model's chat template (transformers) over ``messages``.

The prompt is one engine request (id: the X-Request-Id) with ``SamplingParams(n=n)``: its
``n`` choices (samples, or beams with ``use_beam_search``) share the prompt's KV blocks.
Streaming follows OpenAI: per choice a first chunk with ``delta.role``, then content deltas,
then a chunk with ``finish_reason``; with vLLM's ``prompt_logprobs`` the non-streaming response
has a top-level ``prompt_logprobs`` and a stream carries it in its first content chunk (vLLM
refuses the two together); ``stream_options.include_usage`` adds a usage chunk with
no choices; the stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

from vlite.engine import CompletionOutput, RequestOutput, SamplingParams
from vlite.entrypoints.errors import APIError
from vlite.entrypoints.logprobs_format import TokenTexts, prompt_logprobs_json
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
    ChoiceDelta,
    OpenAIServing,
    RenderedPrompt,
    check_limits,
    check_prompt_chars,
    clamp_logprob,
    sampling_params,
)
from vlite.entrypoints.state import ServerState


def chat_plain_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """``messages`` as the chat template takes them: {"role", "content"} with text content.

    Raises:
        APIError: 400 naming the message and part, for empty messages, a system or user message
            without content (missing or null), a part that is not text or a text part without
            ``text``. Empty text is allowed, as OpenAI allows it.
    """
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    plain = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None and m.role != "assistant":
            # OpenAI requires content on system and user messages; only an assistant turn may omit it
            raise APIError(400, f"messages.{i}.content: a {m.role!r} message needs content (a string or a list "
                           "of text parts); only an 'assistant' message may omit it", param=f"messages.{i}.content")
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
    engine = state.engine  # the block count and block_size are fixed once loaded
    cache_tokens = (engine.latest_stats.num_total_blocks // width) * engine.block_size
    return max(1, min(state.max_model_len, cache_tokens) - num_prompt_tokens)


class OpenAIServingChat(OpenAIServing):
    """POST /v1/chat/completions on the shared pipeline (serving.OpenAIServing): ``messages``
    rendered by the model's chat template into one engine request; a choice is a
    ``chat.completion.chunk`` delta (after a first chunk with the role per choice) or a
    ``chat.completion`` message, with ``logprobs.content``."""

    response_id_prefix = "chatcmpl"
    chunk_type = ChatCompletionChunk
    response_type = ChatCompletionResponse
    req: ChatCompletionRequest

    def check(self) -> None:
        req = self.req
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.plain = chat_plain_messages(req.messages)
        max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        self.max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        check_limits(self.state, req, self.max_tokens or 1, max_tokens_param=max_tokens_param)
        check_chat_chars(self.state, self.plain)
        self.num_top = (req.top_logprobs or 0) if req.logprobs else None
        self.sent_prompt_logprobs = False  # streaming: prompt_logprobs go in the first content chunk
        self.pending_prompt_logprobs = None

    def render(self) -> list[RenderedPrompt]:
        return [render_chat(self.tokenizer, self.plain, self.req.add_generation_prompt)]

    def params(self, prompts: list[RenderedPrompt]) -> SamplingParams:
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = _default_max_tokens(self.state, self.req, len(prompts[0][1]))
        return sampling_params(self.req, max_tokens, self.num_top, self.req.prompt_logprobs)

    def _logprobs(self, c: CompletionOutput, start: int, end: int) -> ChatChoiceLogprobs | None:
        return None if self.num_top is None else chat_logprobs(self.tokenizer, c, start, end, self.num_top)

    def opening_choices(self) -> list[ChatStreamChoice]:
        return [ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                for j in range(self.req.n)]

    def response_extras(self, finals: list[RequestOutput]) -> dict:
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(TokenTexts(self.tokenizer), finals[0].prompt_logprobs)}

    def stream_choice(self, d: ChoiceDelta) -> ChatStreamChoice:
        c = d.choice
        if self.req.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            self.sent_prompt_logprobs = True  # the next chunk (this choice's) carries them
            self.pending_prompt_logprobs = prompt_logprobs_json(TokenTexts(self.tokenizer), d.out.prompt_logprobs)
        return ChatStreamChoice(index=c.index, delta=DeltaMessage(content=d.text) if d.text else DeltaMessage(),
                                logprobs=self._logprobs(c, d.first_token, d.end_token),
                                finish_reason=c.finish_reason)

    def final_choice(self, prompt_index: int, c: CompletionOutput,
                     out: RequestOutput | None = None) -> ChatCompletionChoice:
        return ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                    logprobs=self._logprobs(c, 0, len(c.token_ids)),
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> dict:
        data = super().chunk(choices, usage)
        pending = self.pending_prompt_logprobs
        if pending is not None and choices:  # vlite's choice: vLLM refuses prompt_logprobs with stream
            self.pending_prompt_logprobs = None
            data["prompt_logprobs"] = [None if e is None else {str(t): lp.model_dump(mode="json") for t, lp in e.items()}
                                       for e in pending]
        else:
            data.pop("prompt_logprobs", None)
        for choice in data["choices"]:  # OpenAI omits unset delta fields (role after the first chunk)
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return data
