"""Triton kernels against the torch reference (run by ``test_triton_kernels.py``).

Not collected on its own (the name does not start with ``test_``): Triton decides whether a
kernel is interpreted when the kernel, and Triton's own library, are first decorated, i.e.
when ``triton`` is first imported, and other tests import it early (transformers does). So
``test_triton_kernels.py`` runs this file in a fresh pytest process with TRITON_INTERPRET=1
on machines without a GPU; on a GPU ``pytest tests/kernels/triton_kernel_cases.py`` runs the compiled
kernels (``benchmarks/gpu/gpu_check.sh`` does that).

Every test draws fresh random inputs (the seed is in the failure message), poisons the
output with NaN first so that an element the kernel never wrote fails, and compares with
``torch_ref`` computed in float32: relative error (max |out - ref| / max |ref|) under 1e-3 in
float32 and under 2e-2 in bfloat16.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if not INTERPRET and not torch.cuda.is_available():
    if "triton" in sys.modules:
        raise RuntimeError("without a GPU, run this file with TRITON_INTERPRET=1 in the environment "
                           "(as tests/kernels/test_triton_kernels.py does)")
    os.environ["TRITON_INTERPRET"] = "1"
    INTERPRET = True

from vlite.kernels import attention, torch_ref  # noqa: E402 (the interpreter flag must be set first)
from vlite.kernels import triton_paged_attention as tpa  # noqa: E402 (the interpreter flag must be set first)
from vlite.kernels import triton_store_kvcache as tsk  # noqa: E402 (the interpreter flag must be set first)
from vlite.kernels.attention import AttentionMetadata  # noqa: E402 (the interpreter flag must be set first)

ON_GPU = not INTERPRET
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TOL = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]
assert tpa.INTERPRETED == tsk.INTERPRETED == (not ON_GPU)

# Small tiles so that tiny shapes still cross tile, partition and block boundaries.
SMALL_TILES = {"decode_block_n": 16, "partition_size": 32, "block_m": 16, "block_n": 16}


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


class Scenario:
    """A paged batch: sequences given as (num_cached, query_len), decodes (query_len 1) first.

    Each sequence gets its blocks from a shuffled pool (so tables are not contiguous); the
    cache holds random K/V for every cached token and this step's K/V are stored into it
    with the torch reference. Extra unused blocks are filled with random values too.
    """

    def __init__(self, seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, pad_rows=0):
        g = torch.Generator().manual_seed(seed)
        self.seqs = seqs
        blocks_per_seq = [-(-(c + q) // block_size) for c, q in seqs]
        num_blocks = sum(blocks_per_seq) + 3
        pool = torch.randperm(num_blocks, generator=g).tolist()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=g).to(dtype)
        self.v_cache = torch.randn(shape, generator=g).to(dtype)
        tables, slots = [], []
        for (cached, q_len), n in zip(seqs, blocks_per_seq):
            table, pool = pool[:n], pool[n:]
            tables.append(table)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + q_len)]
        width = max(blocks_per_seq) + 1  # one spare column: kernels must not read past a sequence's blocks
        bt = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.tensor(t)
        q_lens = [q for _, q in seqs]
        seq_lens = [c + q for c, q in seqs]
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        num_decodes = 0
        while num_decodes < len(seqs) and q_lens[num_decodes] == 1:
            num_decodes += 1
        t = len(slots)
        self.meta = AttentionMetadata(torch.tensor(slots), torch.tensor(qsl), torch.tensor(seq_lens), bt,
                                      num_decodes, q_lens, seq_lens, block_size)
        self.query = torch.randn((t, num_heads, head_dim), generator=g).to(dtype)
        self.key = torch.randn((t, num_kv_heads, head_dim), generator=g).to(dtype)
        self.value = torch.randn((t, num_kv_heads, head_dim), generator=g).to(dtype)
        torch_ref.store_kvcache(self.key, self.value, self.k_cache, self.v_cache, self.meta.slot_mapping)
        self.scale = head_dim ** -0.5

    def reference(self) -> torch.Tensor:
        """torch_ref in float32 on the same (possibly bfloat16) inputs."""
        return torch_ref.paged_attention(self.query.float(), self.key.float(), self.value.float(),
                                         self.k_cache.float(), self.v_cache.float(), self.meta, self.scale)

    def to(self, device):
        for name in ("k_cache", "v_cache", "query", "key", "value"):
            setattr(self, name, getattr(self, name).to(device))
        m = self.meta
        self.meta = AttentionMetadata(m.slot_mapping.to(device), m.query_start_loc.to(device),
                                      m.seq_lens.to(device), m.block_tables.to(device), m.num_decodes,
                                      m.query_lens, m.seq_lens_list, m.block_size)
        return self


def _check(out: torch.Tensor, ref: torch.Tensor, dtype, seed) -> None:
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), f"unwritten (NaN) or non-finite outputs, seed {seed}"
    err = rel_err(out.cpu(), ref.cpu())
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:.0e}, seed {seed}"


# ---- store_kvcache -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_kvcache_matches_reference_and_skips_padded_slots(dtype, block_size):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    num_blocks, hkv, d, t = 6, 2, 24, 20
    # K and V as views of one fused projection, like the model's: only the token stride is wide.
    fused = torch.randn((t, 3 * hkv * d), generator=g).to(dtype)
    key = fused[:, hkv * d:2 * hkv * d].view(t, hkv, d)
    value = fused[:, 2 * hkv * d:].view(t, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[[1, 7, 19]] = -1  # padded tokens
    shape = (num_blocks, block_size, hkv, d)
    caches = {}
    for name, fn in (("ref", torch_ref.store_kvcache), ("triton", tsk.store_kvcache)):
        kc = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        vc = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
        fn(key.to(DEVICE), value.to(DEVICE), kc, vc, slots.to(DEVICE))
        caches[name] = (kc.cpu(), vc.cpu())
    for ref, got in zip(caches["ref"], caches["triton"]):
        assert torch.equal(ref.isnan(), got.isnan()), f"seed {seed}"
        assert torch.equal(ref.nan_to_num(), got.nan_to_num()), f"seed {seed}"
        # exactly the valid tokens' rows were written; the padded ones left the cache alone
        written = (~got.isnan()).all(-1).all(-1).flatten()
        assert int(written.sum()) == t - 3


# ---- paged decode ----------------------------------------------------------------------------
DECODE_CASES = {
    # name: (seqs as (cached, 1), Hq, Hkv, D, block_size)
    "gqa4-mixed-lengths": ([(0, 1), (14, 1), (31, 1), (70, 1), (5, 1)], 8, 2, 32, 16),
    "gqa3-bs4-mid-block": ([(9, 1), (44, 1), (2, 1)], 6, 2, 16, 4),
    "mha-bs8-d24": ([(22, 1), (64, 1)], 2, 2, 24, 8),
    "bs32-one-long": ([(95, 1)], 4, 1, 16, 32),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("tiles", ["small", "default"])
def test_paged_decode_matches_reference(case, dtype, tiles):
    seqs, hq, hkv, d, bs = DECODE_CASES[case]
    seed = _seed()
    sc = Scenario(seqs, hq, hkv, d, bs, dtype, seed)
    ref = sc.reference()
    sc.to(DEVICE)
    out = torch.full_like(sc.query, float("nan"))
    kw = {"block_n": 16, "partition_size": 32} if tiles == "small" else {}
    tpa.paged_decode(sc.query, sc.k_cache, sc.v_cache, sc.meta.block_tables, sc.meta.seq_lens, sc.scale,
                     max(sc.meta.seq_lens_list), out=out, **kw)
    _check(out, ref, dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_padded_rows_are_zero_and_bound_fixes_partitions(dtype):
    """CUDA-graph padding: rows with seq_len 0 (block table row 0) come out as zeros, and
    passing a loose max_seq_len (max_model_len, as a captured graph does) changes nothing."""
    seed = _seed()
    sc = Scenario([(40, 1), (3, 1), (0, 1), (0, 1)], 8, 2, 16, 16, dtype, seed)
    sc.meta.seq_lens[2:] = 0
    sc.meta.block_tables[2:] = 0
    ref = sc.reference()[:2]
    sc.to(DEVICE)
    for partition_size in (32, None):
        out = torch.full_like(sc.query, float("nan"))
        tpa.paged_decode(sc.query, sc.k_cache, sc.v_cache, sc.meta.block_tables, sc.meta.seq_lens, sc.scale,
                         max_seq_len=256, out=out, block_n=16, partition_size=partition_size)
        _check(out[:2], ref, dtype, seed)
        assert torch.equal(out[2:].cpu(), torch.zeros_like(out[2:].cpu()))


# ---- prefill over the paged cache ------------------------------------------------------------
PREFILL_CASES = {
    # name: (seqs as (cached, query_len), Hq, Hkv, D, block_size)
    "fresh-prefills": ([(0, 37), (0, 5), (0, 16)], 4, 2, 32, 16),
    "chunked-with-cached-prefix": ([(13, 20), (32, 33), (7, 2)], 6, 2, 16, 8),  # prefixes end mid-block
    "prefix-hit-bs4-gqa4": ([(24, 9), (40, 17)], 8, 2, 16, 4),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_paged_prefill_matches_reference(case, dtype):
    seqs, hq, hkv, d, bs = PREFILL_CASES[case]
    seed = _seed()
    sc = Scenario(seqs, hq, hkv, d, bs, dtype, seed)
    assert sc.meta.num_decodes == 0
    ref = sc.reference()
    sc.to(DEVICE)
    out = torch.full_like(sc.query, float("nan"))
    m = sc.meta
    tpa.paged_prefill(sc.query, sc.k_cache, sc.v_cache, m.block_tables, m.seq_lens, m.query_start_loc, sc.scale,
                      0, len(seqs), max(m.query_lens), out, block_m=16, block_n=16)
    _check(out, ref, dtype, seed)


# ---- the attention interface (store + attention, decodes and prefills in one step) -----------
@pytest.mark.parametrize("dtype", DTYPES)
def test_interface_mixed_step_through_triton_backend(dtype):
    """A whole step as the model runs it: store this step's K/V, then attend, with decodes,
    a chunked prefill over a cached prefix, a fresh prefill and padded (-1) slots."""
    seed = _seed()
    sc = Scenario([(30, 1), (6, 1), (17, 1), (21, 12), (0, 19)], 9, 3, 16, 8, dtype, seed)
    m = sc.meta
    ref = sc.reference()
    # Wipe this step's slots so the Triton store must write them; pad two extra tokens.
    sc.k_cache.view(-1, 3, 16)[m.slot_mapping] = float("nan")
    sc.v_cache.view(-1, 3, 16)[m.slot_mapping] = float("nan")
    sc.to(DEVICE)
    m = sc.meta  # the metadata on the device (the CPU one above was only for the wipe)
    pad = torch.full((2,), -1, dtype=torch.long, device=DEVICE)
    key = torch.cat([sc.key, torch.full_like(sc.key[:2], float("nan"))])
    value = torch.cat([sc.value, torch.full_like(sc.value[:2], float("nan"))])
    attention.store_kvcache(key, value, sc.k_cache, sc.v_cache, torch.cat([m.slot_mapping, pad]), backend="triton")
    assert not sc.k_cache.isnan().any() and not sc.v_cache.isnan().any(), "padded slot written or valid slot missed"
    out = tpa.paged_attention(sc.query, sc.k_cache, sc.v_cache, m, sc.scale,
                              out=torch.full_like(sc.query, float("nan")), **SMALL_TILES)
    _check(out, ref, dtype, seed)
    # the interface's own entry point (default tiles) gives the same answer
    out2 = attention.paged_attention(sc.query, sc.key, sc.value, sc.k_cache, sc.v_cache, m, sc.scale,
                                     backend="triton")
    _check(out2, ref, dtype, seed)


def test_auto_backend_picks_torch_on_cpu(monkeypatch):
    """On CPU tensors the default backend never reaches a Triton kernel."""
    if ON_GPU:
        pytest.skip("checks the CPU dispatch")

    def boom(*a, **k):
        raise AssertionError("Triton path taken on CPU")

    monkeypatch.setattr(tpa, "paged_attention", boom)
    monkeypatch.setattr(tsk, "store_kvcache", boom)
    sc = Scenario([(5, 1), (0, 4)], 4, 2, 16, 4, torch.float32, 0)
    attention.store_kvcache(sc.key, sc.value, sc.k_cache, sc.v_cache, sc.meta.slot_mapping)
    out = attention.paged_attention(sc.query, sc.key, sc.value, sc.k_cache, sc.v_cache, sc.meta, sc.scale)
    # on CPU that is the C++ kernel where it is built: float32 sums in another order and its own exp,
    # so the tolerance of tests/kernels/test_cpu_attention.py (measured 2.4e-7 off on a Sapphire Rapids)
    torch.testing.assert_close(out, sc.reference(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        attention.paged_attention(sc.query, sc.key, sc.value, sc.k_cache, sc.v_cache, sc.meta, sc.scale,
                                  backend="cuda")


# ---- end to end: a tiny model's greedy tokens through both backends --------------------------
# The tiny checkpoint (tests/conftest.py) is random weights built in the test, with the default
# model's tokenizer files ($VLITE_TEST_TOKENIZER_DIR where the GGUF package is absent, as on the
# GPU machine).
def test_engine_greedy_tokens_match_torch_backend(tiny_checkpoint, monkeypatch):
    """The model through the Triton path (chunked prefill over 4-token blocks, then decodes,
    GQA 4/2 heads; a second pass over the same prompts, which prefix caching, where on,
    serves partly from cached blocks) produces the torch path's greedy tokens in float32.
    On a GPU the Triton run captures and replays the decode CUDA graphs (the torch path runs
    eagerly: it plans each step on the host)."""
    from conftest import make_engine

    from vlite.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(_seed())
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (13, 22, 6)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("VLITE_ATTENTION_BACKEND", backend)
        engine = make_engine(tiny_checkpoint, num_blocks=40, block_size=4, max_num_batched_tokens=10,
                             max_num_seqs=4, max_model_len=64, device=DEVICE.type)
        assert (engine.model_runner.cuda_graphs is not None) == (ON_GPU and backend == "triton")
        runs[backend] = [o.outputs[0].token_ids for _ in range(2) for o in engine.generate(prompts, params)]
    assert all(len(t) == 5 for t in runs["torch"])
    assert runs["torch"][:3] == runs["torch"][3:]
    assert runs["triton"] == runs["torch"]


def test_cuda_graph_decode_matches_eager_on_gpu(tiny_checkpoint):
    """GPU only: the engine with decode CUDA graphs (buckets 1, 2, 4, 6 here; 3 and 5 running
    sequences are padded) gives the eager engine's greedy tokens (float32: a padded batch
    may pick other matmul kernels, and bfloat16 rounding could then flip a near-tie)."""
    if not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    from conftest import make_engine

    from vlite.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(_seed())
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (13, 40, 6, 21, 9)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (12, 4, 9, 20, 7)]
    runs = {}
    for eager in (True, False):
        engine = make_engine(tiny_checkpoint, num_blocks=64, block_size=16, max_num_seqs=6, max_model_len=256,
                             device="cuda", enforce_eager=eager)
        assert (engine.model_runner.cuda_graphs is None) == eager
        assert engine.model_runner.cuda_graphs is None or engine.model_runner.cuda_graphs.buckets == [1, 2, 4, 6]
        runs[eager] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert runs[False] == runs[True]
