"""The engine core: a request's life (vLLM V1's ``vllm/v1/core``).

``scheduler.Scheduler`` owns every request from admission to its one free path; it alone drives
the ``KVCacheManager`` (``kv_cache_manager``: block tables, prefix hits, fork and
copy-on-write) over the ``BlockPool`` (``block_pool``: blocks, the free block queue, the
prefix-cache hash index) and the allocation ledger (``ledger``). ``sched_output`` holds the two messages of a
step (``SchedulerOutput`` to the runner, ``StepResult`` back), so that the scheduler never
imports the worker. Nothing here runs the model or samples.

The names below are loaded on first use (PEP 562), so importing one light module of this
package (``faults``, ``sequence``) does not import torch.
"""

from __future__ import annotations

from vlite.lazy import lazy_getattr

_LAZY = {
    "Scheduler": "vlite.engine.core.scheduler",
    "KVCacheManager": "vlite.engine.core.kv_cache_manager",
    "BlockPool": "vlite.engine.core.block_pool",
    "BlockLedger": "vlite.engine.core.ledger",
    "AllocationSite": "vlite.engine.core.ledger",
    "Request": "vlite.engine.core.request",
    "RequestRecord": "vlite.engine.core.request",
    "Sequence": "vlite.engine.core.sequence",
    "SequenceStatus": "vlite.engine.core.sequence",
    "FinishReason": "vlite.engine.core.sequence",
    "RequestOrigin": "vlite.engine.core.sequence",
    "ScheduledSequence": "vlite.engine.core.sched_output",
    "SchedulerOutput": "vlite.engine.core.sched_output",
    "SamplerOutput": "vlite.engine.core.sched_output",
    "ForkSamples": "vlite.engine.core.sched_output",
    "StepResult": "vlite.engine.core.sched_output",
    "StructuredOutputManager": "vlite.engine.core.structured_output",
    "FAULTS": "vlite.engine.core.faults",
    "FaultSet": "vlite.engine.core.faults",
}


__getattr__ = lazy_getattr("vlite.engine.core", globals(), _LAZY)


__all__ = sorted(_LAZY)
