"""The paged inference engine: scheduler, block manager, model runner (vLLM's design)."""

from vlite.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from vlite.engine.sampling_params import SamplingParams
from vlite.engine.sequence import FinishReason, RequestOrigin, SequenceStatus

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "FinishReason",
    "ParallelConfig",
    "RequestOrigin",
    "SamplingParams",
    "SchedulerConfig",
    "SequenceStatus",
]
