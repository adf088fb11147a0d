"""Fake HTTP servers for tests: a handler base that answers in one call and logs nothing, and a
pool that serves handlers on free loopback ports and shuts them all down."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """``BaseHTTPRequestHandler`` with ``reply`` and no access log."""

    def reply(self, status: int, body: bytes | str = b"", content_type: str = "text/plain") -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


class ServerPool:
    """``start(handler) -> base URL``: serve ``handler`` on a free 127.0.0.1 port in a daemon
    thread; ``close()`` stops every server started."""

    def __init__(self) -> None:
        self._servers: list[ThreadingHTTPServer] = []

    def start(self, handler: type[BaseHTTPRequestHandler]) -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        self._servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    def close(self) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
        self._servers.clear()
