"""The probe's census walk: containers named by owner, request ids counted in keys, elements and
``request_id`` attributes, caps read, budgets kept, and no code of the host run."""

from __future__ import annotations

import asyncio
import collections
import gc
import sys
import threading
import types

import pytest
from vlite_probe import walk


class _Serving:
    def __init__(self):
        self.response_store: dict = {}
        self.recent = collections.deque(maxlen=4)
        self.requests: list = []
        self.vocab = {f"tok{i}": i for i in range(50)}


class _Request:
    def __init__(self, rid):
        self.request_id = rid


class _Trap:
    """Every hook the host could run raises: the walk must read around them."""

    def __getattribute__(self, name):
        raise AssertionError(f"the walk ran the host's __getattribute__ ({name})")

    def __iter__(self):
        raise AssertionError("the walk ran the host's __iter__")


class _TrapDict(dict):
    def keys(self):
        raise AssertionError("the walk ran the host's keys()")

    def __iter__(self):
        raise AssertionError("the walk ran the host's __iter__")

    def __len__(self):
        raise AssertionError("the walk ran the host's __len__")


SERVING = f"{_Serving.__module__}._Serving"  # how the walk names an attribute of a _Serving
# Inside a whole test session the process holds far more than a server would: a budget that the
# walk never reaches, so that what these tests check does not depend on what ran before them.
BUDGET, MAX_OBJECTS = 60.0, 10**7


@pytest.fixture
def host_module():
    """A module of a pretend server, with its state as module globals."""
    mod = types.ModuleType("pretend_server")
    serving = _Serving()
    for i in range(30):
        serving.response_store[f"resp_{i:012x}"] = {"output": "x"}
        serving.recent.append(f"chatcmpl-{i:012x}")
        serving.requests.append(_Request(f"cmpl-{i:012x}-0"))
    mod.serving = serving
    mod.TRAP = _Trap()
    mod.TRAPS = _TrapDict({f"cmpl-{i:010d}": 1 for i in range(7)})
    sys.modules["pretend_server"] = mod
    yield mod
    del sys.modules["pretend_server"]


def test_containers_are_named_by_owner_and_count_request_ids(host_module):
    c = walk.census(budget_s=BUDGET, max_objects=MAX_OBJECTS)
    top = c.top()
    assert top[SERVING + ".response_store"] == {"ids": 30, "entries": 30, "maxlen": None,
                                                                    "instances": 1}
    assert top[SERVING + ".requests"]["ids"] == 30  # objects whose request_id is one
    assert top[SERVING + ".recent"] == {"ids": 4, "entries": 4, "maxlen": 4, "instances": 1}
    assert top["pretend_server.TRAPS"]["ids"] == 7  # a dict subclass read through dict's own C methods
    assert SERVING + ".vocab" not in top  # no request id in it
    assert not c.truncated and c.objects > 0


def test_derived_and_foreign_ids(host_module):
    host_module.serving.response_store["not-an-id"] = 1
    host_module.extra = {"chatcmpl-abcdef123456-1": 1, "resp-ab1": 1, "msg_0123456789": 2, 12: "vlite-abc123def",
                         "batch_size": 8, "msg_template": "{x}", "cmpl-lc-00012-0": 3}
    top = walk.census(budget_s=BUDGET, max_objects=MAX_OBJECTS).top()
    # derived ids (vLLM's from a client's X-Request-Id too), msg_, and an id as a value; not too
    # short an id, nor a name without a digit
    assert top["pretend_server.extra"]["ids"] == 4
    assert top[SERVING + ".response_store"]["entries"] == 31


def test_a_custom_pattern_and_budgets(host_module):
    host_module.mine = {"job-000001": 1, "job-000002": 2}
    assert walk.census(r"job-\d+", budget_s=BUDGET, max_objects=MAX_OBJECTS).top() == {"pretend_server.mine": {"ids": 2, "entries": 2, "maxlen": None,
                                                                     "instances": 1}}
    assert walk.census(max_objects=3).truncated
    assert walk.census(budget_s=0.0).truncated


def test_the_walk_never_lists_every_object(host_module, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("gc.get_objects/get_referrers hand out objects still being built")

    monkeypatch.setattr(gc, "get_objects", refuse)
    monkeypatch.setattr(gc, "get_referrers", refuse)
    assert walk.census(budget_s=BUDGET, max_objects=MAX_OBJECTS).top()[SERVING + ".response_store"]["ids"] == 30


def test_an_asyncio_tasks_locals_are_walked_from_another_thread():
    class Handler:
        def __init__(self):
            self.pending = {f"chatcmpl-{i:010d}": i for i in range(3)}

    async def handle():
        handler = Handler()  # noqa: F841 - held in the suspended coroutine's frame
        await asyncio.sleep(10)

    async def main():
        task = asyncio.ensure_future(handle())
        await asyncio.sleep(0.05)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("c", walk.census(budget_s=BUDGET, max_objects=MAX_OBJECTS)))
        t.start()
        await asyncio.get_running_loop().run_in_executor(None, t.join)
        task.cancel()
        return out["c"]

    top = asyncio.run(main()).top()
    name = next(k for k in top if k.endswith("Handler.pending"))
    assert top[name]["ids"] == 3


def test_state_reached_only_through_a_threads_target_a_closure_or_a_partial():
    import functools

    class EngineCore:  # reached only as the owner of its socket thread's target (as vLLM's)
        def __init__(self):
            self.aborted_requests = {f"cmpl-lc-{i:05d}-0": i for i in range(6)}
            self.stop = threading.Event()

        def loop(self):
            self.stop.wait(10)

    core = EngineCore()
    thread = threading.Thread(target=core.loop, name="input-socket")
    thread.start()
    kept = {f"chatcmpl-{i:08d}": i for i in range(4)}

    def on_done():  # a callback holding state in its closure
        return kept

    holder = types.ModuleType("pretend_callbacks")
    holder.hooks = [on_done, functools.partial(print, {"resp_0123456789": 1})]
    sys.modules["pretend_callbacks"] = holder
    try:
        top = walk.census(budget_s=BUDGET, max_objects=MAX_OBJECTS).top()
    finally:
        core.stop.set()
        thread.join()
        del sys.modules["pretend_callbacks"]
    assert top[f"{EngineCore.__module__}.{EngineCore.__qualname__}.aborted_requests"]["ids"] == 6
    assert top["pretend_callbacks.hooks[]"]["ids"] == 5  # the closure's dict (4) and the partial's (1)
