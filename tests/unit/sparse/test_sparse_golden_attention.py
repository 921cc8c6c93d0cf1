"""Sparse attention (FlashMLA's sparse prefill form), the index conversions and the composed
pipeline reference, against naive loops and the documented layouts."""

from __future__ import annotations

import pytest
import torch
from _sparse_naive import naive_global_slots, naive_sparse_row

from mlacheck import sparse_index
from mlacheck.golden.core import Operand
from mlacheck.golden.pipeline import local_rows, reference, selection_allowance
from mlacheck.golden.sparse import sparse_attention
from mlacheck.golden.topk import reference_topk


def _attention_inputs(t: int = 5, h: int = 3, n: int = 40, d: int = 24, topk: int = 8):  # noqa: ANN202
    g = torch.Generator().manual_seed(11)
    q = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    kv = torch.randn(n, 1, d, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, n, (t, 1, topk), generator=g, dtype=torch.int32)
    idx[1, 0, 5:] = -1
    idx[2, 0, :] = -1  # a row with no valid index
    idx[3, 0, 0] = n  # >= N: invalid too (FlashMLA's convention)
    idx[4, 0, 2] = idx[4, 0, 3]  # a repeated slot counts twice, as in the kernel's sum
    return q, kv, idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_attention_matches_naive(dtype: torch.dtype) -> None:
    q, kv, idx = _attention_inputs()
    dv, scale = 16, 0.3
    got = sparse_attention(q, kv, idx, scale, dv, dtype)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            out, lse, mx = naive_sparse_row(q[t, h], kv[:, 0], idx[t, 0].tolist(), scale, dv)
            torch.testing.assert_close(got.out[t, h].double(), out, rtol=tol, atol=tol)
            assert float(got.lse[t, h]) == pytest.approx(lse, abs=tol) or lse == float("-inf")
            assert float(got.max_logits[t, h]) == pytest.approx(mx, abs=tol) or mx == float("-inf")
    assert torch.isneginf(got.lse[2]).all() and torch.isneginf(got.max_logits[2]).all()
    assert torch.equal(got.out[2], torch.zeros_like(got.out[2]))


def test_sparse_attention_blocks_and_ignores_poison_at_invalid_slots() -> None:
    q, kv, idx = _attention_inputs(t=9)
    whole = sparse_attention(q, kv, idx, 0.3, 16, torch.float64)
    small = sparse_attention(q, kv, idx, 0.3, 16, torch.float64, budget=3 * 8)
    assert torch.equal(whole.out, small.out) and torch.equal(whole.lse, small.lse)
    poisoned = kv.clone()
    poisoned[0] = float("nan")  # -1 must never be read as slot 0
    idx2 = idx.clone()
    idx2[idx2 == 0] = 1
    a = sparse_attention(q, kv, idx2, 0.3, 16, torch.float64)
    b = sparse_attention(q, poisoned, idx2, 0.3, 16, torch.float64)
    assert torch.equal(a.out, b.out) and not torch.isnan(b.out).any()


def test_sparse_attention_takes_fp8_with_a_scale() -> None:
    q, kv, idx = _attention_inputs()
    kv8 = (kv.float() / 0.5).to(torch.float8_e4m3fn)
    got = sparse_attention(q, Operand(kv8, 0.5), idx, 0.3, 16, torch.float64)
    want = sparse_attention(q, kv8.double() * 0.5, idx, 0.3, 16, torch.float64)
    assert torch.equal(got.out, want.out)


def test_global_slots_match_naive_and_keep_minus_one() -> None:
    table = torch.tensor([[5, 2, 7], [0, 3, 0]])
    lens = torch.tensor([9, 6])
    local = torch.tensor([[0, 4, 8, -1, 12], [5, 0, 2, 3, 6]])
    req = sparse_index.token_requests(torch.tensor([0, 1, 2]))
    got = sparse_index.to_global_slots(local, req, table, 4, lens)
    assert torch.equal(got, naive_global_slots(local, req, table, 4, lens))
    assert got[0].tolist() == [20, 8, 28, -1, -1] and got[1, 4] == -1  # past kv_len: -1
    assert sparse_index.to_global_slots(local, req, table, 4)[0, 4] == -1  # past the table


def test_ragged_and_row_major_agree_only_when_rows_are_full() -> None:
    rows = torch.tensor([[3, -1, 1], [-1, -1, -1], [7, 8, 9]])
    ragged = sparse_index.to_ragged(rows)
    assert ragged.indptr.tolist() == [0, 2, 2, 5] and ragged.flat.tolist() == [3, 1, 7, 8, 9]
    assert sparse_index.from_ragged(ragged, 3).tolist() == [[3, 1, -1], [-1, -1, -1], [7, 8, 9]]
    assert sparse_index.same_sets(sparse_index.from_ragged(ragged, 3), rows).all()
    # the row-major read of the ragged buffer (bug class 2): token t's entries at t * topk
    misread = torch.full((3, 3), -1)
    flat = ragged.flat
    for t in range(3):
        for i in range(3):
            if t * 3 + i < flat.numel():
                misread[t, i] = flat[t * 3 + i]
    assert sparse_index.same_sets(misread, rows).tolist() == [False, False, False]


def test_same_sets_is_order_free_and_counts_repeats() -> None:
    a = torch.tensor([[1, 2, -1], [1, 1, 2], [4, -1, -1]])
    b = torch.tensor([[2, -1, 1], [1, 2, 2], [4, -1, -1]])
    assert sparse_index.same_sets(a, b).tolist() == [True, False, True]


def test_local_rows_shift_prefill_logits_to_request_positions() -> None:
    lg = torch.arange(12.0).reshape(2, 6)
    got = local_rows(lg, torch.tensor([0, 4]), 3)
    assert got.tolist() == [[0.0, 1.0, 2.0], [10.0, 11.0, float("-inf")]]


def test_pipeline_reference_and_the_selection_allowance() -> None:
    g = torch.Generator().manual_seed(5)
    page, lens = 4, torch.tensor([10, 7])
    table = torch.tensor([[3, 0, 5], [1, 4, 0]])
    req = torch.tensor([0, 0, 1])
    logits = torch.randn(3, 10, generator=g)
    logits[0, 8:] = float("-inf")  # causal: token 0 of request 0 sees 8 positions
    logits[2, 7:] = float("-inf")
    q = torch.randn(3, 2, 16, generator=g)
    kv = torch.randn(6 * page, 16, generator=g)
    ref = reference(logits, 4, req, table, page, lens, q, kv, 0.25, 8, torch.float64)
    assert torch.equal(ref.selection, reference_topk(logits, 4))
    assert torch.equal(ref.slots, naive_global_slots(ref.selection, req, table, page, lens))
    rows, alt = selection_allowance(q, kv, ref.slots, ref.slots.flip(1), 0.25, 8, torch.float64)
    assert rows.numel() == 0 and alt is None  # the same sets in another order: no allowance
    other = ref.slots.clone()
    other[1, 0] = naive_global_slots(torch.tensor([[9]]), torch.tensor([0]), table, page, lens)[0, 0]
    rows, alt = selection_allowance(q, kv, ref.slots, other, 0.25, 8, torch.float64)
    assert rows.tolist() == [1]
    want = sparse_attention(q[1:2], kv, other[1:2], 0.25, 8, torch.float64)
    assert torch.equal(alt.out, want.out)
