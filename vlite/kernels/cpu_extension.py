"""vlite's C++ CPU extension, built on first use: the paged decode kernel
(``cpu_paged_attention.cpp``), the fused elementwise ops (``cpu_fused_ops.cpp``) and the
packed-weight GEMM of the linear layers (``cpu_gemm.cpp``), greedy sampling's argmax
(``cpu_sampling.cpp``) and the loop over a model's decoder layers that calls them (``cpu_decoder.cpp``).

torch's ``cpp_extension`` compiles the sources with the machine's own vector instructions
(``-march=native``) into torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); the first build took 68-131 s on the machines measured (``BUILD_TIME``;
the packed GEMM is most of it) and minutes more on a busy one; later processes load it in
well under a second. The log says how long this machine's build took. The build needs a C++ compiler and ninja (a dependency of vlite). When it
cannot be built, ``load()`` logs why once and returns None, and every caller falls back to its
torch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger("vlite.kernels")

_DIR = Path(__file__).parent
# Resolved: a copy of the package whose C++ files link to a checkout's (the mutation check's
# patched copies) builds under that checkout's name and paths, so it loads that build.
SOURCES = [(_DIR / name).resolve() for name in ("cpu_bindings.cpp", "cpu_paged_attention.cpp", "cpu_fused_ops.cpp",
                                                "cpu_gemm.cpp", "cpu_sampling.cpp", "cpu_decoder.cpp")]
HEADERS = [(_DIR / name).resolve() for name in ("cpu_amx.h", "cpu_ops.h", "cpu_prefetch.h", "cpu_vec.h")]
_SOURCE_DIR = SOURCES[0].parent
# What the build-time range in the notice rests on: the first builds measured for the README ("first
# engine start"), and one on a 2-core EPYC that other tenants kept at load average 5-10.
BUILD_TIME = ("68-131 s where measured (68-75 s on a 2-vCPU Intel Xeon, 131 s on a 2-core AMD EPYC), about 4 min "
              "on a 2-core EPYC that other work kept busy")
_lock = threading.Lock()
_state: dict = {}


def _cpu_tag() -> str:
    """Short hash of the CPU's model and flags: a build made with -march=native on one machine
    is never loaded on another (a shared home directory would otherwise do that)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor(), platform.machine()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:10]


def load():
    """The compiled module (``paged_decode``, ``rms_norm``, ``fused_add_rms_norm``,
    ``silu_and_mul``, ``rotary_store``, ``packed_gemm_supported``, ``pack_linear_weight``,
    ``packed_linear``, ``argmax_rows``, the class ``CpuDecoderLayers``), or None when it cannot
    be built here."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def loaded():
    """The module if ``load()`` already built or loaded it, else None (never builds)."""
    return _state.get("module")


def _build():
    # the sources', their folder's and the Python environment's hash in the name: the build
    # command holds the venv's torch paths and the sources' include path, so two checkouts (or
    # venvs) sharing one cache each keep their own build instead of rebuilding over each other
    digest = hashlib.sha256(sys.prefix.encode())
    digest.update(str(_SOURCE_DIR).encode())
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    name = f"vlite_cpu_ops_{_cpu_tag()}_{digest.hexdigest()[:8]}"
    try:
        from torch.utils.cpp_extension import load as load_extension

        building = not _already_built(name)
        if building:  # a first start would otherwise look like a slow model load
            logger.warning("building the C++ CPU kernels, once per machine and venv: %s ...", BUILD_TIME)
        t0 = time.monotonic()
        with _venv_ninja_first(), build_lock(_build_directory(name)):
            module = load_extension(name=name, sources=[str(p) for p in SOURCES],
                                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                    extra_include_paths=[str(_SOURCE_DIR)], verbose=False)
        elapsed = time.monotonic() - t0
        build_dir = _build_directory(name)
        if build_dir is not None:
            record_venv(build_dir)
            if building:  # rare, and the user is already waiting: tidy the cache now
                removed = prune_builds_of_deleted_venvs(build_dir.parent)
                if removed:
                    logger.warning("removed %d C++ kernel builds of deleted venvs from %s", len(removed),
                                   build_dir.parent)
        if building or elapsed > 5.0:  # a build (or a wait for another process's) the user sat through
            logger.warning("the C++ CPU kernels were ready after %.0f s on this machine (%d CPUs, load average "
                           "%.1f)", elapsed, os.cpu_count() or 0, os.getloadavg()[0])
        return module
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch path still works
        logger.warning("the C++ CPU kernels could not be built (%s: %s); using the torch path",
                       type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


@contextlib.contextmanager
def _venv_ninja_first():
    """Run torch's ``ninja`` (looked up on PATH) as the venv's own ninja for the build.

    Why: with the venv activated PATH finds its ninja (1.13 here), without it the system's (1.11);
    each reads the other's ``.ninja_log`` as stale and rebuilds the kernels (30 s) without a word.
    Pinning one ninja per venv makes the cached build valid from either shell.
    """
    venv_bin = Path(sys.prefix) / "bin"
    if not (venv_bin / "ninja").exists():
        yield
        return
    old_path = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([str(venv_bin), old_path]) if old_path else str(venv_bin)
    try:
        yield
    finally:
        if old_path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old_path


BUILD_LOCK_WAIT_S = 900.0  # another process's build of the same kernels (BUILD_TIME: up to minutes)


@contextlib.contextmanager
def build_lock(build_dir: Path | None, wait_s: float = BUILD_LOCK_WAIT_S):
    """Hold an advisory lock (``fcntl.flock`` on ``build_dir/vlite-build.lock``) around a build,
    and clear torch's own ``lock`` file there when it is stale.

    Why: torch's ``FileBaton`` is a plain file; a build killed mid-way (Ctrl-C, OOM, a CI timeout)
    leaves it behind and every later start waits on it forever. The kernel drops a flock when its
    process dies, so whoever holds this lock knows that no vlite build is running and that a
    ``lock`` file left there is stale.

    Raises:
        TimeoutError: another process held the lock for more than ``wait_s`` seconds.
    """
    if build_dir is None:
        yield
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "vlite-build.lock", "a") as f:
        deadline = time.monotonic() + wait_s
        announced = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building the C++ CPU kernels in {build_dir} "
                                       f"for more than {wait_s:g} s") from None
                if not announced:
                    logger.warning("waiting for another process's build of the C++ CPU kernels (%s)", build_dir)
                    announced = True
                time.sleep(0.2)
        try:
            baton = build_dir / "lock"
            if baton.exists():
                logger.warning("removing a stale build lock left by a killed build: %s", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_directory(name: str) -> Path | None:
    """torch's build directory for extension ``name`` (None if its private helper moved)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, False))
    except Exception:
        return None


def _already_built(name: str) -> bool:
    """Whether torch's extension cache holds a build of ``name`` (it rebuilds by itself if a
    source changed; this only decides whether to announce a build)."""
    build_dir = _build_directory(name)
    return True if build_dir is None else (build_dir / f"{name}.so").exists()  # None: only the notice is lost


VENV_MARKER = "vlite-venv.txt"


def record_venv(build_dir: Path) -> None:
    """Write the Python environment (``sys.prefix``) a build belongs to into ``build_dir``, so a
    later build can tell which builds belong to venvs that no longer exist."""
    marker = build_dir / VENV_MARKER
    try:
        if not marker.exists() or marker.read_text().strip() != sys.prefix:
            marker.write_text(sys.prefix + "\n")
    except OSError:  # a read-only cache: the build still loads, only the pruning is lost
        pass


def prune_builds_of_deleted_venvs(cache_dir: Path) -> list[Path]:
    """Remove ``vlite_cpu_ops_*`` builds in ``cache_dir`` whose venv (its ``VENV_MARKER``) is gone.

    Why: each venv gets its own build (the name hashes ``sys.prefix``), so every deleted checkout or
    ``make clean`` left one behind (tens of MB each). Builds without a marker (made before it
    existed) and builds whose lock another process holds are left alone.

    Returns:
        The directories removed.
    """
    import shutil

    removed = []
    for build_dir in sorted(cache_dir.glob("vlite_cpu_ops_*")):
        marker = build_dir / VENV_MARKER
        try:
            prefix = Path(marker.read_text().strip())
        except OSError:
            continue
        if not prefix.parts or prefix.exists():
            continue
        with open(build_dir / "vlite-build.lock", "a") as lock_file:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # someone is building or loading it right now
                continue
            shutil.rmtree(build_dir, ignore_errors=True)
        removed.append(build_dir)
    return removed
