"""The worker: everything that holds the model (vLLM V1's ``vllm/v1/worker`` and executors).

``executor_factory.create_executor`` picks an executor (in-process ``UniProcExecutor``, or
tensor-parallel ranks in processes or Ray actors, each a ``worker.Worker``); each rank's
``model_runner.ModelRunner`` packs a step, runs the model (``models/``, loaded by ``loader``,
decode replayed from ``cuda_graphs``) and samples (``sampler``, ``logits_processors``),
including the first token of every sample a request with n > 1 is about to fork.

The names below are loaded on first use (PEP 562): importing ``loader`` for its light names
does not import torch.
"""

from __future__ import annotations

from vlite.lazy import lazy_getattr

_LAZY = {
    "Executor": "vlite.engine.worker.executor",
    "UniProcExecutor": "vlite.engine.worker.executor",
    "MultiprocExecutor": "vlite.engine.worker.executor",
    "WorkerFailedError": "vlite.engine.worker.executor",
    "ExecutorStartupError": "vlite.engine.worker.executor",
    "create_executor": "vlite.engine.worker.executor_factory",
    "RayExecutor": "vlite.engine.worker.ray_executor",
    "Worker": "vlite.engine.worker.worker",
    "ModelRunner": "vlite.engine.worker.model_runner",
    "sample": "vlite.engine.worker.sampler",
    "load_checkpoint": "vlite.engine.worker.loader",
    "resolve_model": "vlite.engine.worker.loader",
}


__getattr__ = lazy_getattr("vlite.engine.worker", globals(), _LAZY)


__all__ = sorted(_LAZY)
