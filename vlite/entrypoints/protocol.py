"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Formats follow the OpenAI API reference (Completions, Chat Completions, Models, error
objects) plus vLLM's sampling extras (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, allowed_token_ids, bad_words, prompt_logprobs) and its /tokenize and /detokenize routes. Request models accept
unknown fields (OpenAI clients send new ones all the time) and the server logs them as
ignored; a known field of the wrong type is a 400.

Every field carries its bounds here, so that a value out of range is a 400 naming the field
before anything is tokenized, and the OpenAPI document (``/openapi.json``) states them:
text must be valid Unicode (a lone surrogate such as ``"\ud800"`` is refused), integers are
not booleans, floats are finite. Bounds that depend on the loaded model (the vocabulary for
token ids, ``max_model_len`` for ``max_tokens``, ``--max-n`` for ``n``) are checked by the
handlers (``vlite.entrypoints.serving``). The numbers are listed in docs/serve.md.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    StrictBool,
    Tag,
)

from vlite.engine import (
    INT64_MAX,
    INT64_MIN,
    MAX_ABS_LENGTH_PENALTY,
    MAX_ABS_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
)


def check_unicode(value: str) -> str:
    """Refuse text that cannot be encoded as UTF-8: a lone surrogate (JSON ``"\ud800"``, or the
    raw bytes ED A0 80, which Python's JSON decoder turns into one). Tokenizers, the chat
    template and the JSON encoder of the response all fail on such text.

    Raises:
        ValueError: naming the position of the first bad character.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: character {exc.start} is a lone surrogate "
                         f"({ascii(value[exc.start])}); send UTF-8 text") from None
    return value


def _not_bool(value):
    """JSON ``true``/``false`` must not be read as 1/0 (pydantic's lax mode would)."""
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


def _integer(value):
    """An integer, not a boolean; 3.0 is the integer 3 (JSON Schema's "integer" includes it)."""
    value = _not_bool(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Strict types: the value must have the JSON type the schema states. Pydantic's lax mode would
# read "5" or 5.0 as the integer 5, 0/1 as booleans and true as 1, which a schema-driven client
# (or fuzzer) rightly calls accepting invalid data.
def Int(**bounds):  # noqa: N802 - used like a type: Int(ge=1)
    """A strict integer field with bounds (``ge``, ``le``, ...); a boolean gets its own message.
    The bounds come before the validator so that they reach the JSON schema as ``minimum``/``maximum``."""
    return Annotated[int, Strict(), Field(**bounds), BeforeValidator(_integer)]


def Float(**bounds):  # noqa: N802 - used like a type: Float(ge=0.0)
    """A finite float field with bounds (an integer is accepted; JSON's Infinity/NaN and booleans are not)."""
    return Annotated[float, Strict(), Field(allow_inf_nan=False, **bounds), BeforeValidator(_not_bool)]


Bool = StrictBool


def _token_list(value):
    """Token id lists can hold millions of ids, so they skip the per-item Python validator of
    ``Int``: strict (Rust) validation refuses booleans and strings; integral floats (3.0, an
    integer in JSON Schema) are converted here in one pass, only when there are any."""
    if isinstance(value, list) and not all(type(x) is int for x in value):
        return [int(x) if type(x) is float and x.is_integer() else x for x in value]
    return value


Text = Annotated[str, AfterValidator(check_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(check_unicode)]
TokenId = Annotated[int, Strict(), Field(ge=0)]


def TokenIds(**bounds):  # noqa: N802 - used like a type
    """A list of token ids (each >= 0), validated in bulk (see ``_token_list``)."""
    return Annotated[list[TokenId], Field(**bounds), BeforeValidator(_token_list)]


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
    include_usage: Bool = False


class JsonSchemaFormat(OpenAIBase):
    """OpenAI's ``response_format.json_schema``: ``name`` (required by OpenAI, a-z A-Z 0-9 _ -,
    at most 64), ``description``, ``schema`` (a JSON Schema object), ``strict`` (accepted; vlite
    always enforces the whole schema)."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: Text | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(OpenAIBase):
    """OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
    "json_object"}`` (JSON mode: a JSON object) or ``{"type": "json_schema", "json_schema":
    {...}}``. vLLM's ``structural_tag`` type is refused (400)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBase):
    """vLLM's ``structured_outputs`` extra field (vLLM >= 0.12; it replaced ``guided_json``,
    ``guided_regex``, ``guided_choice``, ``guided_grammar``): exactly one of ``json``, ``regex``,
    ``choice``, ``grammar``, ``json_object``, plus whitespace options. ``structural_tag`` is refused."""

    json_schema: dict | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: Bool | None = None
    disable_any_whitespace: Bool = False
    disable_additional_properties: Bool = False
    whitespace_pattern: Text | None = None
    structural_tag: Text | dict | None = None


class SamplingRequest(OpenAIBase):
    """Fields common to /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: Text | None = None
    n: Int(ge=1) = 1  # and <= --max-n (checked by the handler)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    temperature: Float(ge=0.0, le=MAX_TEMPERATURE) | None = None  # 0 or >= 0.01
    top_p: Float(gt=0.0, le=1.0) | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    seed: Int(ge=INT64_MIN, le=INT64_MAX) | None = None
    presence_penalty: Float(ge=-2.0, le=2.0) | None = None
    frequency_penalty: Float(ge=-2.0, le=2.0) | None = None
    # {token id as a decimal string: bias}; ids < the vocabulary size (checked by the handler)
    logit_bias: dict[str, Float(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)] | None = None
    user: Text | None = None
    # vLLM's extras
    top_k: Int(ge=-1, le=MAX_TOP_K) | None = None
    min_p: Float(ge=0.0, le=1.0) | None = None
    repetition_penalty: Float(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY) | None = None
    min_tokens: Int(ge=0) = 0  # and <= max_tokens
    ignore_eos: Bool = False
    stop_token_ids: TokenIds() | None = None  # and < the vocabulary size
    allowed_token_ids: TokenIds(min_length=1) | None = None  # and < the vocabulary size
    bad_words: list[NonEmptyText] | None = None
    prompt_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None  # vLLM: logprobs of the prompt tokens
    # Beam search, in vLLM's older OpenAI-server style: use_beam_search + best_of (beam width,
    # default n) + length_penalty; returns the n best beams. best_of without beam search must
    # equal n (OpenAI's best_of sampling is not supported).
    best_of: Int(ge=1) | None = None  # and <= --max-n
    use_beam_search: Bool = False
    length_penalty: Float(ge=-MAX_ABS_LENGTH_PENALTY, le=MAX_ABS_LENGTH_PENALTY) | None = None
    # Structured output (vlite.entrypoints.structured_output): OpenAI's response_format, or vLLM's
    # structured_outputs; not both.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None


def _prompt_kind(value) -> str | None:
    """Which form of ``prompt`` this is, judged by its first element, so that only that form is
    validated: a union would validate a list of a million token ids as strings first, and
    collect a million errors, on the event loop."""
    if isinstance(value, str):
        return "prompt-text"
    if isinstance(value, list):
        first = value[0] if value else None
        if isinstance(first, str):
            return "prompt-texts"
        return "prompt-token-id-lists" if isinstance(first, list) else "prompt-token-ids"
    return None


Prompt = Annotated[
    Annotated[NonEmptyText, Tag("prompt-text")]
    | Annotated[Annotated[list[NonEmptyText], Field(min_length=1)], Tag("prompt-texts")]
    | Annotated[TokenIds(min_length=1), Tag("prompt-token-ids")]
    | Annotated[Annotated[list[TokenIds(min_length=1)], Field(min_length=1)], Tag("prompt-token-id-lists")],
    Discriminator(_prompt_kind, custom_error_type="prompt_type",
                  custom_error_message="prompt must be a string, a list of strings, a list of token ids or a "
                                       "list of lists of token ids"),
]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. ``prompt``: a string, a list of strings, token ids, or lists of ids."""

    prompt: Prompt
    max_tokens: Int(ge=1) | None = 16  # and <= max_model_len; null means 16 (OpenAI's default)
    logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    echo: Bool = False  # the prompt is prepended to each choice's text (and its tokens to logprobs)
    suffix: Text | None = Field(None, json_schema_extra={"maxLength": 0})  # refused (400) when not empty


class TextContentPart(OpenAIBase):
    type: Text
    text: Text | None = None


# The roles every chat template renders. "tool" and "function" messages answer tool calls,
# which this server does not make (``tools`` is refused), so they are refused too.
ChatRole = Literal["system", "user", "assistant"]


class ChatMessage(OpenAIBase):
    role: ChatRole
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions; the prompt is the model's chat template over ``messages``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int(ge=1) | None = None  # and <= max_model_len
    max_completion_tokens: Int(ge=1) | None = None
    logprobs: Bool = False
    top_logprobs: Int(ge=0, le=MAX_LOGPROBS) | None = None
    tools: list[dict] | None = Field(None, json_schema_extra={"maxItems": 0})  # refused (400) if not empty
    add_generation_prompt: Bool = True  # vLLM extra


class ResponsesContentPart(OpenAIBase):
    """A text part of a Responses API input message (``input_text``, or ``output_text`` in an
    assistant turn given back)."""

    type: Literal["input_text", "output_text"]
    text: Text


class ResponsesInputMessage(OpenAIBase):
    """One message of a Responses API ``input`` list."""

    type: Literal["message"] | None = None
    role: ChatRole
    content: Text | Annotated[list[ResponsesContentPart], Field(min_length=1)]


class ResponsesRequest(OpenAIBase):
    """POST /v1/responses (OpenAI's Responses API, text only): ``input`` (a string: one user
    message; or messages), ``instructions`` (a system message first), ``previous_response_id``
    (a stored response whose conversation comes before ``input``), ``store`` (keep this response
    for later ``previous_response_id`` and ``GET /v1/responses/{id}``)."""

    model: Text | None = None
    input: NonEmptyText | Annotated[list[ResponsesInputMessage], Field(min_length=1)]
    instructions: Text | None = None
    previous_response_id: NonEmptyText | None = None
    max_output_tokens: Int(ge=1) | None = None  # and <= max_model_len
    temperature: Float(ge=0.0, le=MAX_TEMPERATURE) | None = None  # 0 or >= 0.01
    top_p: Float(gt=0.0, le=1.0) | None = None
    stream: Bool = False
    store: Bool = True
    background: Bool = False  # refused (400) if true
    user: Text | None = None


class TokenizeRequest(OpenAIBase):
    """POST /tokenize: either ``prompt`` or ``messages`` (vLLM's shape)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class DetokenizeRequest(OpenAIBase):
    model: Text | None = None
    tokens: TokenIds()  # and < the vocabulary size


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for model in models:
        names.update(model.model_fields)
    return frozenset(names)


# Every field name a request body can hold: the error handler keeps these (and list indices)
# from a validation error's location and drops pydantic's union-member tags ("str", "list[int]").
REQUEST_FIELD_NAMES = _field_names(StreamOptions, CompletionRequest, ChatCompletionRequest, TextContentPart,
                                   ResponsesRequest, ResponsesInputMessage, ResponsesContentPart,
                                   ChatMessage, TokenizeRequest, DetokenizeRequest, ResponseFormat,
                                   JsonSchemaFormat, StructuredOutputsRequest) | {"schema", "json"}


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


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` of one token at one prompt position: logprob (nats, >= -9999.0),
    rank in the model's distribution (1 = most likely) and the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: per prompt token, null (the first) or {token id: PromptLogprob}
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


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
    prompt_logprobs: PromptLogprobs | None = None


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
    prompt_logprobs: PromptLogprobs | None = None  # only in the first content chunk, when asked for


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


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
