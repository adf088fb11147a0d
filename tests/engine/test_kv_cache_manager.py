"""Block manager: allocation, ref counts, free list, block tables and the ledger."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.engine.core.fault_seams import FaultyKVCacheManager
from vlite.engine.core.faults import FaultSet
from vlite.engine.core.kv_cache_manager import KVCacheManager
from vlite.engine.core.ledger import AllocationSite
from vlite.engine.core.sequence import RequestOrigin, Sequence
from vlite.engine.sampling_params import SamplingParams


def make_seq(n_prompt: int, rid: str = "r") -> Sequence:
    return Sequence(rid, None, list(range(n_prompt)), SamplingParams(), RequestOrigin(rid))


def test_allocate_maps_tokens_to_blocks_and_free_returns_them():
    bm = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq(10)
    assert bm.can_allocate(seq, 10)
    assert bm.allocate(seq, 10)
    table = bm.get_block_table(seq.seq_id)
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert bm.kv_cache_usage == pytest.approx(3 / 8)
    assert [e.site for e in bm.ledger.held()] == [AllocationSite.PREFILL] * 3
    assert all(bm.blocks[b].ref_count == 1 for b in table)
    assert bm.free(seq) == 3
    assert bm.num_free_blocks == 8 and len(bm.ledger) == 0 and not bm.block_tables
    assert bm.free(seq) == 0  # a second free is a no-op


def test_append_slot_allocates_only_at_block_boundaries():
    bm = KVCacheManager(num_blocks=4, block_size=4)
    seq = make_seq(4)
    bm.allocate(seq, 4)
    seq.num_computed_tokens = 4
    assert bm.append_slot(seq)  # token 5 needs a second block
    assert len(bm.get_block_table(seq.seq_id)) == 2
    seq.num_computed_tokens = 5
    assert bm.append_slot(seq)  # token 6 fits in block 2
    assert len(bm.get_block_table(seq.seq_id)) == 2
    sites = sorted(e.site.value for e in bm.ledger.held())
    assert sites == ["decode append", "prefill"]


def test_allocation_is_all_or_nothing():
    bm = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_seq(8, "a"), make_seq(8, "b")
    assert bm.allocate(a, 8)
    assert not bm.can_allocate(b, 8)
    assert not bm.allocate(b, 8)
    assert bm.num_free_blocks == 1 and b.seq_id not in bm.block_tables and len(bm.ledger) == 2


def test_double_free_fault_is_recorded_as_anomaly():
    bm = FaultyKVCacheManager(num_blocks=4, block_size=4, faults=FaultSet(["double-free"]))
    seq = make_seq(6)
    bm.allocate(seq, 6)
    bm.free(seq)
    assert min(bm.ref_counts()) == -1
    assert [a.kind for a in bm.ledger.anomalies()] == ["double free"]
    assert bm.ledger.anomalies()[0].request_id == "r"


def test_a_second_reference_by_the_same_sequence_is_an_anomaly_naming_both_allocations():
    # the ledger is keyed by (sequence, block); a second reference by the same holder
    # used to replace the first record silently, so its leak ended "unattributed"
    bm = KVCacheManager(num_blocks=4, block_size=4)
    seq = make_seq(6)
    bm.allocate(seq, 6)
    first = bm.get_block_table(seq.seq_id)[0]
    bm.current_step = 3
    assert bm.allocate_slots(seq, 0, AllocationSite.PREFIX_HIT, prefix_hits=[first])  # planted: taken again
    [a] = bm.ledger.anomalies()
    assert a.kind == "second reference by the same holder" and (a.block_id, a.seq_id) == (first, seq.seq_id)
    assert a.allocation_sites[0] == "prefill, step 0"
    assert a.allocation_sites[1].startswith("prefix cache hit, step 3: ")
    assert a.allocation_sites[1].endswith("-> KVCacheManager.allocate_slots")
    assert [e.site for e in bm.ledger.held() if e.block_id == first] == [AllocationSite.PREFILL]  # first kept


def test_shared_blocks_taken_once_per_sequence_raise_no_anomaly():
    # prefix hits, fork and copy-on-write share blocks across sequences, never twice in one
    bm = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = make_seq(9, "a")
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b = make_seq(9, "b")
    hits = bm.find_prefix_hits(b)
    assert hits and bm.allocate_slots(b, 9 - 4 * len(hits), AllocationSite.PREFILL, hits)
    child = make_seq(9, "a")
    bm.fork(a, child)
    assert bm.append_slot(child)  # the shared partial block is copied (copy-on-write)
    assert bm.ledger.anomalies() == []


def test_unknown_fault_name_is_rejected():
    with pytest.raises(ValueError, match="known faults"):
        FaultSet(["no-such-fault"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "grow", "free"]), st.integers(0, 5), st.integers(1, 20)),
                max_size=60))
def test_random_alloc_free_keeps_accounting(ops):
    bm = KVCacheManager(num_blocks=12, block_size=4)
    seqs = [make_seq(1, f"s{i}") for i in range(6)]
    for op, i, n in ops:
        seq = seqs[i]
        if op == "free":
            bm.free(seq)
            seq.num_computed_tokens = 0
        else:
            ok = bm.allocate_slots(seq, n, AllocationSite.PREFILL)
            if ok:
                seq.num_computed_tokens += n
                assert len(bm.get_block_table(seq.seq_id)) == bm.num_required_blocks(seq.num_computed_tokens)
        held = sum(len(t) for t in bm.block_tables.values())
        assert held + bm.num_free_blocks == bm.num_total_blocks
        assert len(bm.ledger) == held
        assert all(rc in (0, 1) for rc in bm.ref_counts())
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks and len(bm.ledger) == 0
