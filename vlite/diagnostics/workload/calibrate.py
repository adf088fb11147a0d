"""Calibration of stop tokens and stop strings: find, before the replay, a token id and a
string that a greedy request will really produce, so that stop-token and stop-string finishes
happen on any model (a random test model included).

A spec with ``stop_token_at = k`` gets ``stop_token_ids = [the token greedy decoding puts at
output index k]``; one with ``stop_string_at = k`` gets a stop string that spans output tokens
k and k + 1 (the last characters of token k's text and the first of token k + 1's). The
calibration run is a greedy request of the same prompt with ``max_tokens = k + 2`` and
``ignore_eos``; if it ends early or its text does not split cleanly, the spec is left without
the stop (it then ends by length, and the coverage report says the path was not exercised).

Calibration is part of the run: it reports its progress (``on_progress(done, total)``, requests)
and a first Ctrl-C (``stop``, the event the replay polls) ends it within an engine step or one
HTTP request; the specs calibrated by then keep their stops, the others are left without.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

from vlite.diagnostics.workload.sources import RequestSpec
from vlite.engine import EngineClient

# A greedy run: (items, stop, on_done) -> for each (spec, max_tokens) item, (output token ids,
# text of the first i tokens for i in 0..n), or None for an item that ``stop`` cut short.
# ``on_done(count)`` is called with the number of items finished so far.
GreedyFn = Callable[[list[tuple[RequestSpec, int]], threading.Event | None, Callable[[int], None]],
                    list[tuple[list[int], list[str]] | None]]
ProgressFn = Callable[[int, int], None]


def _quiet(done: int, total: int) -> None:
    pass


def needs_calibration(specs: list[RequestSpec]) -> bool:
    """Whether any spec has a ``stop_token_at`` or ``stop_string_at`` to resolve."""
    return any(s.stop_token_at is not None or s.stop_string_at is not None for s in specs)


def spanning_stop(prefix_texts: list[str], k: int) -> str | None:
    """A stop string across the boundary of output tokens k and k + 1, from the texts of the
    first i tokens (``prefix_texts[i]``); None when the boundary is not clean."""
    if len(prefix_texts) < k + 3:
        return None
    a, b = prefix_texts[k + 1], prefix_texts[k + 2]
    if not b.startswith(a) or len(b) == len(a) or not a:
        return None
    left = a[-2:] if len(a) >= 2 else a
    right = b[len(a):len(a) + 2]
    stop = left + right
    return stop if stop.strip() else None


def calibrate(specs: list[RequestSpec], greedy: GreedyFn, stop: threading.Event | None = None,
              on_progress: ProgressFn | None = None) -> list[RequestSpec]:
    """Resolve ``stop_token_at`` / ``stop_string_at`` of ``specs`` with one batch of greedy runs.

    ``on_progress(done, total)``: greedy runs finished of ``total``, at the start (0) and after
    each one (the last call has ``done == total`` unless ``stop`` cut the runs short). ``stop``
    set (a first Ctrl-C): the runs still going end at once; their specs get no stop token or
    string (they end by length).
    """
    todo = [(i, s) for i, s in enumerate(specs) if s.stop_token_at is not None or s.stop_string_at is not None]
    if not todo:
        return specs
    progress = on_progress or _quiet
    progress(0, len(todo))
    runs = greedy([(s, max(s.stop_token_at or 0, s.stop_string_at or 0) + 2) for _, s in todo], stop,
                  lambda done: progress(done, len(todo)))
    out = list(specs)
    for (i, s), run in zip(todo, runs):
        tokens, texts = run or ([], [""])
        stop_ids, stops = list(s.stop_token_ids), list(s.stop)
        if s.stop_token_at is not None and len(tokens) > s.stop_token_at:
            stop_ids.append(tokens[s.stop_token_at])
        if s.stop_string_at is not None:
            found = spanning_stop(texts, s.stop_string_at)
            if found:
                stops.append(found)
        out[i] = replace(s, stop_token_ids=tuple(stop_ids), stop=tuple(stops), stop_token_at=None,
                         stop_string_at=None)
    return out


def engine_greedy(engine: EngineClient) -> GreedyFn:
    """Greedy runs on an in-process engine, driven through ``EngineClient`` only (chat prompts
    rendered as the client renders them). ``stop`` is read before every engine step: once set,
    the calibration requests still running are aborted (their blocks freed) and the engine is
    stepped until it has none left."""
    from vlite.diagnostics.workload.replay import render_prompt
    from vlite.engine import RequestOrigin, SamplingParams

    def run(items, stop=None, on_done=None):
        ids_by_req: dict[str, list[int]] = {}
        order = []
        for s, m in items:
            rid = f"calibrate-{s.request_id}"
            engine.add_request(render_prompt(engine.tokenizer, s), SamplingParams(max_tokens=m, temperature=0.0,
                               ignore_eos=True), request_id=rid, origin=RequestOrigin(rid, route="calibration"))
            order.append(rid)
        stopped = False
        while engine.has_unfinished_requests():
            if stop is not None and stop.is_set() and not stopped:
                stopped = True
                for rid in order:
                    if rid not in ids_by_req:
                        engine.abort(rid)
            for o in engine.step():
                if o.finished and not stopped:
                    ids_by_req[o.request_id] = list(o.outputs[0].token_ids)
                    if on_done is not None:
                        on_done(len(ids_by_req))
        res = []
        for rid in order:
            if rid not in ids_by_req:
                res.append(None)
                continue
            ids = ids_by_req[rid]
            texts = [engine.tokenizer.decode(ids[:j], skip_special_tokens=True) for j in range(len(ids) + 1)]
            res.append((ids, texts))
        return res
    return run
