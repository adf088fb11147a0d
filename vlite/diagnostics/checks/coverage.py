"""Coverage: which engine paths a leak-check run exercised, and which it never did.

In process the counts come from the engine's introspection point
(``vlite.engine.introspection.EngineView.coverage``); over HTTP from the server's ``/metrics``
counters (``vlite:kv_block_allocations{site}``, ``vlite:sequence_finished{kind}``,
``vlite:sequence_aborted{state}``, ``vlite:num_preemptions``, ``vlite:num_resumptions``,
``vlite:prefix_cache_hits``, ``vlite:forks``, ``vlite:copy_on_write``, ``vlite:beam_prunes``).
Counts are differences between the start and the end of the replay. A path the run never
exercised is listed in ``not_exercised``: a leak on it could not have been seen.
"""

from __future__ import annotations

# label -> test on the coverage dict; every path the default workload is meant to walk.
PATHS: dict[str, callable] = {
    "prefill allocation": lambda c: c["allocation_sites"].get("prefill", 0) > 0,
    "decode append": lambda c: c["allocation_sites"].get("decode append", 0) > 0,
    "prefix-cache hit": lambda c: c["prefix_hit_tokens"] > 0,
    "fork": lambda c: c["forks"] > 0,
    "copy-on-write": lambda c: c["copy_on_write"] > 0,
    "preemption": lambda c: c["preemptions"] > 0,
    "resumption after preemption": lambda c: c.get("resumptions", 0) > 0,
    "beam search pruning": lambda c: c["beam_prunes"] > 0,
    "EOS finish": lambda c: c["finish_reasons"].get("stop:eos", 0) > 0,
    "stop-token finish": lambda c: c["finish_reasons"].get("stop:stop_token", 0) > 0,
    "stop-string finish": lambda c: c["finish_reasons"].get("stop:stop_string", 0) > 0,
    "length finish": lambda c: c["finish_reasons"].get("length", 0) > 0,
    "abort while waiting": lambda c: c.get("abort_states", {}).get("waiting", 0) > 0,
    "abort during prefill": lambda c: c.get("abort_states", {}).get("prefill", 0) > 0,
    "abort during decode": lambda c: c.get("abort_states", {}).get("decode", 0) > 0,
    "abort after preemption": lambda c: (c.get("abort_states", {}).get("preempted", 0)
                                         + c.get("abort_states", {}).get("resumed", 0)) > 0,
    "abort after resumption": lambda c: c.get("abort_states", {}).get("resumed", 0) > 0,
}
# The request API: every feature that takes its own engine path, and aborts of each
# request family in the states where its bookkeeping differs.
_F = "features"
PATHS.update({
    "structured output: json schema": lambda c: c.get(_F, {}).get("structured:json", 0) > 0,
    "structured output: regex": lambda c: c.get(_F, {}).get("structured:regex", 0) > 0,
    "structured output: choice": lambda c: c.get(_F, {}).get("structured:choice", 0) > 0,
    "structured output: grammar": lambda c: c.get(_F, {}).get("structured:grammar", 0) > 0,
    "structured output: json_object": lambda c: c.get(_F, {}).get("structured:json_object", 0) > 0,
    "logprobs": lambda c: c.get(_F, {}).get("logprobs", 0) > 0,
    "prompt_logprobs": lambda c: c.get(_F, {}).get("prompt_logprobs", 0) > 0,
    "logit_bias": lambda c: c.get(_F, {}).get("logit_bias", 0) > 0,
    "allowed_token_ids": lambda c: c.get(_F, {}).get("allowed_token_ids", 0) > 0,
    "bad_words": lambda c: c.get(_F, {}).get("bad_words", 0) > 0,
    "penalties (repetition, presence, frequency)": lambda c: c.get(_F, {}).get("penalties", 0) > 0,
    "top_k / top_p / min_p": lambda c: c.get(_F, {}).get("top_k/top_p/min_p", 0) > 0,
    "min_tokens": lambda c: c.get(_F, {}).get("min_tokens", 0) > 0,
    "seeded sampling": lambda c: c.get(_F, {}).get("seed", 0) > 0,
    "abort during prefill (n > 1)": lambda c: c.get("aborts_by_family", {}).get("n > 1: prefill", 0) > 0,
    "abort during decode (n > 1)": lambda c: c.get("aborts_by_family", {}).get("n > 1: decode", 0) > 0,
    "abort during decode (beam search)": lambda c: c.get("aborts_by_family", {}).get("beam search: decode", 0) > 0,
    "abort (structured output)": lambda c: any(k.startswith("structured output:") and v > 0
                                               for k, v in c.get("aborts_by_family", {}).items()),
})
# Refusals (a multi-prompt completion with one prompt refused after the others were
# admitted, sglang#28380; a request refused once running) and a constraint aborted while waiting.
PATHS.update({
    "multi-prompt request with one prompt rejected": lambda c: c.get("rejections", {}).get("sibling rejected", 0) > 0,
    "request rejected after admission": lambda c: c.get("rejections", {}).get("after scheduling", 0) > 0,
    "abort while waiting (structured output)":
        lambda c: c.get("aborts_by_family", {}).get("structured output: waiting", 0) > 0,
})
# The API server's routes with every client action (vlite:client_disconnects{route, when}): only
# a target that goes through the API server (--url on vlite serve) has them; in process the
# replay drives the engine, and ``section`` leaves them out as not applicable.
API_ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
API_WHEN = {"disconnect before the first token": "before first token", "disconnect mid-stream": "mid-stream",
            "client timeout": "non-streaming"}
API_PATHS: dict[str, callable] = {
    f"{name}: {what}": (lambda c, key=f"{route} {when}": c.get("disconnects", {}).get(key, 0) > 0)
    for name, route in API_ROUTES.items() for what, when in API_WHEN.items()}
PATHS.update(API_PATHS)
_COUNTS = ("allocation_sites", "finish_reasons", "abort_states", "features", "aborts_by_family", "rejections",
           "disconnects")
_SCALARS = ("preemptions", "preemptions_in_prefill", "resumptions", "prefix_hit_tokens", "forks", "copy_on_write",
            "beam_prunes")


def diff(after: dict, before: dict | None) -> dict:
    """``after - before`` for every count (both in the ``Coverage.to_dict`` shape)."""
    before = before or {}
    out: dict = {}
    for key in _COUNTS:
        if key == "disconnects" and key not in after:  # an API layer's count: absent in process
            continue
        a, b = after.get(key) or {}, before.get(key) or {}
        out[key] = {k: v - b.get(k, 0) for k, v in sorted(a.items()) if v - b.get(k, 0)}
    for key in _SCALARS:
        out[key] = (after.get(key) or 0) - (before.get(key) or 0)
    return out


def section(after: dict | None, before: dict | None = None) -> dict | None:
    """The report's coverage section: counts over the run and ``not_exercised`` (path labels)."""
    if after is None:
        return None
    cov = diff(after, before)
    api = "disconnects" in after  # counted only by a server's API layer (from_metrics_text)
    cov["not_applicable"] = [] if api else list(API_PATHS)
    cov["not_exercised"] = [label for label, ok in PATHS.items() if not ok(cov) and label not in cov["not_applicable"]]
    return cov


def from_metrics_text(text: str) -> dict | None:
    """Coverage counts from a vlite ``/metrics`` page, or None when the server exposes none.

    Raises:
        MetricsFormatError: the page is not Prometheus text.
    """
    from vlite.diagnostics.readers.metrics_text import parse_page

    labelled = {"vlite:kv_block_allocations_total": ("allocation_sites", "site"),
                "vlite:sequence_finished_total": ("finish_reasons", "kind"),
                "vlite:sequence_aborted_total": ("abort_states", "state"),
                "vlite:request_feature_total": ("features", "feature"),
                "vlite:sequence_aborted_by_family_total": ("aborts_by_family", "family_state"),
                "vlite:request_rejected_total": ("rejections", "stage")}
    scalars = {"vlite:num_preemptions_total": "preemptions", "vlite:num_resumptions_total": "resumptions",
               "vlite:num_preemptions_in_prefill_total": "preemptions_in_prefill",
               "vlite:prefix_cache_hits_total": "prefix_hit_tokens", "vlite:forks_total": "forks",
               "vlite:copy_on_write_total": "copy_on_write", "vlite:beam_prunes_total": "beam_prunes"}
    out: dict = {k: {} for k, _ in labelled.values()} | {k: 0 for k in scalars.values()}
    seen = False
    for s in parse_page(text, allow_empty=True).samples:
        if s.name == "vlite:client_disconnects_total":  # "<route> <when>"
            out.setdefault("disconnects", {})[f"{s.labels.get('route')} {s.labels.get('when')}"] = int(s.value)
        elif s.name in labelled:
            key, label = labelled[s.name]
            out[key][s.labels.get(label, "")] = int(s.value)
            seen = True
        elif s.name in scalars:
            out[scalars[s.name]] = int(s.value)
            seen = seen or s.name == "vlite:forks_total"
    return out if seen else None


def lines(cov: dict | None) -> list[str]:
    """Human lines for the console and report.md (warnings for paths not exercised)."""
    if cov is None:
        return ["coverage: not available (the target exposes no coverage counters)"]
    sites = ", ".join(f"{k} {v}" for k, v in cov["allocation_sites"].items()) or "none"
    finishes = ", ".join(f"{k} {v}" for k, v in cov["finish_reasons"].items()) or "none"
    aborts = ", ".join(f"{k} {v}" for k, v in cov.get("abort_states", {}).items()) or "none"
    features = ", ".join(f"{k} {v}" for k, v in cov.get("features", {}).items()) or "none"
    families = ", ".join(f"{k} {v}" for k, v in cov.get("aborts_by_family", {}).items()) or "none"
    # finishes and aborts count sequences: an n > 1 or beam request that is aborted counts once
    # per live sequence, so these exceed the "aborted requests" of the zombie line
    out = [f"coverage: allocations by site: {sites}",
           f"coverage: sequences finished: {finishes}; sequences aborted, by state: {aborts} "
           "(sequences, not requests: an n > 1 or beam-search request has several)",
           f"coverage: {cov['preemptions']} preemptions ({cov.get('preemptions_in_prefill', 0)} during prefill), "
           f"{cov.get('resumptions', 0)} resumptions, "
           f"{cov['prefix_hit_tokens']} prefix-hit tokens, {cov['forks']} forks, {cov['copy_on_write']} "
           f"copy-on-write copies, {cov['beam_prunes']} beam prunes",
           f"coverage: requests by feature: {features}",
           f"coverage: sequences aborted, by request family and state: {families}"]
    rejections = ", ".join(f"{k} {v}" for k, v in cov.get("rejections", {}).items()) or "none"
    out.append(f"coverage: requests refused, by stage: {rejections}")
    if cov.get("disconnects") is not None:
        left = ", ".join(f"{k} {v}" for k, v in cov["disconnects"].items()) or "none"
        out.append(f"coverage: clients that left early, by route and when: {left}")
    out += [f"not exercised: {p}" for p in cov["not_exercised"]]
    na = cov.get("not_applicable") or []
    if na:
        out.append(f"coverage: {len(na)} API-server paths not applicable here (the replay drives the engine, not the "
                   "API server): the chat and completions routes with each client action; `--url` on vlite serve "
                   "walks them")
    if not cov["not_exercised"]:
        out.append(f"coverage: all {len(PATHS) - len(na)} engine paths of the checklist exercised")
    return out


# The paths leak-check exists for: a client that leaves while its request waits, prefills or
# decodes. The verdict line names each of them a run did not walk; a CLEAN run that walked none
# of them has not tested the thing a user runs it for, and the command exits 4, not 0
# (checks/verdict.py EXIT_HEADLINE_NOT_EXERCISED).
HEADLINE = ("abort while waiting", "abort during prefill", "abort during decode")


def headline_missing(not_exercised: list[str]) -> list[str]:
    """The headline paths (client aborts, ``HEADLINE``) among ``not_exercised``, in checklist order."""
    return [p for p in HEADLINE if p in not_exercised]


def no_client_abort(not_exercised: list[str]) -> bool:
    """Whether the run walked none of the headline paths: no client abort in any state."""
    return len(headline_missing(not_exercised)) == len(HEADLINE)


def caveat(not_exercised: list[str]) -> str | None:
    """The verdict line's caveat for paths a run did not exercise, short: the headline ones by
    name, the rest counted ("abort during decode was not exercised, nor 8 other checklist
    paths"); with no headline path missing, the first other path by name and the rest counted.
    None when every path was exercised."""
    if not not_exercised:
        return None
    named = headline_missing(not_exercised) or [not_exercised[0]]
    rest = len(not_exercised) - len(named)
    words = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
    words += " was not exercised" if len(named) == 1 else " were not exercised"
    if rest:
        others = "other checklist path" if rest == 1 else "other checklist paths"
        words += f", nor {rest} {others}"
    return words
