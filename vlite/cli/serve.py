"""``vlite serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn) on the paged engine.

Flags follow ``vllm serve``. The socket is bound first and the model loads in the
background (routes answer 503 until it is ready). SIGINT/SIGTERM: stop taking requests,
abort those in flight (their blocks go back to the free list), exit 0; during the model load
they stop the load too (the engine core process is killed) and exit 0 at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import typer
import uvicorn

from vlite.cli import common
from vlite.engine import EngineArgs, log_thread_report
from vlite.entrypoints import access_log
from vlite.entrypoints.access_log import DEFAULT_EXCLUDED
from vlite.entrypoints.header_timeout import DEFAULT_HEADER_READ_TIMEOUT_S
from vlite.entrypoints.state import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BODY_BYTES, ServerState

DEFAULT_LIMIT_CONCURRENCY = 1024

ServedNameOpt = typer.Option(None, "--served-model-name", help="Name(s) clients use in 'model' (default: the model's).")



UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _check_log_level(value: str) -> str:
    if value not in UVICORN_LOG_LEVELS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(UVICORN_LOG_LEVELS)}")
    return value

@common.engine_args_options(include_faults=True)
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to bind."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="VLITE_API_KEY",
                                       help="Require 'Authorization: Bearer KEY' on every route but /health."),
    served_model_name: list[str] = ServedNameOpt,
    engine_args: EngineArgs = None,
    log_stats: bool = typer.Option(False, "--log-stats", help="Log throughput, queue and KV-cache stats."),
    log_stats_interval: float = typer.Option(10.0, "--log-stats-interval", min=0.1,
                                             help="Seconds between --log-stats lines."),
    enable_debug_endpoints: bool = typer.Option(False, "--enable-debug-endpoints",
                                                help="Serve GET /debug/blocks (block manager state), GET "
                                                     "/debug/census (request-id censuses) and /debug/gpu_allocations "
                                                     "(live CUDA allocations by Python stack, once POST "
                                                     "/debug/gpu_allocations/start began recording)."),
    max_request_body_bytes: int = typer.Option(DEFAULT_MAX_REQUEST_BODY_BYTES, "--max-request-body-bytes", min=1,
                                               help="Larger request bodies get 413."),
    max_n: int = typer.Option(DEFAULT_MAX_N, "--max-n", min=1,
                              help="Most choices one request may ask for: n, best_of, and prompts x n (400 beyond)."),
    header_read_timeout: float = typer.Option(DEFAULT_HEADER_READ_TIMEOUT_S, "--header-read-timeout", min=0.1,
                                              help="Seconds a connection has to send a complete request head "
                                                   "(at open and after each response); then it is closed."),
    limit_concurrency: int = typer.Option(DEFAULT_LIMIT_CONCURRENCY, "--limit-concurrency", min=1,
                                          help="Most open connections/requests; beyond it new requests get 503 "
                                               "(uvicorn's limit_concurrency)."),
    timeout_keep_alive: float = typer.Option(5.0, "--timeout-keep-alive", min=0.1,
                                             help="Seconds an idle keep-alive connection stays open."),
    frontend_multiprocessing: bool = typer.Option(
        True, "--frontend-multiprocessing/--disable-frontend-multiprocessing",
        help="Run the engine loop in an engine core process of its own (the default, vLLM V1's design), or "
             "in a thread of the API server's process (docs/benchmarks.md has both measured)."),
    uvicorn_log_level: str = typer.Option("info", "--uvicorn-log-level", callback=_check_log_level,
                                          help=f"uvicorn's log level ({', '.join(UVICORN_LOG_LEVELS)})."),
    disable_access_log_for_endpoints: str = typer.Option(
        DEFAULT_EXCLUDED, "--disable-access-log-for-endpoints",
        help="Comma-separated paths whose access-log lines are left out (vLLM's flag and syntax, matched on "
             "the path without its query). vlite's default leaves out the pollers' /health and /metrics (a "
             "leak check scrapes /metrics every 100 ms); '' logs every path, as vLLM does by default."),
    disable_uvicorn_access_log: bool = typer.Option(False, "--disable-uvicorn-access-log",
                                                    help="No access-log line at all (vLLM's flag)."),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API."""
    from vlite.engine import DEFAULT_MODEL_ALIASES, LLMEngine, ModelNotFoundError, check_engine_config
    from vlite.entrypoints.api_server import create_app
    from vlite.entrypoints.header_timeout import with_header_timeout
    from vlite.entrypoints.state import ServerSettings

    config = common.create_engine_config(engine_args)
    faults, model = config.inject_faults, config.model
    if not Path(model).exists() and model.lower() not in DEFAULT_MODEL_ALIASES:
        common.fail(f"model {model!r} is neither a local directory or .gguf file nor the default model "
                    f"{common.DEFAULT_MODEL}")
    try:  # before binding: a bad device, dtype or tensor-parallel size is one line and exit 2
        check_engine_config(config)
    except (ModelNotFoundError, ValueError) as exc:
        common.fail(str(exc))
    try:
        excluded_paths = access_log.parse_paths(disable_access_log_for_endpoints)
    except ValueError as exc:
        common.fail(str(exc))
    _check_can_listen(host, port)
    settings = ServerSettings(api_key=api_key or None, served_model_names=tuple(served_model_name or ()),
                              enable_debug_endpoints=enable_debug_endpoints,
                              max_request_body_bytes=max_request_body_bytes, log_stats=log_stats,
                              log_stats_interval=log_stats_interval, max_n=max_n)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    log_thread_report(logging.getLogger("vlite.server"))  # threads, wait policy, CPUs; warns when oversubscribed
    if faults:
        logging.getLogger("vlite.server").warning("planted faults enabled: %s", ", ".join(faults))

    exit_code = 0

    def on_fatal(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    if frontend_multiprocessing:  # the engine core in its own process (vlite.engine.serving.engine_core)
        app = create_app(settings, None, on_fatal=on_fatal, core_config=config)
    else:
        app = create_app(settings, lambda: LLMEngine(config), on_fatal=on_fatal)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level,
                                    timeout_graceful_shutdown=10, http=with_header_timeout(header_read_timeout),
                                    limit_concurrency=limit_concurrency, timeout_keep_alive=timeout_keep_alive,
                                    access_log=not disable_uvicorn_access_log),
                     app.state.server)
    access_log.install(excluded_paths)  # after uvicorn.Config, which configures its loggers
    server.run()
    if not server.started and exit_code == 0:
        exit_code = 1  # e.g. the port was taken (uvicorn logged why)
    if app.state.server.load_abandoned:
        # Ctrl-C during the model load: the in-process load goes on in a daemon thread; exit now
        # rather than let the interpreter's shutdown meet it halfway through torch.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    sys.exit(exit_code)


def _check_can_listen(host: str, port: int) -> None:
    """Fail (exit 2) before the model loads if ``host:port`` cannot be bound (a port in use, an
    address not on this machine). uvicorn binds only after the engine has started."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        common.fail(f"cannot listen on {host}:{port}: {exc}")
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(address)
        except OSError as exc:
            common.fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port")


class _Server(uvicorn.Server):
    """uvicorn.Server that, on SIGINT/SIGTERM, first aborts the requests in flight.

    uvicorn waits for open connections before shutting down; aborting first ends every stream
    at once. The signal is not re-raised after shutdown (uvicorn's default), so a clean stop
    exits 0. A second SIGINT forces the exit.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
        self.state.begin_shutdown()
