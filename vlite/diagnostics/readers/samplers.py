"""Background samplers: block-manager stats, process RSS, and GPU memory.

One ``Sampler`` thread reads a block-stats source (the in-process engine, or a server's
``/metrics``) and a ``MemoryProbe`` every interval and keeps the rows; ``frame()`` returns
them as a pandas DataFrame (one row per sample, ``t_s`` seconds since the start).

GPU memory comes from NVML (nvidia-ml-py) for the device and the process, and from
torch.cuda for the in-process allocator; ``nvidia-smi --query-gpu=memory.used`` is the
fallback where the NVML binding is missing. Without a GPU the probe says so once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pandas as pd
import psutil

logger = logging.getLogger("vlite.diagnostics")

BLOCK_COLUMNS = ("num_total_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks",
                 "num_running", "num_waiting")


def view_block_stats(view) -> Callable[[], dict]:
    """A source reading an ``EngineView``'s ``stats()`` (block counts in blocks, requests in requests)."""

    def read() -> dict:
        s = view.stats()
        return {"num_total_blocks": s.num_total_blocks, "num_free_blocks": s.num_free_blocks,
                "num_used_blocks": s.num_used_blocks, "num_cached_blocks": s.num_cached_blocks,
                "num_running": s.num_running, "num_waiting": s.num_waiting,
                "num_block_tables": s.blocks.num_block_tables, "num_live_requests": s.num_live_requests}
    return read


class MemoryProbe:
    """RSS of one process and its tensor-parallel workers (bytes, psutil) and GPU memory (bytes)
    where there is a GPU.

    ``read()`` gives ``rss_bytes`` (the process plus its workers), and with workers also
    ``worker_rss_bytes`` (theirs alone) and ``num_processes``; ``gpu_process_bytes`` sums the
    GPU memory NVML reports for all of those PIDs.

    Args:
        pid: the process to measure (default: this one); None measures no RSS.
        in_process_cuda: also read torch.cuda allocated/reserved (the engine runs here).
        worker_pids: the engine's worker processes (``EngineView.info().worker_pids``).
        include_children: also count every descendant of ``pid`` as a worker, looked up at each
            read (a ``vlite serve`` process, whose tensor-parallel workers are its children).
    """

    def __init__(self, pid: int | None = os.getpid(), in_process_cuda: bool = False,
                 worker_pids: tuple[int, ...] | list[int] = (), include_children: bool = False) -> None:
        self.process = psutil.Process(pid) if pid is not None else None
        self.workers = [psutil.Process(p) for p in worker_pids if psutil.pid_exists(p)]
        self.include_children = include_children
        self.gpu_source: str | None = None
        self.note: str | None = None
        self._nvml = self._handle = None
        self._torch_cuda = False
        self._init_gpu(in_process_cuda)

    def _init_gpu(self, in_process_cuda: bool) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
            self.gpu_source = "nvml"
        except Exception:  # noqa: BLE001 - no binding, no driver, or no device: try the CLI next
            if shutil.which("nvidia-smi") and self._smi_used() is not None:
                self.gpu_source = "nvidia-smi"
        if in_process_cuda:
            import torch

            self._torch_cuda = torch.cuda.is_available()
        if self.gpu_source is None and not self._torch_cuda:
            self.note = "no GPU found: sampling block stats and process RSS only"

    @staticmethod
    def _smi_used() -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5, check=True).stdout
            return int(out.split()[0]) * (1 << 20)  # MiB -> bytes
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def _worker_processes(self) -> list[psutil.Process]:
        workers = list(self.workers)
        if self.include_children and self.process is not None:
            try:
                known = {w.pid for w in workers}
                workers += [c for c in self.process.children(recursive=True) if c.pid not in known]
            except psutil.Error:
                pass
        return workers

    def read(self) -> dict:
        row: dict = {}
        workers = self._worker_processes()
        pids = set()
        if self.process is not None:
            try:
                row["rss_bytes"] = self.process.memory_info().rss
                pids.add(self.process.pid)
            except psutil.Error:
                row["rss_bytes"] = None
        if workers:
            worker_rss = 0
            for w in workers:
                try:
                    worker_rss += w.memory_info().rss
                    pids.add(w.pid)
                except psutil.Error:  # a worker that exited counts no more
                    continue
            row["worker_rss_bytes"] = worker_rss
            row["num_processes"] = len(pids)
            if row.get("rss_bytes") is not None:
                row["rss_bytes"] += worker_rss
        if self.gpu_source == "nvml":
            nv = self._nvml
            row["gpu_used_bytes"] = nv.nvmlDeviceGetMemoryInfo(self._handle).used
            if self.process is not None:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(self._handle)
                row["gpu_process_bytes"] = sum(p.usedGpuMemory or 0 for p in procs if p.pid in pids)
        elif self.gpu_source == "nvidia-smi":
            row["gpu_used_bytes"] = self._smi_used()
        if self._torch_cuda:
            import torch

            row["torch_allocated_bytes"] = torch.cuda.memory_allocated()
            row["torch_reserved_bytes"] = torch.cuda.memory_reserved()
        return row


class Sampler:
    """Samples ``block_source()`` and ``memory.read()`` every ``interval_s`` seconds in a daemon thread.

    A failing read (e.g. a server that is briefly unreachable) is counted in ``errors`` and skipped.
    """

    def __init__(self, block_source: Callable[[], dict], memory: MemoryProbe, interval_s: float = 0.1) -> None:
        if interval_s <= 0:
            raise ValueError(f"sample interval must be > 0 s, got {interval_s}")
        self.block_source, self.memory, self.interval_s = block_source, memory, interval_s
        self.rows: list[dict] = []
        self.errors = 0
        self.t0 = time.time()
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlite-leak-sampler", daemon=True)

    def sample(self) -> dict | None:
        """Take one sample now (also used for the final drained snapshot)."""
        try:
            row = {"time": time.time(), **self.block_source(), **self.memory.read()}
        except Exception as exc:  # noqa: BLE001 - keep sampling through transient failures
            self.errors += 1
            logger.debug("sample failed: %s", exc)
            return None
        row["t_s"] = row["time"] - self.t0
        self.rows.append(row)
        return row

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._paused.is_set():
                self.sample()
            self._stop.wait(self.interval_s)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No samples inside the block. A scrape is work for the server: while a probe inside it
        waits for an idle moment, ten scrapes a second would keep it from ever seeing one."""
        self._paused.set()
        try:
            yield
        finally:
            self._paused.clear()

    def start(self) -> Sampler:
        self.t0 = time.time()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def frame(self) -> pd.DataFrame:
        """All samples as a DataFrame (columns: time, t_s, block counts, memory in bytes)."""
        df = pd.DataFrame(self.rows)
        if not df.empty:
            df = df.sort_values("time").reset_index(drop=True)
            first = ["t_s", "time", *[c for c in BLOCK_COLUMNS if c in df.columns]]
            df = df[first + [c for c in df.columns if c not in first]]
        return df
