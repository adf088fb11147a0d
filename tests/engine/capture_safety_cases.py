"""What a CUDA graph captures must not sync with the host (run by ``test_capture_safety.py``).

A CUDA graph records kernels; anything in the captured step that makes the host wait for the
device (``.item()``, ``bool(tensor)``, ``nonzero``, boolean-mask indexing, a device-to-host
copy) or that builds a tensor on the host fails capture with "operation not permitted when
stream is capturing". ``HostSyncGuard`` (a ``TorchDispatchMode``) raises on each of those ops, so
the model's steps can be checked on the CPU: with ``VLITE_ATTENTION_BACKEND=triton`` under
``TRITON_INTERPRET=1`` the model forward calls the same ops as on CUDA (``fused_ops``). On a GPU
the same cases run on CUDA and also capture and replay the decode graphs for real.

Not collected on its own (the name does not start with ``test_``): the interpreter flag must
be set before ``triton`` is first imported, so ``test_capture_safety.py`` runs this file in a
fresh pytest process. The model is a tiny random Llama built here (no checkpoint, no tokenizer).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not ON_GPU:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("run this file with TRITON_INTERPRET=1 (as tests/engine/test_capture_safety.py does)")
    os.environ["TRITON_INTERPRET"] = "1"

from vlite.engine.worker.cuda_graphs import DecodeGraphRunner, pick_bucket  # noqa: E402 (the interpreter flag must be set first)
from vlite.engine.worker.loader import LoadedCheckpoint  # noqa: E402
from vlite.engine.worker.model_runner import ModelRunner, StepInput, copy_kv_blocks  # noqa: E402
from vlite.kernels import torch_ref  # noqa: E402
from vlite.kernels import triton_store_kvcache as tsk  # noqa: E402
from vlite.kernels.fused_ops import TorchOps  # noqa: E402

aten = torch.ops.aten
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
BLOCK_SIZE = 4


class HostSyncError(RuntimeError):
    """An op that makes the host wait for the device ran inside a step."""


class HostSyncGuard(TorchDispatchMode):
    """Raises ``HostSyncError`` on every op that syncs the host with the device or reads device
    data on the host: ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()``),
    ``is_nonzero``, ``nonzero`` (and ``argwhere``), ``masked_select``, ``unique``, indexing or
    index-assignment with a boolean mask (its result's size depends on the data), and, on a
    GPU, any copy to the host and any op whose output lands on the host. ``seen`` counts the ops
    that ran (a guard that saw nothing would prove nothing)."""

    BANNED = {aten._local_scalar_dense, aten.is_nonzero, aten.nonzero, aten.nonzero_static, aten.masked_select,
              aten.argwhere, aten._unique2, aten.unique_consecutive, aten.unique_dim}
    MASK_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen += 1
        packet = func.overloadpacket
        if packet in self.BANNED:
            raise HostSyncError(f"{func} syncs with the host")
        if packet in self.MASK_INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
                raise HostSyncError(f"{func} with a boolean mask (the result's size depends on the data)")
        out = func(*args, **kwargs)
        if self.device.type == "cuda":
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if any(isinstance(o, torch.Tensor) and o.device.type == "cpu" for o in outs):
                raise HostSyncError(f"{func} produced a host tensor inside the step")
        return out


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    """The CUDA path's ops on either device (set per test: other case files share the process)."""
    monkeypatch.setenv("VLITE_ATTENTION_BACKEND", "triton")


def tiny_runner(dtype: torch.dtype = torch.float32, num_blocks: int = 24) -> ModelRunner:
    """A ModelRunner over a random 2-layer Llama (GQA 4/2 heads, D 16) built in-process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.3)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    ckpt = LoadedCheckpoint(config, hf.state_dict(), None, "tiny-random-llama", None)
    # cpu_gemm "torch": plain F.linear, the op a CUDA run calls
    runner = ModelRunner(ckpt, 64, DEVICE, dtype, cpu_gemm="torch" if DEVICE.type == "cpu" else None)
    runner.initialize_kv_cache(num_blocks, BLOCK_SIZE, max_num_seqs=4, enforce_eager=True)
    return runner


def step(seqs: list[tuple[list[int], int, list[int]]]) -> StepInput:
    """A StepInput from (all token ids so far, tokens already computed, block table) per
    sequence, decodes first; every sequence computes the rest of its tokens and is sampled."""
    ids, pos, slots, q_lens, seq_lens, logits = [], [], [], [], [], []
    num_decodes = 0
    for i, (tokens, done, table) in enumerate(seqs):
        new = range(done, len(tokens))
        ids += tokens[done:]
        pos += list(new)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new]
        q_lens.append(len(new))
        seq_lens.append(len(tokens))
        logits.append(len(ids) - 1)
        if len(new) == 1 and num_decodes == i:
            num_decodes += 1
    return StepInput(ids, pos, slots, [t for *_, t in seqs], q_lens, seq_lens, num_decodes, logits, [])


def guarded_forward(runner: ModelRunner, s: StepInput, graphs: DecodeGraphRunner | None = None):
    """The step's forward (through the decode-graph buffers when ``graphs``) under the guard;
    the inputs are built before it, as the model runner does outside a captured graph. Checks
    that every layer wrote its K/V through the Triton store (the op a CUDA run calls)."""
    input_ids, positions, meta, logits_indices = runner.build_metadata(s)
    guard = HostSyncGuard(DEVICE)
    stores = []
    real_store = tsk.store_kvcache
    tsk.store_kvcache = lambda *a: stores.append(a[0].shape[0]) or real_store(*a)
    try:
        with torch.inference_mode(), guard:
            if graphs is not None:
                hidden = graphs.run(input_ids, positions, meta)
            else:
                hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
    finally:
        tsk.store_kvcache = real_store
    assert guard.seen > 50, f"the guard saw only {guard.seen} ops"
    rows = pick_bucket(graphs.buckets, len(s.query_lens)) if graphs is not None else len(s.input_ids)
    assert stores == [rows] * runner.model.num_layers, f"K/V stores through the Triton kernel: {stores}"
    with torch.inference_mode():
        return runner.model.compute_logits(hidden[logits_indices]).cpu()


TABLES = [[3, 7, 1], [5, 0, 9], [2, 11, 4], [8, 6, 10]]
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27], [31, 32, 33, 34, 35, 36, 37, 38],
           [41, 42, 43, 44, 45, 46]]


def test_guard_catches_the_host_syncs_a_capture_forbids():
    """The guard is not vacuous: the torch store's ``bool(valid.all())`` with a padded slot
    (the crash in CUDA-graph capture), ``.item()`` and boolean masks all raise."""
    k = torch.zeros(4, BLOCK_SIZE, 2, 8, device=DEVICE)
    key = torch.ones(3, 2, 8, device=DEVICE)
    slots = torch.tensor([0, -1, 5], device=DEVICE)
    for fn in (lambda: torch_ref.store_kvcache(key, key, k, k.clone(), slots),
               lambda: slots.sum().item(), lambda: key[slots >= 0], lambda: torch.nonzero(slots)):
        with pytest.raises(HostSyncError), HostSyncGuard(DEVICE):
            fn()


def test_fused_rotary_store_writes_through_the_backends_store_without_a_sync():
    """The fused rotary + KV store (the op that used to go through the torch
    store's ``bool(valid.all())``) stores through the Triton kernel: a padded (-1) token
    writes nothing and the others land in their slots, with no host sync."""
    t, hq, hkv, d = 3, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(DEVICE)
    cos = torch.randn(t, d, generator=g).to(DEVICE)
    sin = torch.randn(t, d, generator=g).to(DEVICE)
    slots = torch.tensor([5, -1, 2], device=DEVICE)
    caches = [torch.full((4, BLOCK_SIZE, hkv, d), float("nan"), device=DEVICE) for _ in range(2)]
    with HostSyncGuard(DEVICE):
        _, k, v = TorchOps.rotary_store(qkv, cos, sin, slots, *caches, hq, hkv)
    k_flat, v_flat = (c.view(-1, hkv, d) for c in caches)
    torch.testing.assert_close(k_flat[[5, 2]], k[[0, 2]])
    torch.testing.assert_close(v_flat[[5, 2]], v[[0, 2]])
    assert int(caches[0].isnan().all(-1).all(-1).flatten().logical_not().sum()) == 2  # nothing else written


def test_copy_on_write_block_copy_does_not_sync():
    """Copy-on-write's per-layer copies (``copy_kv_blocks``: index_select + index_copy_) read the
    block ids on the device only; the ids cross to the device once, before, as they did before."""
    runner = tiny_runner()
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    src = torch.tensor([3, 7], device=DEVICE)
    dst = torch.tensor([12, 13], device=DEVICE)
    guard = HostSyncGuard(DEVICE)
    with torch.inference_mode(), guard:
        copy_kv_blocks(runner.kv_caches, src, dst)
    assert guard.seen >= 4 * runner.model.num_layers
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k[[12, 13]], k0[[3, 7]]) and torch.equal(v[[12, 13]], v0[[3, 7]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_mixed_and_padded_decode_steps_do_not_sync(dtype):
    """A prefill step, a mixed step (two decodes, a chunk over a cached prefix, a fresh prefill),
    and a 3-sequence decode through the bucket-4 CUDA-graph buffers (one padded row): no step's
    forward syncs with the host, and the decode's logits equal an eager forward's."""
    runner = tiny_runner(dtype)
    seqs = {i: list(p) for i, p in enumerate(PROMPTS)}
    # step 1: prefill sequences 0, 1 and the first 3 tokens of 2
    s1 = step([(seqs[0], 0, TABLES[0]), (seqs[1], 0, TABLES[1]), (seqs[2][:3], 0, TABLES[2])])
    first = guarded_forward(runner, s1).argmax(-1).tolist()
    seqs[0].append(first[0])
    seqs[1].append(first[1])
    # step 2 (mixed): decodes of 0 and 1, the rest of 2's prompt over its cached prefix, 3 fresh
    s2 = step([(seqs[0], 5, TABLES[0]), (seqs[1], 7, TABLES[1]), (seqs[2], 3, TABLES[2]), (seqs[3], 0, TABLES[3])])
    assert s2.num_decodes == 2 and s2.query_lens == [1, 1, 5, 6]
    second = guarded_forward(runner, s2).argmax(-1).tolist()
    for i in range(4):
        seqs[i].append(second[i])
    # step 3: decodes of 0, 1, 2 padded to the bucket of 4, through the graph buffers
    s3 = step([(seqs[i], len(seqs[i]) - 1, TABLES[i]) for i in range(3)])
    graphs = DecodeGraphRunner(runner.model, runner.kv_caches, BLOCK_SIZE, max_num_seqs=4, max_model_len=64,
                               device=DEVICE)
    assert graphs.can_run(runner.build_metadata(s3)[2])
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    padded = guarded_forward(runner, s3, graphs)
    for (k, v), (k0, v0) in zip(runner.kv_caches, caches):  # rewind the step's K/V writes
        k.copy_(k0)
        v.copy_(v0)
    eager = guarded_forward(runner, s3)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(padded, eager, rtol=tol, atol=tol * eager.abs().max().item())


def test_decode_graphs_capture_and_replay_on_gpu():
    """GPU only: the decode graphs capture (no host sync in the forward) and a replayed,
    padded 3-sequence decode gives the eager forward's logits."""
    if not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    runner = tiny_runner()
    runner.initialize_kv_cache(24, BLOCK_SIZE, max_num_seqs=4, enforce_eager=False)
    assert runner.cuda_graphs is not None and sorted(runner.cuda_graphs.graphs) == [1, 2, 4]
    s1 = step([(PROMPTS[i], 0, TABLES[i]) for i in range(3)])
    runner.execute_model(s1)
    s2 = step([(PROMPTS[i] + [7], len(PROMPTS[i]), TABLES[i]) for i in range(3)])
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    replayed, _ = runner.execute_model(s2)
    for (k, v), (k0, v0) in zip(runner.kv_caches, caches):
        k.copy_(k0)
        v.copy_(v0)
    graphs, runner.cuda_graphs = runner.cuda_graphs, None
    eager, _ = runner.execute_model(s2)
    runner.cuda_graphs = graphs
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4 * eager.abs().max().item())
