"""The API server's request-id census: the engine's census (``vlite.engine.census``) run over
what the API server process holds per request.

With the engine core in its own process (the default), the engine loop's census walks only the
core's objects. The API server keeps per-request state of its own: the async client's maps
(``_groups``, ``_pending``, ``_adding``), the request streams, the handlers' and the metrics'
bookkeeping (``ServerMetrics._last_token_time``), the middleware, and the module- and
class-level containers of ``vlite.entrypoints`` and ``vlite.engine.serving``. This census walks
them, with the same walker, for the ids of the requests that ended in the async client's view
(``_AsyncClient.ended``: final outputs, refused adds, the loop's end).

It runs on the event loop at the API server's own idle points: no HTTP request in flight but
the observers' (``/metrics``, ``/health``, ``/version``, ``/debug/*``;
``ServerState.requests_in_flight``) and none ended for ``CENSUS_QUIET_S``, requests ended since
the last census, and at most once every ``CENSUS_INTERVAL_S``. What the async client's maps hold
does not matter: an ended request left in ``_groups`` must not keep the census from ever
running again. A census due for ``CENSUS_OVERDUE_INTERVALS`` intervals while no HTTP request
started, but kept from its idle point (an HTTP request that never ends), is overdue: exported
with what blocks it (``IdleCensus.overdue``). A request arriving meanwhile waits for the walk (ms;
docs/benchmarks.md, "Request-id census: cost per idle point", has the cost).

Its containers are named ``api_server.<path>`` (``api_server.client._groups``,
``api_server.vlite.entrypoints.serving_completion._SEEN``); the engine's keep their names
(``engine.<path>``, ``async_engine.<path>``, ``vlite.<module>.<name>``). With the engine loop in a
thread of this process the two walks are split, so nothing is walked or counted twice: this one
does not enter the engine and its in-process core client (``AsyncLLMEngine.census_skip``), and
the loop's leaves ``API_SERVER_MODULES`` to this one.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from vlite.engine import (
    API_SERVER_MODULES,
    CensusResult,
    EndedRequests,
    IdleCensus,
    module_roots,
    request_census,
)

PATH_PREFIX = "api_server."
CENSUS_POLL_S = 0.2  # how often the event loop looks for an idle point (a few attribute reads)


class _ServerView(Protocol):
    """What the census reads of the server's state (``state.ServerState``, which holds the census)."""

    status: str
    engine: Any  # the async client (``_AsyncClient``: ended, census_skip()) or None
    requests_in_flight: int
    last_request_start: float  # time.monotonic() when the last counted HTTP request started
    last_request_end: float  # ... and when one last ended


class ApiServerCensus:
    """The request-id census of the API server process, run at its idle points.

    Args:
        state: the server's state (``state.engine``, the async client, is set once the model is
            loaded; before that there is nothing to walk).
        app: the ASGI app (its routes and middleware stack are walked).

    The bookkeeping (when one is due, the last result, its cost) is an ``IdleCensus`` over the
    async client's ``EndedRequests``; ``held_counts()`` and ``pending`` feed ``/metrics``,
    ``document()`` feeds ``/debug/census``.
    """

    def __init__(self, state: _ServerView, app: object) -> None:
        self.state = state
        self.app = app
        self._census: IdleCensus | None = None

    @property
    def census(self) -> IdleCensus | None:
        """The ``IdleCensus`` over the loaded async client's ended requests (None before the load)."""
        client = self.state.engine
        if client is None:
            return None
        if self._census is None or self._census.ended is not client.ended:
            self._census = IdleCensus("api_server", client.ended)
        return self._census

    @property
    def pending(self) -> int:
        """Requests that ended in the async client's view since the last census (0: it is current)."""
        census = self.census
        return 0 if census is None else census.pending

    def blockers(self) -> dict[str, int]:
        """What keeps the API server from an idle point now: HTTP requests in flight (not the
        observers'), by the name of the counter (``requests_in_flight``); empty: none."""
        n = self.state.requests_in_flight
        return {"requests_in_flight": n} if n else {}

    def idle(self) -> bool:
        """True at an idle point: the server is ready and no HTTP request but an observer's
        (``/metrics``, ``/debug/*``, ...) is being served; the async client's maps are not asked."""
        return self.state.engine is not None and self.state.status == "ready" and not self.blockers()

    def maybe_run(self) -> bool:
        """Run the census if this is an idle point and one is due (``IdleCensus.tick``: requests
        ended since the last one, ``CENSUS_INTERVAL_S`` passed, no HTTP request for
        ``CENSUS_QUIET_S``), or mark it overdue; True if it ran. A failing walk is logged, never raised."""
        census = self.census
        if census is None or self.state.status != "ready":
            return False
        runs = census.runs
        census.tick(self.blockers, self.state.last_request_end, self.state.last_request_start, self._walk)
        return census.runs > runs

    def run(self) -> CensusResult | None:
        """Walk now (whatever the server is doing) and keep the result (None if the walk failed).

        Raises:
            RuntimeError: the model is not loaded yet (no async client).
        """
        census = self.census
        if census is None:
            raise RuntimeError("the API server census needs the loaded engine's async client")
        return census.run(self._walk)

    def _walk(self, ended: set[str], skip: list[object]) -> CensusResult:
        """Roots: the async client (``api_server.client``), the server state (``api_server.state``),
        the app (``api_server.app``) and the module- and class-level containers of
        ``API_SERVER_MODULES`` (``api_server.<module>.<name>``). Not entered: ``skip``, this object
        and what the engine's census walks (``client.census_skip()``)."""
        client = self.state.engine
        roots: dict[str, object] = {f"{PATH_PREFIX}client": client, f"{PATH_PREFIX}state": self.state,
                                    f"{PATH_PREFIX}app": self.app}
        roots.update({PATH_PREFIX + name: value for name, value in module_roots(API_SERVER_MODULES).items()})
        return request_census(roots, ended, skip=[*skip, self, *client.census_skip()])

    @property
    def overdue(self) -> dict | None:
        """None, or ``{"seconds", "blocked_by"}`` while this census is overdue (``IdleCensus.overdue``)."""
        census = self.census
        return None if census is None else census.overdue

    def held_counts(self) -> dict[str, int]:
        """Container path -> ended requests it held at the last census (empty: none held)."""
        census = self.census
        return {} if census is None else census.held_counts

    def document(self) -> dict:
        """The last census for ``/debug/census`` (``IdleCensus.document``, process "api_server")."""
        census = self.census
        return census.document() if census is not None else IdleCensus("api_server", EndedRequests()).document()

    async def serve(self, poll_s: float = CENSUS_POLL_S) -> None:
        """Look for an idle point every ``poll_s`` s and run the census there, until cancelled."""
        while True:
            await asyncio.sleep(poll_s)
            self.maybe_run()
