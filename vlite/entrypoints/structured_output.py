"""Structured output on the OpenAI routes: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` become the engine's ``StructuredOutputsParams``, compiled before the
request is queued so that a bad schema, regex or grammar is a 400.

Mapping (as vLLM's OpenAI server, /v1/chat/completions and /v1/completions alike):

=========================================================  ========================================
request                                                    constraint
=========================================================  ========================================
``response_format: {"type": "text"}`` or absent            none
``response_format: {"type": "json_object"}``               ``json_object`` (a JSON object)
``response_format: {"type": "json_schema", "json_schema":   ``json`` = the schema
{"name", "schema", "strict"}}``
``structured_outputs: {"json" | "regex" | "choice" |       that one, with ``disable_any_whitespace``,
"grammar" | "json_object": ...}``                          ``disable_additional_properties``,
                                                           ``whitespace_pattern``
=========================================================  ========================================

Refused with a 400 naming the field: both a constraining ``response_format`` and
``structured_outputs``; ``structural_tag`` (either form); vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, ``guided_whitespace_pattern`` and
``guided_decoding_backend``, which vLLM removed in 0.12 (a server that ignored them would return
free text to a client that asked for JSON); beam search with a constraint.
"""

from __future__ import annotations

import asyncio

from vlite.engine import StructuredOutputsParams
from vlite.entrypoints.errors import APIError
from vlite.entrypoints.protocol import SamplingRequest
from vlite.entrypoints.state import ServerState

# vLLM's pre-0.12 extra fields -> their structured_outputs key (None: no replacement).
REMOVED_GUIDED_FIELDS: dict[str, str | None] = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern", "guided_decoding_backend": None,
}


def constraint_param(req: SamplingRequest) -> str:
    """The request field that carries the constraint ("response_format" or "structured_outputs")."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    return "structured_outputs"


def structured_outputs_params(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's output constraint, or None for free text.

    Raises:
        APIError: 400 naming the field, for a removed ``guided_*`` field, ``structural_tag``,
            two constraints, a ``json_schema`` format without a schema, or a malformed value.
    """
    extra = req.model_extra or {}
    for name, new in REMOVED_GUIDED_FIELDS.items():
        if name in extra:
            instead = (f'send "structured_outputs": {{"{new}": ...}}' if new
                       else "remove it (vlite always uses llguidance)")
            raise APIError(400, f"{name} was removed in vLLM 0.12 and is not supported; {instead}", param=name)
    rf, so = req.response_format, req.structured_outputs
    fields: dict | None = None
    if rf is not None and rf.type == "structural_tag":
        raise APIError(400, "response_format type 'structural_tag' is not supported; use 'json_schema' or "
                       "'json_object'", param="response_format")
    if rf is not None and rf.type == "json_object":
        fields = {"json_object": True}
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise APIError(400, "response_format type 'json_schema' needs json_schema.schema (a JSON Schema "
                           "object)", param="response_format")
        fields = {"json": rf.json_schema.json_schema}
    if so is not None:
        if fields is not None:
            raise APIError(400, "give either response_format (json_object / json_schema) or structured_outputs, "
                           "not both", param="structured_outputs")
        if so.structural_tag is not None:
            raise APIError(400, "structured_outputs.structural_tag is not supported; use json, regex, choice, "
                           "grammar or json_object", param="structured_outputs")
        fields = {"json": so.json_schema, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                  "json_object": so.json_object, "disable_any_whitespace": so.disable_any_whitespace,
                  "disable_additional_properties": so.disable_additional_properties,
                  "whitespace_pattern": so.whitespace_pattern}
    if fields is None:
        return None
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError(400, str(exc), param=constraint_param(req)) from None


async def compile_constraint(state: ServerState, req: SamplingRequest, params: StructuredOutputsParams) -> None:
    """Compile ``params`` into the engine's grammar cache in the tokenizer threads (off the event
    loop; the first constrained request also builds the llguidance tokenizer, ~0.2 s), so the
    engine thread finds it compiled.

    Raises:
        APIError: 400 naming ``response_format`` or ``structured_outputs`` for an invalid schema,
            regex, choice list or grammar, with llguidance's reason.
    """
    compiler = state.engine.structured_output_compiler
    try:
        await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool(), compiler.compile, params)
    except ValueError as exc:
        raise APIError(400, str(exc), param=constraint_param(req)) from None
