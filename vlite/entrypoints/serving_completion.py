"""POST /v1/completions (OpenAI's legacy Completions API, as vLLM serves it).

Each prompt is one engine request (the X-Request-Id itself, or ``<X-Request-Id>-<prompt_index>``
when the request carries several prompts) with ``SamplingParams(n=n)``: its ``n`` samples (or
beams, with ``use_beam_search``) share the prompt's KV blocks. Choice ``j`` of prompt ``p`` is
the response's choice ``p * n + j``, as in OpenAI's and vLLM's servers. Streaming sends OpenAI's
``text_completion`` chunks (one choice per chunk) as Server-Sent Events, ending with
``data: [DONE]``.
"""

from __future__ import annotations

from vlite.engine import CompletionOutput, SamplingParams
from vlite.entrypoints.errors import APIError
from vlite.entrypoints.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from vlite.entrypoints.serving import (
    ChoiceDelta,
    OpenAIServing,
    RenderedPrompt,
    check_limits,
    check_prompt_chars,
    clamp_logprob,
    sampling_params,
)


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


class OpenAIServingCompletion(OpenAIServing):
    """POST /v1/completions on the shared pipeline (serving.OpenAIServing): each prompt (a text,
    tokenized with the model's special tokens, or token ids as given) is one engine request; a
    choice is ``CompletionChoice`` in ``text_completion`` objects, legacy ``logprobs``."""

    response_id_prefix = "cmpl"
    chunk_type = CompletionResponse  # OpenAI streams the completion object itself
    response_type = CompletionResponse
    req: CompletionRequest

    def check(self) -> None:
        req = self.req
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.max_tokens is None:
            req.max_tokens = 16  # OpenAI: "integer or null, defaults to 16"
        self.items = _prompts(req)
        check_limits(self.state, req, req.max_tokens, len(self.items))
        self.sampling = sampling_params(req, req.max_tokens, req.logprobs)
        for item in self.items:  # refuse an over-long text before paying for its tokenization
            if isinstance(item, str):
                check_prompt_chars(self.state, len(item), "prompt")

    def render(self) -> list[RenderedPrompt]:
        return [(item, self.tokenizer(item).input_ids) if isinstance(item, str) else (None, list(item))
                for item in self.items]

    def params(self, prompts: list[RenderedPrompt]) -> SamplingParams:
        return self.sampling

    def _logprobs(self, c: CompletionOutput, start: int, end: int, text_offset: int) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, c, start, end, self.req.logprobs, text_offset)

    def stream_choice(self, d: ChoiceDelta) -> CompletionChoice:
        c = d.choice
        return CompletionChoice(index=d.prompt_index * self.req.n + c.index, text=d.text,
                                logprobs=self._logprobs(c, d.first_token, d.end_token, d.text_offset),
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason if c.finish_reason is not None else None)

    def final_choice(self, prompt_index: int, c: CompletionOutput) -> CompletionChoice:
        return CompletionChoice(index=prompt_index * self.req.n + c.index, text=c.text,
                                logprobs=self._logprobs(c, 0, len(c.token_ids), 0),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
