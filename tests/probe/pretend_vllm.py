"""A pretend vLLM for the probe's tests: vLLM's gauges (always idle), the completions and
Responses API routes, and a Responses store that keeps every response when ``PRETEND_STORE=1``
(as vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE=1``, vllm#48275). The probe starts in it from the
environment (``VLITE_PROBE=1``), as the ``.pth`` hook starts it; it serves prometheus_client's
default registry on ``/metrics``, where the probe puts its series.

Run: ``python pretend_vllm.py PORT``.
"""

import json
import os
import sys
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import prometheus_client
import vlite_probe
from prometheus_client import Gauge

for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
    Gauge(name, name).set(0)


class ResponsesServing:
    """Where the pretend server keeps its responses (vLLM's OpenAIServingResponses)."""

    def __init__(self, store: bool) -> None:
        self.enable_store = store
        self.response_store: dict = {}

    def create(self, body: dict) -> dict:
        rid = f"resp_{uuid.uuid4().hex}"
        response = {"id": rid, "object": "response", "status": "incomplete",
                    "incomplete_details": {"reason": "max_output_tokens"},
                    "output": [{"type": "message", "content": [{"type": "output_text", "text": "a b c"}]}],
                    "usage": {"output_tokens": 3}}
        if self.enable_store and body.get("store", True):
            self.response_store[rid] = response
        return response


SERVING = ResponsesServing(os.environ.get("PRETEND_STORE") == "1")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        if self.path == "/metrics":
            self._send(200, prometheus_client.generate_latest(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": "pretend", "max_model_len": 2048}]}).encode())
        else:
            self._send(200, b"{}")

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/v1/responses":
            response = SERVING.create(body)
            if not body.get("stream"):
                return self._send(200, json.dumps(response).encode())
            events = [{"type": "response.output_text.delta", "delta": w} for w in ("a", " b", " c")]
            events.append({"type": "response.incomplete", "response": response})
            return self._stream(events)
        choice = {"text": "a b c", "finish_reason": "length", "index": 0}
        if not body.get("stream"):
            return self._send(200, json.dumps({"id": f"cmpl-{uuid.uuid4().hex}", "choices": [choice],
                                               "usage": {"completion_tokens": 3}}).encode())
        chunks = [{"choices": [{"text": w, "index": 0, "finish_reason": None}]} for w in ("a", " b")]
        chunks.append({"choices": [{"text": " c", "index": 0, "finish_reason": "length"}]})
        self._stream(chunks, done=True)

    def _stream(self, events: list, done: bool = False) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for e in events:
                self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
                self.wfile.flush()
            if done:
                self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            pass


if __name__ == "__main__":
    vlite_probe.start()  # what the .pth hook does at start-up; nothing unless VLITE_PROBE=1
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
