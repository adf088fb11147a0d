"""Builds of the C++ CPU kernels whose venv was deleted are removed; others are kept."""

import fcntl
import sys

from vlite.kernels import cpu_extension


def _build(cache, name, prefix):
    d = cache / name
    d.mkdir()
    (d / f"{name}.so").write_bytes(b"\0" * 16)
    if prefix is not None:
        (d / cpu_extension.VENV_MARKER).write_text(str(prefix) + "\n")
    return d


def test_prunes_only_builds_of_deleted_venvs(tmp_path):
    cache = tmp_path / "torch_extensions"
    cache.mkdir()
    live_venv = tmp_path / "venv-live"
    live_venv.mkdir()
    dead = _build(cache, "vlite_cpu_ops_aa_11111111", tmp_path / "venv-deleted")
    live = _build(cache, "vlite_cpu_ops_aa_22222222", live_venv)
    unmarked = _build(cache, "vlite_cpu_ops_aa_33333333", None)
    other = _build(cache, "someone_elses_ext", tmp_path / "venv-deleted")

    removed = cpu_extension.prune_builds_of_deleted_venvs(cache)

    assert removed == [dead]
    assert not dead.exists()
    assert live.exists() and unmarked.exists() and other.exists()


def test_keeps_a_build_whose_lock_is_held(tmp_path):
    cache = tmp_path / "torch_extensions"
    cache.mkdir()
    dead = _build(cache, "vlite_cpu_ops_aa_11111111", tmp_path / "venv-deleted")
    with open(dead / "vlite-build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert cpu_extension.prune_builds_of_deleted_venvs(cache) == []
    assert dead.exists()
    assert cpu_extension.prune_builds_of_deleted_venvs(cache) == [dead]


def test_record_venv_writes_this_prefix(tmp_path):
    cpu_extension.record_venv(tmp_path)
    assert (tmp_path / cpu_extension.VENV_MARKER).read_text().strip() == sys.prefix
