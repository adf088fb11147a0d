"""A black-box server connection: ``connect`` (wait until the server is ready, scrape
``/metrics`` once, pick its adapter), ``Connection`` (one scrape through the adapter) and the
async ``BlackboxDriver`` that sends requests, waits for idle and sends 1-token probes. The
black-box, watch and zombie targets all read a server through these.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from vlite.diagnostics.readers.adapters import Adapter, MetricsReading, UnknownServerError, detect_kind
from vlite.diagnostics.readers.metrics_text import MetricsFormatError, parse_page
from vlite.diagnostics.targets.base import TargetError
from vlite.diagnostics.targets.control import checked, failed
from vlite.diagnostics.targets.openai_client import send_request, wait_ready
from vlite.diagnostics.workload.replay import RequestResult
from vlite.diagnostics.workload.sources import RequestSpec

IDLE_SCRAPES = 3  # consecutive idle scrapes that make an idle point
SCRAPE_PERIOD_S = 0.1
_REPLAY_TIMEOUT_S = 600.0


class NullProbe:
    """The memory probe of a server whose process cannot be seen: no columns."""

    gpu_source = None
    note = None
    last_tree: list = []

    def read(self) -> dict:
        return {}


@dataclass
class Connection:
    """A reachable server: base URL, its adapter, headers (auth) and body fields (model)."""

    base: str
    adapter: Adapter
    headers: dict
    body: dict
    client: httpx.Client
    metrics_path: str = "/metrics"

    def extra(self) -> dict:
        """The adapter's JSON pages besides /metrics (llama.cpp's /slots); a page that fails is left out."""
        out = {}
        for path in self.adapter.extra_paths:
            try:
                r = self.client.get(f"{self.base}{path}", headers=self.headers, timeout=10)
                if r.status_code == 200:
                    out[path] = r.json()
            except (httpx.HTTPError, ValueError):
                pass
        return out

    def metrics_text(self) -> str:
        """The ``/metrics`` page as text ("" when the scrape fails: a count of its series is then empty)."""
        try:
            return self.client.get(f"{self.base}{self.metrics_path}", headers=self.headers, timeout=10).text
        except httpx.HTTPError:
            return ""

    def state(self) -> MetricsReading:
        """Scrape ``/metrics`` once and map it through the adapter.

        Raises:
            TargetError: the scrape fails or the page no longer parses.
        """
        try:
            r = self.client.get(f"{self.base}{self.metrics_path}", headers=self.headers, timeout=10)
            r.raise_for_status()
            return self.adapter.read(parse_page(r.text), self.extra())
        except (httpx.HTTPError, MetricsFormatError, KeyError) as exc:
            raise TargetError(f"{self.base}/metrics: {type(exc).__name__}: {exc}") from exc


def connect(url: str, server_kind: str = "auto", api_key: str | None = None, ready_timeout_s: float = 120.0
            ) -> Connection:
    """Wait for the server, scrape ``/metrics`` once and pick its adapter.

    Raises:
        TargetError: nothing answers, ``/metrics`` needs a key (401/403), is missing, is not
            Prometheus text, or matches no known server (each with a one-line message).
    """
    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(timeout=10.0)
    wait_ready(base, client, timeout_s=ready_timeout_s)
    try:
        r = client.get(f"{base}/metrics", headers=headers)
    except httpx.HTTPError as exc:
        raise TargetError(f"{base}/metrics: {type(exc).__name__}: {exc}") from exc
    if r.status_code in (401, 403):
        hint = "the --api-key was refused" if api_key else "pass the server's key with --api-key"
        raise TargetError(f"{base}/metrics answered HTTP {r.status_code} ({r.reason_phrase}): {hint}")
    if r.status_code != 200:
        raise TargetError(f"{base}/metrics answered HTTP {r.status_code}: the server exports no Prometheus "
                          "metrics there (SGLang needs --enable-metrics, llama.cpp --metrics)")
    metrics_path = "/metrics"
    if "json" in r.headers.get("content-type", ""):  # trtllm-serve: JSON iteration stats at /metrics
        alt = client.get(f"{base}/prometheus/metrics", headers=headers)
        if alt.status_code == 200:
            r, metrics_path = alt, "/prometheus/metrics"
    try:
        page = parse_page(r.text)
        adapter = detect_kind(page, server_kind)
        probe = Connection(base, adapter, headers, {}, client, metrics_path)
        adapter.read(page, probe.extra())
    except MetricsFormatError as exc:
        raise TargetError(f"{base}/metrics is not a Prometheus page: {exc}") from exc
    except (UnknownServerError, ValueError, KeyError) as exc:
        raise TargetError(str(exc)) from exc
    body = {}
    try:  # the served model's name, for servers that require "model" in the body
        models = client.get(f"{base}/v1/models", headers=headers).json().get("data") or []
        if models and models[0].get("id"):
            body["model"] = models[0]["id"]
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return Connection(base, adapter, headers, body, client, metrics_path)


class BlackboxDriver:
    """Sends requests, waits for idle and probes against one connection (async): the black-box
    target's waves and bisection, and the zombie check's early leavers.

    Args:
        conn: the server.
        memory: the server's memory probe (``process.ProcessTreeProbe``, or ``NullProbe``).
        max_concurrency: the most requests ``send`` has in flight.
        drain_timeout_s: the longest ``wait_idle`` waits for running == waiting == 0.
    """

    def __init__(self, conn: Connection, memory, max_concurrency: int, drain_timeout_s: float) -> None:
        self.conn, self.memory = conn, memory
        self.max_concurrency = max_concurrency
        self.drain_timeout_s = drain_timeout_s
        self.probes: list[dict] = []
        self.errors: list[dict] = []  # control requests that got a 5xx or lost their connection (findings)
        self._probe_no = 0
        self.wave_timeout_s = max(30.0, 2 * drain_timeout_s)  # a wave's requests must end by then

    async def read(self, client: httpx.AsyncClient) -> MetricsReading:
        """One scrape of ``/metrics`` (and the adapter's JSON pages) through the adapter."""
        r = await client.get(f"{self.conn.base}{self.conn.metrics_path}", headers=self.conn.headers)
        r.raise_for_status()
        extra = {}
        for path in self.conn.adapter.extra_paths:  # llama.cpp's /slots
            try:
                e = await client.get(f"{self.conn.base}{path}", headers=self.conn.headers)
                if e.status_code == 200:
                    extra[path] = e.json()
            except (httpx.HTTPError, ValueError):
                pass
        return self.conn.adapter.read(parse_page(r.text), extra)

    async def wait_idle(self, client: httpx.AsyncClient, timeout_s: float | None = None) -> MetricsReading | None:
        """The state once running == waiting == 0 for IDLE_SCRAPES scrapes in a row; None on timeout."""
        deadline, quiet = time.monotonic() + (timeout_s or self.drain_timeout_s), 0
        while time.monotonic() < deadline:
            try:
                state = await self.read(client)
            except (httpx.HTTPError, MetricsFormatError, KeyError) as exc:
                failed(f"GET {self.conn.metrics_path} (drain polling)", exc, self.errors)
                state, quiet = None, 0
            if state is not None and state.idle:
                quiet += 1
                if quiet >= IDLE_SCRAPES:
                    return state
            else:
                quiet = 0
            await asyncio.sleep(SCRAPE_PERIOD_S)
        return None

    async def send(self, specs: list[RequestSpec], results: dict[str, RequestResult],
                   timeout_s: float = _REPLAY_TIMEOUT_S) -> bool:
        """Send ``specs`` (up to max_concurrency at once); False when they did not all end within
        ``timeout_s`` (the rest are cancelled: their connections close, an abort to the server)."""
        sem = asyncio.Semaphore(self.max_concurrency)
        max_model_len = None
        if any(s.extra_prompts for s in specs):  # sizes the over-long prompt of a multi-prompt request
            from vlite.diagnostics.targets.http import server_max_model_len

            max_model_len = await asyncio.to_thread(server_max_model_len, self.conn.base, self.conn.client,
                                                    self.conn.headers)

        async def launch(spec: RequestSpec) -> None:
            async with sem:
                await send_request(self.conn.base, spec, results[spec.request_id], self.conn.headers, self.conn.body,
                                   max_model_len=max_model_len)

        try:
            await asyncio.wait_for(asyncio.gather(*(launch(s) for s in specs)), max(0.1, timeout_s))
            return True
        except TimeoutError:
            return False

    async def probe(self, client: httpx.AsyncClient, wave: str, before: MetricsReading | None = None
                    ) -> MetricsReading | None:
        """A 1-token request (forces an engine step), then idle again; the state after it."""
        before = before or await self.wait_idle(client)
        if before is None:
            return None
        self._probe_no += 1
        rid = f"vlite-probe-{self._probe_no}-{int(time.time() * 1000) % 10**8}"
        body = {"prompt": "probe", "max_tokens": 1, "temperature": 0.0, **self.conn.body}
        status: int | str
        try:
            r = await client.post(f"{self.conn.base}/v1/completions", json=body,
                                  headers={"X-Request-Id": rid, **self.conn.headers},
                                  timeout=min(60.0, self.drain_timeout_s))
            status = r.status_code
            checked(r)
        except httpx.HTTPError as exc:
            status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else type(exc).__name__
            failed(f"POST /v1/completions (1-token probe {rid})", exc, self.errors)
        after = await self.wait_idle(client)
        self.probes.append({"time": time.time(), "after": wave, "request_id": rid, "status": status,
                            "kv_used_before": before.kv_used, "kv_used_after": after.kv_used if after else None})
        return after

    async def idle_point(self, client: httpx.AsyncClient, wave: str) -> MetricsReading | None:
        """Drain, probe, and return the confirmed idle state (None: never drained in time)."""
        idle = await self.wait_idle(client)
        if idle is None:
            return None
        return await self.probe(client, wave, idle)
