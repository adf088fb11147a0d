"""create_executor: the executor a configuration asks for (in-process, multiprocess or Ray).

It stands apart from ``executor.py`` so that the Ray executor, which builds on
``DistributedExecutor``, is imported by no file it imports itself.
"""

from __future__ import annotations

import torch

from vlite.engine.config import EngineConfig
from vlite.engine.core.faults import FaultSet
from vlite.engine.worker.executor import Executor, MultiprocExecutor, UniProcExecutor
from vlite.engine.worker.loader import LoadedCheckpoint
from vlite.engine.worker.models.parallel_layers import check_tp_size


def create_executor(config: EngineConfig, checkpoint: LoadedCheckpoint, max_model_len: int, device: torch.device,
                    dtype: torch.dtype, faults: FaultSet) -> Executor:
    """The executor ``config.parallel`` asks for: in-process for tensor_parallel_size 1, else
    multiprocess ("mp") or Ray ("ray") workers.

    Raises:
        ValueError: the model cannot be split over that many ranks.
        ExecutorStartupError: a rank failed to start; Ray is not installed.
    """
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1:
        return UniProcExecutor(checkpoint, max_model_len, device, dtype, config, faults)
    hf = checkpoint.config
    num_kv = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    check_tp_size(parallel.tensor_parallel_size, hf.num_attention_heads, num_kv, hf.intermediate_size)
    if device.type == "cuda" and torch.cuda.device_count() < parallel.tensor_parallel_size \
            and parallel.distributed_executor_backend == "mp":
        raise ValueError(f"tensor_parallel_size {parallel.tensor_parallel_size} needs as many GPUs on this host, "
                         f"found {torch.cuda.device_count()}")
    from vlite.engine.worker.models.llama import rope_tables

    spec_args = dict(hf_config=hf, model_path=str(checkpoint.path), model_name=checkpoint.name,
                     max_model_len=max_model_len, device=device.type, dtype=config.dtype, cpu_gemm=config.cpu_gemm,
                     seed=config.seed, rope=rope_tables(hf, max_model_len))
    if parallel.distributed_executor_backend == "ray":
        from vlite.engine.worker.ray_executor import RayExecutor

        return RayExecutor(config, faults, spec_args)
    return MultiprocExecutor(config, faults, spec_args)
