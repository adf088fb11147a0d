"""Memory of a server's whole process tree, when the server runs on this host.

vLLM runs its API server, its engine core and its workers as separate processes, so the
memory of a server is the sum over the process that listens on the URL's port and all its
descendants: RSS of each (psutil) and, on CUDA, each one's GPU memory through NVML
(``nvidia-ml-py``: ``nvmlDeviceGetComputeRunningProcesses`` on every device), with
``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` as the
fallback. A server on another host gets metrics only.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
from urllib.parse import urlparse

import psutil

MIB = 1 << 20


def is_local_url(url: str) -> bool:
    """Whether the URL's host is this machine (loopback, or one of this host's addresses)."""
    host = urlparse(url).hostname or ""
    if host in ("localhost", ""):
        return True
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = {a.address for nics in psutil.net_if_addrs().values() for a in nics}
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in local for a in addrs)


def process_roles(pid: int | None) -> dict[str, int]:
    """A server's processes by role, from its process tree (``{}`` without ``pid``): the process
    listening on the port is ``api_server``; its child that has children of its own, or else its
    only child, is the ``engine_core`` (vlite's and vLLM's engine core process, parent of the
    workers under tensor parallelism); the workers (children of the engine core, or of the API
    server when the engine runs in its thread) are ``tp_rank0``, ``tp_rank1``, ... in pid order
    (the executor spawns them in rank order). Other descendants are ``pid <N>``. Names, not a
    guarantee: a server that spawns other helpers shifts them."""
    if pid is None:
        return {}
    try:
        root = psutil.Process(pid)
        # multiprocessing's resource tracker (a child of any process that spawns) is no role of the server's
        children = sorted((c for c in root.children() if not _is_helper(c)), key=lambda c: c.pid)
        roles = {"api_server": pid}
        core = next((c for c in children if c.children()), children[0] if len(children) == 1 else None)
        workers = sorted((c for c in core.children() if not _is_helper(c)), key=lambda c: c.pid) \
            if core is not None else [c for c in children if not c.children()]
        if core is not None:
            roles["engine_core"] = core.pid
        roles.update({f"tp_rank{r}": w.pid for r, w in enumerate(workers)})
        named = set(roles.values())
        roles.update({f"pid {d.pid}": d.pid for d in root.children(recursive=True) if d.pid not in named})
        return roles
    except psutil.Error:
        return {"api_server": pid}


def _is_helper(proc: psutil.Process) -> bool:
    try:
        return any("resource_tracker" in part or "semaphore_tracker" in part for part in proc.cmdline())
    except psutil.Error:
        return False


def listening_pid(url: str) -> int | None:
    """The pid of the local process listening on the URL's TCP port, or None if not visible."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.Error, OSError):
        pass
    return None


class GpuProcessMemory:
    """Per-pid GPU memory in bytes: NVML when it loads, else nvidia-smi, else nothing.

    Args:
        nvml: an NVML module (``pynvml``) to use instead of importing it (tests pass a fake).
        smi: the nvidia-smi executable path, or None to look it up on PATH.
    """

    def __init__(self, nvml=None, smi: str | None = None) -> None:
        self.source: str | None = None
        self._nvml = None
        self._handles: list = []
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py
            nvml.nvmlInit()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            self._nvml, self.source = nvml, "nvml"
        except Exception:  # noqa: BLE001 - no binding, no driver or no device: try the CLI
            self._smi = smi or shutil.which("nvidia-smi")
            if self._smi and self._smi_query() is not None:
                self.source = "nvidia-smi"

    def _smi_query(self) -> dict[int, int] | None:
        try:
            out = subprocess.run([self._smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        usage: dict[int, int] = {}
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 2 and parts[0].isdigit():
                try:
                    usage[int(parts[0])] = usage.get(int(parts[0]), 0) + int(float(parts[1]) * MIB)
                except ValueError:
                    continue
        return usage

    def by_pid(self) -> dict[int, int]:
        """GPU bytes used by each compute process (all devices summed); {} without a GPU."""
        if self.source == "nvml":
            usage: dict[int, int] = {}
            for h in self._handles:
                for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(h):
                    usage[p.pid] = usage.get(p.pid, 0) + int(p.usedGpuMemory or 0)
            return usage
        if self.source == "nvidia-smi":
            return self._smi_query() or {}
        return {}


class ProcessTreeProbe:
    """RSS (bytes) of a process and all its descendants, and their GPU memory (bytes).

    ``read()`` returns ``rss_bytes`` (the tree's sum), ``num_processes`` and, with a GPU,
    ``gpu_process_bytes`` (the tree's sum). Descendants are looked up at every read: vLLM starts
    its workers after the API server.

    Args:
        pid: the root process.
        gpu: a ``GpuProcessMemory`` (default: one built here).
    """

    def __init__(self, pid: int, gpu: GpuProcessMemory | None = None) -> None:
        self.root = psutil.Process(pid)
        self.gpu = gpu if gpu is not None else GpuProcessMemory()
        self.gpu_source = self.gpu.source
        self.note = None if self.gpu.source else "no GPU found: process RSS of the server's process tree only"
        self.last_tree: list[dict] = []

    def tree(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def read(self) -> dict:
        procs, rows, total = self.tree(), [], 0
        for p in procs:
            try:
                rss = p.memory_info().rss
                rows.append({"pid": p.pid, "name": p.name(), "rss_bytes": rss})
                total += rss
            except psutil.Error:
                continue
        row: dict = {"rss_bytes": total if rows else None, "num_processes": len(rows)}
        if self.gpu.source:
            gpu = self.gpu.by_pid()
            for r in rows:
                r["gpu_bytes"] = gpu.get(r["pid"], 0)
            row["gpu_process_bytes"] = sum(r["gpu_bytes"] for r in rows)
        self.last_tree = rows
        return row
