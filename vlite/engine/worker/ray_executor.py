"""Ray backend of the executor: one Ray actor per tensor-parallel rank, on the hosts of a Ray
cluster (vLLM's ``RayDistributedExecutor``, much reduced). Optional: ``pip install 'vlite[ray]'``.

Cluster: with ``RAY_ADDRESS`` set (e.g. ``auto`` on a host where ``ray start`` ran) the engine
joins that cluster; otherwise it starts a local one bound to 127.0.0.1. The actors are placed by
a placement group, one bundle per rank ({"GPU": 1} on CUDA, a CPU share on CPU), strategy
``$VLITE_RAY_PLACEMENT_STRATEGY`` (default PACK; SPREAD or STRICT_SPREAD put ranks on different
hosts). Rank 0's actor picks a free port on its node; every rank joins
``tcp://<rank 0 node ip>:<port>`` with torch.distributed (gloo on CPU, NCCL on CUDA). Each step's
``StepInput`` is put into Ray's object store once and every actor reads it from there.

Actors are owned by the engine process, so Ray stops them when it exits.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from vlite.engine.config import EngineConfig
from vlite.engine.core.faults import FaultSet
from vlite.engine.worker.executor import (
    CALL_TIMEOUT_S,
    START_TIMEOUT_S,
    DistributedExecutor,
    ExecutorStartupError,
    WorkerFailedError,
)
from vlite.engine.worker.worker import WorkerSpec

logger = logging.getLogger("vlite.executor")

RAY_MISSING = ("distributed_executor_backend 'ray' needs Ray, which is an optional extra: "
               "pip install 'vlite[ray]' (or use the default backend 'mp' on one host)")


class RayWorkerWrapper:
    """The actor: builds a ``Worker`` on ``start`` and runs ``call``s on it."""

    def __init__(self) -> None:
        self.worker = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start(self, spec: WorkerSpec, rank: int) -> dict:
        from vlite.engine.worker.worker import Worker

        self.worker = Worker(spec, rank)
        return {**self.worker.info(), "hostname": socket.gethostname()}

    def call(self, message: tuple[str, tuple]) -> Any:
        method, args = message
        return getattr(self.worker, method)(*args)


def _cause(exc: BaseException) -> str:
    """The worker's own exception of a RayTaskError, as one line."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}".rstrip(": ")


class RayExecutor(DistributedExecutor):
    """Tensor-parallel ranks as Ray actors.

    Raises:
        ExecutorStartupError: Ray is not installed, the cluster lacks room for the ranks, or a
            rank failed to start (one line).
    """

    def __init__(self, config: EngineConfig, faults: FaultSet, spec_args: dict) -> None:
        super().__init__(config, faults)
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ExecutorStartupError(RAY_MISSING) from None
        self._ray = ray
        self._owns_ray = False
        n = self.tensor_parallel_size
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            kwargs: dict = {"include_dashboard": False, "logging_level": logging.WARNING, "log_to_driver": True}
            if address is None:  # a local cluster, loopback only
                kwargs["_node_ip_address"] = "127.0.0.1"
            ray.init(address=address, **kwargs)
            self._owns_ray = address is None
        cuda = spec_args["device"] == "cuda"
        cpus = max(0.01, min(1.0, ray.cluster_resources().get("CPU", 1) / n))
        bundle = {"GPU": 1, "CPU": cpus} if cuda else {"CPU": cpus}
        strategy = os.environ.get("VLITE_RAY_PLACEMENT_STRATEGY", "PACK")
        self._pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
        try:
            ray.get(self._pg.ready(), timeout=min(START_TIMEOUT_S, 120))
        except Exception:  # noqa: BLE001 - GetTimeoutError: not enough room
            self.shutdown()
            raise ExecutorStartupError(
                f"the Ray cluster has no room for {n} ranks of {bundle} ({strategy}); "
                f"its resources: {ray.cluster_resources()}") from None
        remote = ray.remote(RayWorkerWrapper)
        threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() else None
        self.actors = [
            remote.options(num_cpus=cpus, num_gpus=1 if cuda else 0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               placement_group=self._pg, placement_group_bundle_index=rank)).remote()
            for rank in range(n)]
        try:
            # a local cluster: all ranks on this host, rendezvous over loopback
            ip = "127.0.0.1" if self._owns_ray else ray.get(self.actors[0].node_ip.remote(), timeout=START_TIMEOUT_S)
            port = ray.get(self.actors[0].free_port.remote(), timeout=START_TIMEOUT_S)
            spec = WorkerSpec(**spec_args, tp_size=n, init_method=f"tcp://{ip}:{port}", num_threads=threads)
            infos = self._gather([a.start.remote(spec, rank) for rank, a in enumerate(self.actors)],
                                 START_TIMEOUT_S, "start-up")
        except WorkerFailedError as exc:
            raise ExecutorStartupError(f"tensor-parallel rank {exc.rank} failed to start: {exc.detail}") from None
        except ExecutorStartupError:
            raise
        except Exception as exc:  # noqa: BLE001 - a Ray failure before the ranks started
            self.shutdown()
            raise ExecutorStartupError(f"Ray actors failed to start: {_cause(exc)}") from None
        here = socket.gethostname()
        self._local_pids = [i["pid"] for i in infos if i["hostname"] == here]
        self._started(infos)

    def worker_pids(self) -> list[int]:
        return list(self._local_pids)

    def _fail(self, rank: int, detail: str) -> WorkerFailedError:
        exc = WorkerFailedError(rank, None, f"tensor-parallel rank {rank} (Ray actor) failed: {detail}", detail)
        self.failure = self.failure or exc
        self.shutdown()
        return exc

    def _gather(self, refs: list, timeout: float, what: str) -> list[Any]:
        ray = self._ray
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + timeout
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise self._fail(index[pending[0]], f"no answer to {what} within {timeout:.0f} s (hung?)")
            for ref in ready:
                try:
                    results[index[ref]] = ray.get(ref)
                except Exception:  # noqa: BLE001 - RayActorError or RayTaskError(the worker's exception)
                    raise self._blame(ref, pending, index, what) from None
        return results

    def _blame(self, failed, pending: list, index: dict, what: str) -> WorkerFailedError:
        """Name the rank that caused a failure: an actor that died (its peers then fail in their
        collectives too) before one that raised; waits up to 2 s for the others to settle."""
        ray = self._ray
        settled, _ = ray.wait(pending, num_returns=len(pending), timeout=2.0) if pending else ([], [])
        raised = None
        for ref in [failed, *settled]:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return self._fail(index[ref], f"the actor died during {what} ({type(exc).__name__})")
            except Exception as exc:  # noqa: BLE001
                raised = raised or (index[ref], _cause(exc))
        return self._fail(*raised)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self.failure is not None:
            raise self.failure
        message = self._ray.put((method, args))  # serialized once, read by every rank
        return self._gather([a.call.remote(message) for a in self.actors], CALL_TIMEOUT_S, method)

    def shutdown(self) -> None:
        ray = self._ray
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
        if getattr(self, "_pg", None) is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


__all__ = ["RAY_MISSING", "RayExecutor", "RayWorkerWrapper"]
