"""Copy-on-write's block copy (``copy_kv_blocks``): the same result as the scattered assignment
it replaced, made of one gather and one indexed copy per cache tensor."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlite.engine.worker.model_runner import copy_kv_blocks

aten = torch.ops.aten


def caches(num_layers: int = 3, num_blocks: int = 10, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) [num_blocks, block_size 4, 2 heads, head_dim 8], every element distinct."""
    g = torch.Generator().manual_seed(0)
    def one():
        return torch.randn(num_blocks, 4, 2, 8, generator=g).to(dtype)

    return [(one(), one()) for _ in range(num_layers)]


def old_semantics(kv, pairs):
    """What ``k_cache[dst] = k_cache[src]`` did: every source read before any destination written."""
    out = []
    for k, v in kv:
        k2, v2 = k.clone(), v.clone()
        for s, d in pairs:
            k2[d], v2[d] = k[s], v[s]
        out.append((k2, v2))
    return out


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("pairs", [[(3, 7)], [(0, 9), (2, 5), (8, 1)], [(4, 6), (6, 2)]],
                         ids=["one pair", "several pairs", "a dst that is also a src"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_equals_the_scattered_assignment_and_leaves_other_blocks(pairs, dtype):
    kv = caches(dtype=dtype)
    before = [(k.clone(), v.clone()) for k, v in kv]
    expected = old_semantics(before, pairs)
    src = torch.tensor([s for s, _ in pairs])
    dst = torch.tensor([d for _, d in pairs])
    copy_kv_blocks(kv, src, dst)
    touched = {d for _, d in pairs}
    for (k, v), (ek, ev), (bk, bv) in zip(kv, expected, before):
        assert torch.equal(k, ek) and torch.equal(v, ev)
        for b in range(k.shape[0]):
            if b not in touched:  # blocks that are no pair's dst keep their contents (sources included)
                assert torch.equal(k[b], bk[b]) and torch.equal(v[b], bv[b])
        for s, d in pairs:
            assert torch.equal(k[d], bk[s]) and torch.equal(v[d], bv[s])


def test_one_gather_and_one_indexed_copy_per_cache_tensor():
    """Not the scattered ``index_put_``, which stalled 972 ms per copy beside a busy process."""
    kv = caches(num_layers=4)
    log = OpLog()
    with log:
        copy_kv_blocks(kv, torch.tensor([1, 2]), torch.tensor([5, 6]))
    assert aten.index_put_ not in log.ops and aten._index_put_impl_ not in log.ops
    assert log.ops.count(aten.index_copy_) == 2 * 4 and log.ops.count(aten.index_select) == 2 * 4


def test_model_runner_copy_blocks_copies_every_layer(tiny_checkpoint):
    from conftest import make_engine

    engine = make_engine(tiny_checkpoint, num_blocks=16, block_size=4)
    runner = engine.model_runner  # the in-process executor's
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.copy_blocks([(2, 11), (3, 12)])
    for (k, v), (ek, ev) in zip(runner.kv_caches, old_semantics(before, [(2, 11), (3, 12)])):
        assert torch.equal(k, ek) and torch.equal(v, ev)
