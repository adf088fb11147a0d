"""The paged inference engine: scheduler, block manager, model runner (vLLM's design).

Code outside ``vlite/engine`` (the CLI, the OpenAI server, the diagnostics, the benchmarks)
imports engine names from here only. Names whose modules load torch or transformers
(``LLMEngine``, ``AsyncLLMEngine``, ``EngineView``, ...) are imported on first use (PEP 562
``__getattr__``), so ``import vlite.engine`` and ``vlite --help`` stay fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlite.engine.arg_utils import EngineArgs
from vlite.engine.census import (
    API_SERVER_MODULES,
    CensusResult,
    EndedRequests,
    IdleCensus,
    module_roots,
    request_census,
)
from vlite.engine.config import (
    DEFAULT_MODEL,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
)
from vlite.engine.core.faults import FAULTS, FaultSet
from vlite.engine.core.sequence import FinishReason, RequestOrigin, SequenceStatus
from vlite.engine.metrics import BlockStats, EngineStats
from vlite.engine.outputs import CompletionOutput, RequestOutput
from vlite.engine.protocol import EngineClient
from vlite.engine.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_ABS_LENGTH_PENALTY,
    MAX_ABS_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from vlite.engine.worker import cuda_alloc_sites
from vlite.engine.worker.cpu_threads import apply_openmp_defaults, log_thread_report, thread_report
from vlite.engine.worker.loader import DEFAULT_MODEL_ALIASES, ModelNotFoundError, load_checkpoint, resolve_model
from vlite.lazy import lazy_getattr

if TYPE_CHECKING:
    from vlite.engine.introspection import (
        ASYNC_REGISTRIES,
        HISTORIES,
        REGISTRIES,
        EngineInfo,
        EngineView,
        blocks_document,
        view_dict,
    )
    from vlite.engine.llm_engine import LLMEngine, RequestRejectedError, check_engine_config, derive_max_model_len
    from vlite.engine.serving import (
        AsyncEngineClient,
        AsyncLLMEngine,
        EngineCoreStartError,
        EngineNotRunningError,
        EngineRequest,
        MPAsyncLLMEngine,
        RequestStreamGroup,
    )

# Public name -> the module that defines it, imported on first access (these load torch).
_LAZY = {
    "LLMEngine": "vlite.engine.llm_engine",
    "RequestRejectedError": "vlite.engine.llm_engine",
    "check_engine_config": "vlite.engine.llm_engine",
    "derive_max_model_len": "vlite.engine.llm_engine",
    "AsyncEngineClient": "vlite.engine.serving",
    "AsyncLLMEngine": "vlite.engine.serving",
    "EngineNotRunningError": "vlite.engine.serving",
    "EngineRequest": "vlite.engine.serving",
    "RequestStreamGroup": "vlite.engine.serving",
    "MPAsyncLLMEngine": "vlite.engine.serving",
    "EngineCoreStartError": "vlite.engine.serving",
    "EngineView": "vlite.engine.introspection",
    "EngineInfo": "vlite.engine.introspection",
    "REGISTRIES": "vlite.engine.introspection",
    "ASYNC_REGISTRIES": "vlite.engine.introspection",
    "HISTORIES": "vlite.engine.introspection",
    "blocks_document": "vlite.engine.introspection",
    "view_dict": "vlite.engine.introspection",
}


__getattr__ = lazy_getattr("vlite.engine", globals(), _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "apply_openmp_defaults",
    "log_thread_report",
    "thread_report",
    "API_SERVER_MODULES",
    "ASYNC_REGISTRIES",
    "AsyncEngineClient",
    "AsyncLLMEngine",
    "BlockStats",
    "CacheConfig",
    "CensusResult",
    "CompletionOutput",
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_ALIASES",
    "DISTRIBUTED_EXECUTOR_BACKENDS",
    "EndedRequests",
    "EngineArgs",
    "EngineClient",
    "EngineConfig",
    "EngineCoreStartError",
    "EngineNotRunningError",
    "EngineRequest",
    "EngineInfo",
    "EngineStats",
    "EngineView",
    "FAULTS",
    "FaultSet",
    "IdleCensus",
    "FinishReason",
    "HISTORIES",
    "INT64_MAX",
    "INT64_MIN",
    "LLMEngine",
    "MPAsyncLLMEngine",
    "MAX_ABS_LENGTH_PENALTY",
    "MAX_ABS_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_REPETITION_PENALTY",
    "MAX_TEMPERATURE",
    "MAX_TOP_K",
    "MIN_REPETITION_PENALTY",
    "ModelNotFoundError",
    "ParallelConfig",
    "REGISTRIES",
    "RequestOrigin",
    "RequestOutput",
    "RequestOutputKind",
    "RequestRejectedError",
    "RequestStreamGroup",
    "SamplingParams",
    "SchedulerConfig",
    "SequenceStatus",
    "check_engine_config",
    "cuda_alloc_sites",
    "derive_max_model_len",
    "module_roots",
    "request_census",
    "StructuredOutputsParams",
    "blocks_document",
    "view_dict",
    "load_checkpoint",
    "resolve_model",
]
