"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Formats follow the OpenAI API reference (Completions, Chat Completions, Models, error
objects) plus vLLM's sampling extras (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids) and its /tokenize and /detokenize routes. Request models accept
unknown fields (OpenAI clients send new ones all the time) and the server logs them as
ignored; a known field of the wrong type is a 400.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBase(BaseModel):
    """Request base: unknown fields are kept in ``model_extra`` (and logged as ignored)."""

    model_config = ConfigDict(extra="allow")


# ---- errors -----------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---- shared request fields --------------------------------------------------------------------
class StreamOptions(OpenAIBase):
    include_usage: bool = False


class SamplingRequest(OpenAIBase):
    """Fields common to /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Beam search, in vLLM's older OpenAI-server style: use_beam_search + best_of (beam width,
    # default n) + length_penalty; returns the n best beams. best_of without beam search must
    # equal n (OpenAI's best_of sampling is not supported).
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. ``prompt``: a string, a list of strings, token ids, or lists of ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class TextContentPart(OpenAIBase):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBase):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions; the prompt is the model's chat template over ``messages``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True  # vLLM extra


class TokenizeRequest(OpenAIBase):
    """POST /tokenize: either ``prompt`` or ``messages`` (vLLM's shape)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per output token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vlite"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
