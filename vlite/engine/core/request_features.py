"""Which features of the request API a request uses: the leak check's coverage of the engine's
request paths (a leak on a path the run never walked could not have been seen).

Names are vLLM's ``SamplingParams`` fields, grouped where they take one code path (the
penalties share one logits processor, the truncations one sampler step).
"""

from __future__ import annotations

from vlite.engine.sampling_params import SamplingParams

STRUCTURED_FORMS = ("json", "regex", "choice", "grammar", "json_object")


def request_family(params: SamplingParams) -> str:
    """How the engine runs the request's sequences: ``"beam search"``, ``"n > 1"``,
    ``"structured output"`` or ``"single"`` (the first that applies)."""
    if params.beam_width > 1:
        return "beam search"
    if params.n > 1:
        return "n > 1"
    if params.structured_outputs is not None:
        return "structured output"
    return "single"


def request_features(params: SamplingParams) -> tuple[str, ...]:
    """Every request-API feature ``params`` asks for, e.g. ``("structured:json", "logprobs")``."""
    out = []
    so = params.structured_outputs
    if so is not None:
        out += [f"structured:{form}" for form in STRUCTURED_FORMS if getattr(so, form, None) not in (None, False)]
    checks = {
        "n > 1": params.n > 1, "beam search": params.beam_width > 1,
        "logprobs": params.logprobs is not None, "prompt_logprobs": params.prompt_logprobs is not None,
        "logit_bias": bool(params.logit_bias), "allowed_token_ids": params.allowed_token_ids is not None,
        "bad_words": bool(params.bad_words),
        "penalties": (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                      or params.frequency_penalty != 0.0),
        "top_k/top_p/min_p": params.top_k not in (-1, 0) or params.top_p < 1.0 or params.min_p > 0.0,
        "seed": params.seed is not None, "min_tokens": params.min_tokens > 0,
        "stop strings": bool(params.stop), "stop_token_ids": bool(params.stop_token_ids),
        "ignore_eos": params.ignore_eos, "random sampling": params.temperature > 0,
    }
    return tuple(out + [name for name, used in checks.items() if used])
