"""The in-process client ends a wave whose engine never goes idle, whether the stuck request keeps
re-emitting its finished output (a beam search whose pruned beams were never finished) or
sequences no client waits for keep making tokens (zombies): the replay returns, with a note,
instead of stepping forever."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vlite.diagnostics.targets.inprocess import InProcessClient
from vlite.diagnostics.workload.sources import RequestSpec

STALL_STEPS = 40
STEP_CAP = 5_000  # a replay that needs more than this has hung: the fake engine raises


class _NeverIdleEngine:
    """Finishes each request at its first step in the client's view, but never lets the first one go:
    ``has_unfinished_requests`` stays True, and it re-emits that request's finished output
    (``reemit``) and/or makes a token per step (``tokens_per_step``)."""

    tokenizer = None

    def __init__(self, *, reemit: bool, tokens_per_step: int) -> None:
        self.reemit, self.tokens_per_step = reemit, tokens_per_step
        self.new: list[str] = []
        self.stuck: str | None = None
        self.num_steps = self.generation_tokens_total = 0

    def add_request(self, prompt, params, request_id, origin=None) -> None:
        self.new.append(request_id)
        self.stuck = self.stuck or request_id

    def abort(self, request_id: str) -> None:
        pass  # the stuck request ignores aborts too

    def has_unfinished_requests(self) -> bool:
        return self.stuck is not None

    def step(self):
        self.num_steps += 1
        if self.num_steps > STEP_CAP:
            raise RuntimeError("the replay never ended a wave whose engine never goes idle")
        self.generation_tokens_total += self.tokens_per_step
        done = [SimpleNamespace(request_id=r, finished=True, error=None,
                                outputs=[SimpleNamespace(token_ids=[1], finish_reason="length")]) for r in self.new]
        again = []
        if self.reemit and self.stuck not in self.new:
            again = [SimpleNamespace(request_id=self.stuck, finished=True, error=None,
                                     outputs=[SimpleNamespace(token_ids=[1], finish_reason="length")])]
        self.new = []
        return done + again


class _View:
    def __init__(self, engine: _NeverIdleEngine) -> None:
        self.engine = engine
        self.step = 0

    def stats(self):
        return SimpleNamespace(generation_tokens_total=self.engine.generation_tokens_total, num_running=1,
                               num_waiting=0, num_free_blocks=0, num_total_blocks=4)

    def request_tokens(self, request_id: str) -> int:
        return 0

    def request_progress(self, request_id: str):
        return None


@pytest.mark.parametrize(("reemit", "tokens_per_step", "note"), [
    (True, 0, "steps with no request in flight"),
    (False, 1, "(still making tokens)"),
], ids=["finished-output-re-emitted", "zombie-keeps-making-tokens"])
def test_a_wave_whose_engine_never_goes_idle_ends(reemit, tokens_per_step, note):
    engine = _NeverIdleEngine(reemit=reemit, tokens_per_step=tokens_per_step)
    client = InProcessClient(engine, lambda: (0, None), stall_steps=STALL_STEPS, view=_View(engine))
    specs = [RequestSpec(f"r{i}", 0.0, "hello", 2, 4) for i in range(3)]
    out = client.replay(specs, max_concurrency=4, idle_every=1)
    assert [r.outcome for r in out.requests] == ["finished"] * 3
    assert len(out.idle_points) == 4  # the baseline and one per wave: each stuck wave was ended
    assert any(note in n for n in out.notes), out.notes
    assert engine.num_steps <= 4 * STALL_STEPS + 10  # two stuck waves, the last one's drain, a step each
