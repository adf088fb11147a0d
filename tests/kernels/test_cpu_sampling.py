"""The C++ greedy argmax (cpu_sampling) gives torch.argmax(-1)'s indices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlite.kernels import cpu_extension, cpu_sampling


@pytest.fixture(scope="module", autouse=True)
def extension():
    module = cpu_extension.load()
    assert module is not None, "the C++ CPU kernels must build on this machine (g++, ninja)"
    return module


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (64, 49152), (3, 1), (2, 15), (5, 16), (7, 33), (9, 1000)])
def test_random_rows_match_torch(extension, rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    got = extension.argmax_rows(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))


def test_ties_nan_and_infinities_as_torch(extension):
    x = torch.zeros(6, 100)
    x[0, 10] = x[0, 90] = 5.0  # a tie: the first index wins
    x[1, 50] = x[1, 70] = float("nan")  # NaN ranks above every number: the first NaN
    x[1, 60] = float("inf")
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 99] = float("nan")  # a NaN in the scalar tail
    x[4, 17] = float("inf")
    x[4, 33] = float("inf")
    x[5, 3] = -0.0  # -0.0 == 0.0: the first zero stays
    got = extension.argmax_rows(x)
    assert got.tolist() == x.argmax(-1).tolist() == [10, 50, 0, 99, 17, 0]


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 80), seed=st.integers(0, 2**31 - 1),
       special=st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, 1.0]), max_size=4))
def test_any_row_matches_torch(extension, vocab, seed, special):
    g = torch.Generator().manual_seed(seed)
    # few distinct values, so ties are common
    row = torch.randint(-3, 4, (1, vocab), generator=g).float()
    for value in special:
        row[0, int(torch.randint(vocab, (1,), generator=g))] = value
    assert extension.argmax_rows(row).tolist() == row.argmax(-1).tolist()


def test_row_stride_and_fallbacks():
    wide = torch.randn(4, 200)
    view = wide[:, :150]  # rows 200 apart, each contiguous
    assert torch.equal(cpu_sampling.argmax(view), view.argmax(-1))
    half = torch.randn(3, 64).bfloat16()  # not float32: torch's argmax
    assert torch.equal(cpu_sampling.argmax(half), half.argmax(-1))
    columns = torch.randn(64, 3).t()  # rows not contiguous: torch's argmax
    assert torch.equal(cpu_sampling.argmax(columns), columns.argmax(-1))


def test_bad_input_is_refused(extension):
    with pytest.raises(RuntimeError, match="float32"):
        extension.argmax_rows(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="V > 0"):
        extension.argmax_rows(torch.empty(2, 0))
