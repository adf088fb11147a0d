"""uvicorn's h11 protocol with a header-read timeout.

uvicorn closes a keep-alive connection that stays idle for ``timeout_keep_alive`` seconds, but
a connection that has sent *part* of a request head (slowloris) is never timed out: it holds a
socket and a slot of ``--limit-concurrency`` forever. Here a connection must deliver a complete
request head within ``header_read_timeout`` seconds of opening, and again within that time of
the end of each response; otherwise it is closed (as nginx's ``client_header_timeout``).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_READ_TIMEOUT_S = 10.0


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request head is not complete within
    ``header_read_timeout`` seconds (set by ``with_header_timeout``)."""

    header_read_timeout: float = DEFAULT_HEADER_READ_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_read_timeout, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        waiting_for_head = self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
        if waiting_for_head and not self.transport.is_closing():
            self.logger.info("closing a connection that sent no complete request head within %.1f s",
                             self.header_read_timeout)
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``, timing out heads after ``seconds``.

    Raises:
        ValueError: ``seconds`` not > 0.
    """
    if not seconds > 0:
        raise ValueError(f"the header read timeout must be > 0 seconds, got {seconds}")
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_read_timeout": float(seconds)})
