"""A small forwarding proxy that DROPS client aborts (test only): the router hop of the fleet
check's ZOMBIE proof.

It forwards every request round-robin to its upstreams. When the client of a streamed completion
leaves, a real router (vllm-router 0.1.17, measured: docs/benchmarks.md) closes its upstream
connection, which is the abort the replica sees. This proxy instead reads the upstream response
on to its end (``--drop-aborts``), so the replica decodes to ``max_tokens`` for nobody: the
defect of Dynamo PR #14507. Without ``--drop-aborts`` it passes the abort on (the control).

    python tests/interop/drop_abort_proxy.py --port 8200 --drop-aborts \
        --upstream http://127.0.0.1:8101 --upstream http://127.0.0.1:8102

Standard library and httpx only; threads, one per connection.
"""

from __future__ import annotations

import argparse
import itertools
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def make_handler(upstreams: list[str], drop_aborts: bool) -> type[BaseHTTPRequestHandler]:
    """A handler class forwarding to ``upstreams`` in turn; ``drop_aborts``: keep reading the
    upstream response after the client left instead of closing it."""
    turn = itertools.cycle(upstreams)
    lock = threading.Lock()

    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends where the connection closes: no framing to fake
        dropped = 0  # aborts this proxy kept from its upstreams (class-wide)

        def log_message(self, *args) -> None:
            pass

        def _forward(self, method: str) -> None:
            with lock:
                base = next(turn)
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
                with client.stream(method, f"{base}{self.path}", content=body, headers=headers) as resp:
                    self.send_response(resp.status_code)
                    for k, v in resp.headers.items():
                        if k.lower() not in _HOP_HEADERS:
                            self.send_header(k, v)
                    self.end_headers()
                    client_gone = False
                    for chunk in resp.iter_raw():
                        if client_gone:
                            continue  # dropping the abort: the upstream decodes on for nobody
                        try:
                            self.wfile.write(chunk)
                            self.wfile.flush()
                        except OSError:
                            if not drop_aborts:
                                return  # closing the upstream stream: the abort passed on
                            client_gone = True
                            with lock:
                                Proxy.dropped += 1

        def do_GET(self) -> None:
            self._forward("GET")

        def do_POST(self) -> None:
            self._forward("POST")

    return Proxy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", action="append", required=True, help="a replica's base URL (repeat)")
    ap.add_argument("--drop-aborts", action="store_true", help="read upstream responses to their end after the client left")
    a = ap.parse_args()
    srv = ThreadingHTTPServer((a.host, a.port), make_handler([u.rstrip("/") for u in a.upstream], a.drop_aborts))
    print(f"proxy on {a.host}:{a.port} -> {', '.join(a.upstream)} ({'dropping' if a.drop_aborts else 'passing'} aborts)",
          flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
