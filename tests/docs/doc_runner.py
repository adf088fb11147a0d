"""Run documented commands as a reader would, in a scratch directory, on the tiny test model.

One ``BlockSession`` per code block: its commands run in order in a shell, sharing background
servers, environment and a port map (each port the block names is swapped for a free one, so a
doc's ``8000`` never clashes with anything on the machine). Where a command would load the default
model, ``--model`` names the tiny test model instead.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from doc_commands import DocCommand

BIN = Path(sys.executable).parent
COMMAND_TIMEOUT_S = 900.0
SERVER_READY_TIMEOUT_S = 300.0
_PORT = re.compile(r"(?<=localhost:)(\d{4,5})|(?<=127\.0\.0\.1:)(\d{4,5})|(?<=--port )(\d{4,5})|(?<=--port=)(\d{4,5})")
# vlite subcommands that load a model in this process (or start a server that does)
_MODEL_LOADERS = ("generate", "serve", "bench")
_REMOTE_LEAK_CHECK = ("url", "blackbox", "watch", "prometheus", "log", "fleet")
_REMOTE_FLAGS = ("--url", "--prometheus", "--from-log")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_model(text: str, model: str) -> str:
    """``text`` with ``--model MODEL`` added to each ``vlite`` command that would load the default model."""
    def add(segment: str) -> str:
        try:
            words = shlex.split(segment)
        except ValueError:
            return segment
        if not words or Path(words[0]).name != "vlite" or len(words) < 2:
            return segment
        if "--model" in words:  # a placeholder such as ./my-model: the reader's own model, here the tiny one
            at = words.index("--model") + 1
            if at < len(words) and not Path(words[at]).exists() and words[at].startswith(("./", "MODEL")):
                words[at] = model
                return shlex.join(words)
            return segment
        sub = words[1]
        if sub == "leak-check":
            rest = words[2:]
            if (rest and rest[0] in _REMOTE_LEAK_CHECK) or any(f in rest for f in _REMOTE_FLAGS):
                return segment
            at = 3 if rest and rest[0] in ("replay", "scenario") else 2
        elif sub in _MODEL_LOADERS:
            at = 3 if sub == "bench" else 2
        else:
            return segment
        words[at:at] = ["--model", model]
        return shlex.join(words)

    tail = " &" if text.rstrip().endswith("&") and not text.rstrip().endswith("&&") else ""
    body = text.rstrip()[:-1].rstrip() if tail else text
    return " | ".join(add(part.strip()) for part in body.split(" | ")) + tail


@dataclass
class Outcome:
    command: DocCommand
    ran: str
    exit_code: int
    output: str
    seconds: float


class BlockSession:
    """The shell state of one code block: environment, background servers and the port map."""

    def __init__(self, workdir: Path, model: str, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.model = model
        self.env = dict(env, PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(BIN.parent))
        self.ports: dict[str, str] = {}
        self.background: list[tuple[subprocess.Popen, object, str]] = []

    def _ports(self, text: str) -> str:
        def swap(m: re.Match) -> str:
            port = m.group(0)
            return self.ports.setdefault(port, str(free_port()))
        return _PORT.sub(swap, text)

    def prepare(self, cmd: DocCommand) -> str:
        """The command as this session runs it: free ports, the tiny model."""
        # the reader's .venv is this one: named by its real path, as its own scripts' shebangs name it
        # (through the scratch directory's link, Python's sys.prefix would be the link, and the C++
        # kernels, cached per venv path, would build again: minutes)
        text = re.sub(r"(?<![\w./-])\.venv/bin/", f"{BIN}/", cmd.text)
        if re.match(r"(\S*/)?vlite serve\b", text) and "--port" not in text:  # the default port, made explicit
            text = re.sub(r"vlite serve\b", "vlite serve --port 8000", text, count=1)
        return with_model(self._ports(text), self.model)

    def run(self, cmd: DocCommand) -> Outcome:
        """Run ``cmd``; a background command starts its server and waits until it answers /health."""
        text = self.prepare(cmd)
        t0 = time.monotonic()
        if text.startswith("source ") and text.endswith("/activate"):
            return Outcome(cmd, text, 0, "", 0.0)  # PATH already leads to the venv
        m = re.fullmatch(r"kill %(\d+)", text)
        if m:
            return self._kill(cmd, int(m.group(1)) - 1, text)
        if cmd.background:
            return self._start(cmd, text[:-1].rstrip(), t0)
        if re.match(r"(\S*/)?vlite serve\b", text):  # a server in the foreground runs until stopped: start, check, stop
            out = self._start(cmd, text, t0)
            self._kill(cmd, len(self.background) - 1, text)
            return out
        proc = subprocess.run(["bash", "-c", text], cwd=self.workdir, env=self.env, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
        return Outcome(cmd, text, proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0)

    def _start(self, cmd: DocCommand, text: str, t0: float) -> Outcome:
        log_path = self.workdir / f"bg-{len(self.background)}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        proc = subprocess.Popen(["bash", "-c", f"exec {text}"], cwd=self.workdir, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.background.append((proc, log, text))
        port = re.search(r"--port[ =](\d+)", text)
        if port and "serve" in text:
            url = f"http://127.0.0.1:{port.group(1)}/health"
            deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        code = 0 if proc.poll() is None else proc.returncode
        return Outcome(cmd, text + " &", code, log_path.read_text(errors="replace")[-4000:], time.monotonic() - t0)

    def _kill(self, cmd: DocCommand, index: int, text: str) -> Outcome:
        if index >= len(self.background):
            return Outcome(cmd, text, 1, f"no background job %{index + 1}", 0.0)
        proc = self.background[index][0]
        _stop(proc)
        return Outcome(cmd, text, 0, "", 0.0)

    def close(self) -> None:
        for proc, log, _ in self.background:
            _stop(proc)
            log.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
