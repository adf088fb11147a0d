"""What a server must still do after an abort storm, judged from the client's side alone.

Two checks, pure functions over what a client measured (``targets/storm.py`` takes the
measures, over one server URL):

- **Wedge probe** (``wedge_bound``, ``judge_wedge``). A plain request sent after the storm
  must complete within a bound taken from the run's own pace: ``max(floor_s, factor x the
  slowest of the same request sent before the storm)`` (``WEDGE_FLOOR_S`` 5 s, ``WEDGE_FACTOR``
  10; ``--wedge-timeout-s`` sets the bound outright), in the spirit of ``pace.py``'s bound for
  zombies. A server whose ``/health`` answers 200 while that request does not complete is
  WEDGED: TensorRT-LLM PR #12313, where leaked KV was reclaimed only when new work was
  admitted, so a pool the leak had filled stayed full for good behind a healthy ``/health``.
- **Output canary** (``judge_canary``). A fixed greedy prompt (temperature 0, fixed
  ``max_tokens``, ``ignore_eos``) is sent twice before the storm and once after. The second
  run before is the reference: like the run after, it may hit the prefix cache, so a server
  whose cached path changes greedy output is not blamed on the storm (when the two runs before
  differ, drift is not judged). After the storm, a 200 with zero tokens is EMPTY-OUTPUT
  (TensorRT-LLM PR #15018: orphaned blocks reused, HTTP 200 with no token while the KV
  accounting looked healthy); a different text is OUTPUT-DRIFT.

Verdicts: WEDGED, EMPTY-OUTPUT, OUTPUT-DRIFT (exit 1, like LEAK). They replace a CLEAN,
ZOMBIE or INCONCLUSIVE verdict (the one replaced stays in the notes); beside a LEAK, the cause to
fix (a leak that fills the pool wedges the server), the verdict stays LEAK and its summary adds
"after the abort storm: WEDGED: ...".
"""

from __future__ import annotations

from vlite.diagnostics.checks.verdict import Verdict

WEDGE_FLOOR_S = 5.0
WEDGE_FACTOR = 10.0
# the storm verdicts, worst first
STORM_VERDICTS = (Verdict.WEDGED, Verdict.EMPTY_OUTPUT, Verdict.OUTPUT_DRIFT)


def wedge_bound(latencies_s: list[float], *, floor_s: float = WEDGE_FLOOR_S, factor: float = WEDGE_FACTOR,
                override_s: float | None = None) -> float:
    """Seconds the plain request after the storm may take: ``override_s`` when given (the
    option), else ``max(floor_s, factor x max(latencies_s))``; ``floor_s`` when nothing was
    measured. ``latencies_s``: end-to-end seconds of the same request sent before the storm."""
    if override_s is not None:
        return override_s
    if not latencies_s:
        return floor_s
    return max(floor_s, factor * max(latencies_s))


def judge_wedge(probe: dict) -> tuple[str | None, str]:
    """(verdict or None, the reason in words) of one wedge probe.

    ``probe``: ``health_status`` (the HTTP status of ``GET /health``, or an error name),
    ``completed`` (the request answered within the bound), ``status`` (its HTTP status or an
    error name), ``latency_s``, ``bound_s``. WEDGED needs a healthy ``/health``: a server that
    answers nothing at all is down, which the run reports otherwise.
    """
    bound = probe["bound_s"]
    if probe["completed"]:
        return None, (f"a plain request completed {probe['latency_s']:.3g} s after the storm "
                      f"(bound {bound:.3g} s)")
    if probe["health_status"] == 200:
        return Verdict.WEDGED, (f"/health answers 200 but a plain request did not complete within {bound:.3g} s "
                          f"after the abort storm ({probe['status']})")
    return None, (f"a plain request did not complete within {bound:.3g} s after the storm ({probe['status']}) "
                  f"and /health answered {probe['health_status']}: the server is down, not wedged")


def _empty(run: dict) -> bool:
    """A 200 whose completion has no token (usage says 0, or no usage and no text)."""
    tokens = run.get("completion_tokens")
    return run.get("status") == 200 and (tokens == 0 or (tokens is None and not run.get("text")))


def judge_canary(before: list[dict], after: dict | None) -> tuple[str | None, str]:
    """(verdict or None, the reason in words) of the output canary.

    ``before``: the canary runs before the storm (two: the first may miss the prefix cache,
    the second is the reference); ``after``: the run after it (None: not sent, e.g. the server
    wedged). Each run: ``status`` (HTTP status or an error name), ``text``,
    ``completion_tokens`` (usage; None when the server gives none), ``finish_reason``.
    """
    if after is None or not before:
        return None, "the output canary was not run after the storm"
    ref = before[-1]
    if ref.get("status") != 200 or _empty(ref):
        return None, (f"the output canary gave no text before the storm (HTTP {ref.get('status')}): "
                      "not judged")
    if after.get("status") != 200:
        return None, f"the output canary after the storm failed ({after.get('status')}): not judged"
    if _empty(after):
        return Verdict.EMPTY_OUTPUT, (f"the greedy canary returned HTTP 200 with zero tokens after the abort storm "
                                f"(finish_reason {after.get('finish_reason')!r}); before it: "
                                f"{ref.get('completion_tokens')} tokens {_quote(ref.get('text'))}")
    if len({r.get("text") for r in before}) > 1:
        return None, "the greedy canary differed between its two runs before the storm: drift not judged"
    if after.get("text") != ref.get("text"):
        return Verdict.OUTPUT_DRIFT, (f"the greedy canary (temperature 0) changed after the abort storm: "
                                f"{_quote(ref.get('text'))} before, {_quote(after.get('text'))} after")
    return None, f"the greedy canary returned the same {ref.get('completion_tokens') or 'non-empty'}-token text"


def _quote(text: str | None, limit: int = 60) -> str:
    text = text or ""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def worst(verdicts: list[str | None]) -> str | None:
    """The worst of the storm verdicts given (``STORM_VERDICTS`` order), None when none."""
    found = [v for v in verdicts if v]
    return min(found, key=STORM_VERDICTS.index) if found else None


def lines(s: dict | None) -> list[str]:
    """Console / report.md lines: the storm, the wedge probe, the canary."""
    if not s:
        return []
    out = []
    st = s.get("storm")
    if st:
        out.append(f"abort storm: {st['sent']} streamed requests sent at once, cut together after "
                   f"{st['held_s']:g} s ({st['streamed']} had streamed a token, {st['finished']} had finished)")
    else:
        out.append("abort storm: the run's own client aborts (the server stopped draining after them)")
    w = s["wedge"]
    out.append(f"{'WEDGED' if w['verdict'] else 'ok'}: wedge probe: {w['reason']}; /health {w['health_status']}")
    state = s["canary_verdict"] or ("ok" if s.get("canary_after") and "not judged" not in s["canary_reason"]
                                    else "skipped")
    out.append(f"{state}: output canary: {s['canary_reason']}")
    return out
