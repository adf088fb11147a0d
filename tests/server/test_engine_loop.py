"""EngineLoop without a model: a fake engine and a list transport drive the one serving loop
(the same code the engine thread and the engine core process run)."""

from __future__ import annotations

from vlite.engine import CompletionOutput, EngineRequest, RequestOrigin, RequestOutput, SamplingParams, census
from vlite.engine.config import CacheConfig, SchedulerConfig
from vlite.engine.core.scheduler import Scheduler
from vlite.engine.outputs import RequestMetrics
from vlite.engine.serving.engine_loop import EngineLoop, TransportClosed


class FakeEngine:
    """Adds requests, emits one token per step and finishes after ``length`` tokens; its idle
    scheduler is what the loop's census walks besides it."""

    def __init__(self, length: int = 2, reject: str | None = None) -> None:
        self.length, self.reject = length, reject
        self.scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), num_blocks=4)
        self.live: dict[str, int] = {}
        self.aborted: list[str] = []
        self.dead_error = None

    def add_request(self, prompt, params, *, prompt_token_ids=None, request_id=None, origin=None) -> str:
        if request_id == self.reject:
            raise ValueError(f"request {request_id} rejected")
        self.live[request_id] = 0
        return request_id

    def add_requests(self, requests) -> list[str]:  # all or none, as LLMEngine.add_requests
        added = []
        try:
            for r in requests:
                added.append(self.add_request(r.prompt, r.sampling_params, request_id=r.request_id, origin=r.origin))
        except Exception:
            for rid in added:
                self.abort(rid)
            raise
        return added

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return self.live.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] >= self.length
            if done:
                del self.live[rid]
            outs.append(RequestOutput(rid, "p", [1], [CompletionOutput(0, "x" * self.live.get(rid, self.length),
                                                                       [7], "length" if done else None)],
                                      done, RequestOrigin(rid), RequestMetrics(0.0)))
        return outs

    def stats(self) -> str:
        return f"{len(self.live)} live"


class ListTransport:
    """Hands the loop one list of commands per iteration and keeps every event batch."""

    def __init__(self, *batches: list) -> None:
        self.batches = list(batches)
        self.sent: list[tuple[list, str]] = []

    def receive(self, timeout: float) -> list:
        if not self.batches:
            raise TransportClosed
        return self.batches.pop(0)

    def send(self, events: list, stats) -> None:
        if events:
            self.sent.append((events, stats()))

    def events(self) -> list[tuple]:
        return [ev for batch, _ in self.sent for ev in batch]


def _req(rid: str) -> EngineRequest:
    return EngineRequest("p", SamplingParams(max_tokens=2), RequestOrigin(rid))


def test_the_loop_adds_steps_to_the_end_and_sends_stats_after_the_events():
    transport = ListTransport([("add", (1, [_req("a")]))], [], [("stop", None)])
    loop = EngineLoop(FakeEngine(length=2), transport)
    loop.run()
    events = transport.events()
    assert events[0] == ("added", 1, None)
    outs = [ev[1] for ev in events if ev[0] == "out"]
    assert [o.finished for o in outs] == [False, True] and all(ev[2] for ev in events if ev[0] == "out")
    assert transport.sent[-1][1] == "0 live" and loop.num_live == 0


def test_a_rejected_request_undoes_the_whole_add_and_reports_its_error():
    engine = FakeEngine(reject="b")
    transport = ListTransport([("add", (1, [_req("a"), _req("b")]))])
    EngineLoop(engine, transport).run()
    (added,) = [ev for ev in transport.events() if ev[0] == "added"]
    assert isinstance(added[2], ValueError) and "rejected" in str(added[2])
    assert engine.aborted == ["a"] and engine.live == {}
    # the one already added is freed by the engine, without an output (the client got the error)
    assert [ev for ev in transport.events() if ev[0] == "out"] == []


def test_an_abort_ends_the_request_with_a_final_abort_output_once():
    engine = FakeEngine(length=50)
    transport = ListTransport([("add", (1, [_req("a")]))], [("abort", ["a"]), ("abort", ["a"])], [("stop", None)])
    loop = EngineLoop(engine, transport)
    loop.run()
    finals = [ev[1] for ev in transport.events() if ev[0] == "out" and ev[1].finished]
    assert len(finals) == 1 and finals[0].outputs[0].finish_reason == "abort"
    assert engine.aborted == ["a"] and loop.num_live == 0


def test_stop_aborts_what_is_in_flight_and_refuses_what_raced_with_it():
    engine = FakeEngine(length=50)
    transport = ListTransport([("add", (1, [_req("a")]))], [("stop", None)], [("add", (2, [_req("b")])),
                                                                              ("call", (3, "stats"))])
    EngineLoop(engine, transport).run()
    events = transport.events()
    assert ("a" in engine.aborted) and "b" not in engine.live
    refused = [ev for ev in events if ev[0] in ("added", "result") and ev[1] in (2, 3)]
    assert len(refused) == 2 and all("stopped" in str(ev[-1]) for ev in refused)


def test_a_query_by_name_and_a_failing_one_answer_their_callers():
    transport = ListTransport([("call", (1, "stats")), ("call", (2, "no-such-query"))])
    EngineLoop(FakeEngine(), transport).run()
    results = {ev[1]: ev for ev in transport.events() if ev[0] == "result"}
    assert results[1][2] == "0 live" and results[1][3] is None
    assert isinstance(results[2][3], KeyError)


def test_the_census_walks_the_engine_at_its_idle_point(monkeypatch):
    monkeypatch.setattr(census, "CENSUS_QUIET_S", 0.0)
    monkeypatch.setattr(census, "CENSUS_INTERVAL_S", 0.0)
    transport = ListTransport([("add", (1, [_req("a")]))], [], [], [])
    loop = EngineLoop(FakeEngine(length=1), transport)
    loop.run()
    assert ("census",) in transport.events()
    doc = loop.census_document()
    assert doc["taken_at"] is not None and not doc["pending"]
    # the one holder of the ended id is this test's transport, which keeps every event it was sent
    assert doc["held"] and all(h["path"].startswith("async_engine.transport.sent") for h in doc["held"])
