"""Planted defects in a REAL vLLM, for tests/interop/vllm_zombie.sh only (never in CI, never in vlite).

Put this directory on PYTHONPATH and set ``VLITE_VLLM_PATCH``; the patch is applied when vLLM's
module is first imported, in every process (the API server and the spawned engine core), through
an import hook, so vLLM's installed files are never touched:

* ``drop-aborts``: ``EngineCore.abort_requests`` does nothing. The engine core drops every abort:
  requests whose clients left keep decoding to max_tokens (zombies), then free their blocks.
* ``leak``: ``Scheduler.finish_requests`` for aborted requests skips ``KVCacheManager.free`` (and
  ``pop_blocks_for_free``, the deferred path): a request
  aborted while it holds blocks never gives them back (a KV leak).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

PATCH = os.environ.get("VLITE_VLLM_PATCH", "")


def _drop_aborts(module) -> None:
    def abort_requests(self, request_ids):
        print(f"[vlite planted patch] EngineCore dropped abort of {list(request_ids)}", file=sys.stderr, flush=True)

    module.EngineCore.abort_requests = abort_requests


def _leak(module) -> None:
    original = module.Scheduler.finish_requests

    def finish_requests(self, request_ids, finished_status):
        if "ABORT" not in str(finished_status):
            return original(self, request_ids, finished_status)
        manager = self.kv_cache_manager
        free, pop = manager.free, manager.pop_blocks_for_free

        def keep(request):
            print(f"[vlite planted patch] blocks of {request.request_id} not freed", file=sys.stderr, flush=True)

        manager.free = keep
        manager.pop_blocks_for_free = lambda request: keep(request) or []  # the deferred-free path too
        try:
            return original(self, request_ids, finished_status)
        finally:
            manager.free, manager.pop_blocks_for_free = free, pop

    module.Scheduler.finish_requests = finish_requests


_TARGETS = {"drop-aborts": ("vllm.v1.engine.core", _drop_aborts),
            "leak": ("vllm.v1.core.sched.scheduler", _leak)}


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, apply) -> None:
        self.name, self.apply = name, apply

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def patched_exec(module):
            exec_module(module)
            self.apply(module)
            print(f"[vlite planted patch] {PATCH} applied to {fullname} (pid {os.getpid()})", file=sys.stderr,
                  flush=True)

        spec.loader.exec_module = patched_exec
        return spec


if PATCH:
    if PATCH not in _TARGETS:
        raise SystemExit(f"VLITE_VLLM_PATCH={PATCH!r}: known patches: {', '.join(_TARGETS)}")
    sys.meta_path.insert(0, _Hook(*_TARGETS[PATCH]))
