"""What a request asks structured output for: vLLM's ``StructuredOutputsParams``.

A plain dataclass (no torch, no grammar library at import) so that ``SamplingParams`` and the
API server's request mapping can use it; ``vlite.engine.core.structured_output`` compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The constraint fields of StructuredOutputsParams; exactly one is set.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One request's output constraint (vLLM's ``StructuredOutputsParams``; exactly one of the
    first five fields).

    json: a JSON Schema (a dict, or its JSON text); the output is a JSON value valid against it
        (llguidance's JSON Schema subset; an unsupported keyword is an error, not ignored).
    regex: the whole output matches this regular expression (Rust ``regex`` syntax).
    choice: the output is exactly one of these strings.
    grammar: a context-free grammar in Lark syntax or llama.cpp's GBNF.
    json_object: True: the output is a JSON object (OpenAI's JSON mode, as vLLM: ``{"type": "object"}``).
    disable_any_whitespace: no whitespace between JSON tokens (default: any JSON whitespace).
    disable_additional_properties: objects of ``json`` that do not say otherwise get
        ``"additionalProperties": false``.
    whitespace_pattern: a regex for the whitespace allowed between JSON tokens.

    Raises:
        ValueError: none or several constraints, or a field of the wrong type; the message
            names the field and what is allowed.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [f for f in CONSTRAINT_FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(self.json, dict):
                raise ValueError("structured_outputs.json must be a JSON Schema object, got "
                                 f"{type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty Lark or GBNF grammar")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(f for f in CONSTRAINT_FIELDS if getattr(self, f) not in (None, False))

    def cache_key(self) -> str:
        """A canonical text naming this constraint and its options (the compiler cache's key)."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                           self.disable_additional_properties, self.whitespace_pattern], sort_keys=True)

    def to_llguidance(self) -> str:
        """The llguidance grammar text of this constraint.

        Raises:
            ValueError: a grammar that cannot be converted (e.g. malformed GBNF).
        """
        import llguidance

        kind = self.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else self.json
            if self.disable_additional_properties:
                schema = _close_objects(schema)
            options: dict[str, Any] = {}
            if self.disable_any_whitespace:
                options["whitespace_flexible"] = False
            if self.whitespace_pattern is not None:
                options["whitespace_pattern"] = self.whitespace_pattern
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", self.choice)
        return llguidance.grammar_from("grammar", self.grammar)


def _close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``false`` (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
