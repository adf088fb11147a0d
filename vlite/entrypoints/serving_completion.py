"""POST /v1/completions (OpenAI's legacy Completions API, as vLLM serves it).

Each prompt is one engine request (the X-Request-Id itself, or ``<X-Request-Id>-<prompt_index>``
when the request carries several prompts) with ``SamplingParams(n=n)``: its ``n`` samples (or
beams, with ``use_beam_search``) share the prompt's KV blocks. Choice ``j`` of prompt ``p`` is
the response's choice ``p * n + j``, as in OpenAI's and vLLM's servers. Streaming sends OpenAI's
``text_completion`` chunks (one choice per chunk) as Server-Sent Events, ending with
``data: [DONE]``.

``echo`` prepends the prompt (its text, or its decoded token ids) to each choice's text, in the
choice's first chunk when streaming; with ``logprobs`` the legacy lists then cover the prompt
tokens too (the first one's logprob is null), computed as prompt logprobs with top-``logprobs``
alternatives unless ``prompt_logprobs`` says otherwise. ``prompt_logprobs`` (vLLM) adds each
choice's ``prompt_logprobs`` (in its first chunk when streaming; vLLM refuses it with
``stream``). ``max_tokens: 0`` (vLLM's echo-only request) is not supported.
"""

from __future__ import annotations

from vlite.engine import CompletionOutput, RequestOutput, SamplingParams
from vlite.entrypoints.errors import APIError
from vlite.entrypoints.logprobs_format import (
    TokenTexts,
    legacy_logprobs,
    prompt_entries_as_floats,
    prompt_logprobs_json,
)
from vlite.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from vlite.entrypoints.serving import (
    ChoiceDelta,
    OpenAIServing,
    RenderedPrompt,
    check_limits,
    check_prompt_chars,
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
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.max_tokens is None:
            req.max_tokens = 16  # OpenAI: "integer or null, defaults to 16"
        self.items = _prompts(req)
        check_limits(self.state, req, req.max_tokens, len(self.items))
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo and req.logprobs is not None:
            prompt_logprobs = req.logprobs  # vLLM: echo with logprobs covers the prompt tokens too
        self.sampling = sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs)
        for item in self.items:  # refuse an over-long text before paying for its tokenization
            if isinstance(item, str):
                check_prompt_chars(self.state, len(item), "prompt")
        self.texts = TokenTexts(self.tokenizer)
        self.prompt_texts: dict[int, str] = {}  # echo: each prompt's text, by prompt index
        self.started: set[tuple[int, int]] = set()  # (prompt index, choice index) already streamed

    def render(self) -> list[RenderedPrompt]:
        return [(item, self.tokenizer(item).input_ids) if isinstance(item, str) else (None, list(item))
                for item in self.items]

    def params(self, prompts: list[RenderedPrompt]) -> SamplingParams:
        return self.sampling

    def _prompt_text(self, prompt_index: int, out: RequestOutput) -> str:
        """The prompt as echoed: the text sent, or the decoded token ids."""
        text = self.prompt_texts.get(prompt_index)
        if text is None:
            text = out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)
            self.prompt_texts[prompt_index] = text
        return text

    def _choice(self, prompt_index: int, out: RequestOutput, c: CompletionOutput, text: str, start: int, end: int,
                text_offset: int, with_prompt: bool) -> CompletionChoice:
        """A choice with output text ``text`` and tokens [start, end) at character ``text_offset``
        of the output; ``with_prompt``: the first chunk of the choice (echo and prompt_logprobs go there)."""
        req = self.req
        echo = req.echo and with_prompt
        prompt_text = self._prompt_text(prompt_index, out) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo:
                legacy_logprobs(self.texts, out.prompt_token_ids, prompt_entries_as_floats(out.prompt_logprobs),
                                req.logprobs, 0, logprobs)
            legacy_logprobs(self.texts, c.token_ids[start:end], (c.logprobs or [])[start:end], req.logprobs,
                            len(prompt_text) + text_offset, logprobs)
        prompt_logprobs = None
        if with_prompt and req.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_json(self.texts, out.prompt_logprobs)
        return CompletionChoice(index=prompt_index * req.n + c.index, text=prompt_text + text if echo else text,
                                logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason if c.finish_reason is not None else None,
                                prompt_logprobs=prompt_logprobs)

    def stream_choice(self, d: ChoiceDelta) -> CompletionChoice:
        key = (d.prompt_index, d.choice.index)
        first = key not in self.started
        self.started.add(key)
        return self._choice(d.prompt_index, d.out, d.choice, d.text, d.first_token, d.end_token, d.text_offset, first)

    def final_choice(self, prompt_index: int, c: CompletionOutput, out: RequestOutput | None = None) -> CompletionChoice:
        return self._choice(prompt_index, out, c, c.text, 0, len(c.token_ids), 0, True)

    def chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> dict:
        data = super().chunk(choices, usage)
        for choice in data["choices"]:  # prompt_logprobs only in a choice's first chunk, when asked for
            if choice.get("prompt_logprobs", 0) is None:
                del choice["prompt_logprobs"]
        return data
