"""The indexer-logits references (prefill and paged forms) against a naive loop, the paged
cache layout against DeepGEMM's documented one, and the memory blocking."""

from __future__ import annotations

import pytest
import torch
from _sparse_naive import naive_mqa_logits

from mlacheck import indexer_cache
from mlacheck.golden.core import Operand
from mlacheck.golden.indexer import mqa_logits, mtp_visible, paged_mqa_logits


def _inputs(t: int, h: int, d: int, s: int, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    qs = torch.exp2(torch.randint(-9, -5, (t, h), generator=g).float())  # e8m0-like per head
    qstored = (q / qs[..., None]).to(torch.float8_e4m3fn)
    keys = indexer_cache.quantise_keys(torch.randn(s, d, generator=g) * torch.rand(s, 1, generator=g) * 3)
    w = torch.randn(t, h, generator=g)
    return qstored, qs, keys, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mqa_logits_matches_naive(dtype: torch.dtype) -> None:
    q, qs, keys, w = _inputs(t=6, h=4, d=16, s=20)
    starts = torch.tensor([0, 0, 3, 5, 5, 19])
    ends = torch.tensor([1, 7, 9, 5, 20, 20])  # an empty window (5, 5) among them
    got = mqa_logits(Operand(q, qs[..., None]), Operand(keys.values, keys.scales[:, None]), w,
                     starts, ends, dtype)
    want, mag = naive_mqa_logits(q, qs, keys.values, keys.scales, w, starts, ends, 20)
    assert torch.equal(torch.isinf(got.logits), torch.isinf(want))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    fin = torch.isfinite(want)
    torch.testing.assert_close(got.logits[fin].double(), want[fin], rtol=tol, atol=tol)
    torch.testing.assert_close(got.magnitude.double(), mag, rtol=tol, atol=tol)
    assert bool((got.magnitude[fin] >= got.logits[fin].abs() - 1e-9).all())


def test_relu_is_applied_per_head_before_the_weighted_sum() -> None:
    # two heads with opposite dot products: ReLU keeps one, a head sum before ReLU keeps none
    q = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]]).to(torch.float8_e4m3fn)
    k = torch.tensor([[2.0, 0.0]]).to(torch.float8_e4m3fn)
    got = mqa_logits(Operand(q), Operand(k, torch.ones(1, 1)), torch.tensor([[1.0, 1.0]]),
                     torch.tensor([0]), torch.tensor([1]), torch.float64)
    assert float(got.logits[0, 0]) == 2.0
    assert float(got.magnitude[0, 0]) == 4.0


def test_windows_are_clamped_to_the_keys() -> None:
    q, qs, keys, w = _inputs(t=2, h=2, d=8, s=5)
    got = mqa_logits(Operand(q, qs[..., None]), Operand(keys.values, keys.scales[:, None]), w,
                     torch.tensor([-3, 2]), torch.tensor([2, 99]), torch.float64)
    assert torch.isfinite(got.logits[0, :2]).all() and torch.isinf(got.logits[0, 2:]).all()
    assert torch.isinf(got.logits[1, :2]).all() and torch.isfinite(got.logits[1, 2:]).all()


def test_row_blocking_gives_the_same_logits() -> None:
    q, qs, keys, w = _inputs(t=33, h=4, d=16, s=70, seed=3)
    starts = torch.arange(33) % 5
    ends = starts + 30 + torch.arange(33)
    args = (Operand(q, qs[..., None]), Operand(keys.values, keys.scales[:, None]), w, starts, ends,
            torch.float64)
    whole = mqa_logits(*args)
    small = mqa_logits(*args, budget=4 * 40)
    assert torch.equal(whole.logits, small.logits) and torch.equal(whole.magnitude, small.magnitude)


def test_pack_is_values_then_scales_per_page() -> None:
    values = torch.arange(2 * 4 * 8).reshape(2, 4, 8).to(torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    pages = indexer_cache.pack(values, scales)
    assert tuple(pages.shape) == (2, 4, 1, 12) and pages.dtype == torch.uint8
    flat = pages.reshape(2, -1)
    assert torch.equal(flat[1, :32], values[1].reshape(-1).view(torch.uint8))
    assert torch.equal(flat[1, 32:].view(torch.float32), scales[1])  # token 1's scale: bytes 36..39
    v2, s2 = indexer_cache.unpack(pages, 8)
    assert torch.equal(v2.view(torch.uint8), values.view(torch.uint8)) and torch.equal(s2, scales)


def test_quantised_keys_have_per_token_scales() -> None:
    k = torch.randn(5, 16, generator=torch.Generator().manual_seed(2)) * torch.tensor(
        [[0.5], [1.0], [2.0], [4.0], [0.0]])
    keys = indexer_cache.quantise_keys(k)
    assert torch.allclose(keys.scales[:4], k[:4].abs().amax(1) / 448)
    assert float(keys.scales[4]) == pytest.approx(1e-4 / 448)  # the amax floor
    # e4m3 keeps 3 mantissa bits: each value within 2^-4 of itself, relative
    assert ((keys.dequant() - k).abs() <= k.abs() * 2.0**-4 + 1e-9).all()
    pow2 = indexer_cache.quantise_keys(k, ue8m0=True)
    assert torch.equal(torch.exp2(torch.log2(pow2.scales).round()), pow2.scales)


def _paged_setup(page_size: int, lens: list[int], next_n: int, h: int = 4, d: int = 16):  # noqa: ANN202
    g = torch.Generator().manual_seed(7)
    n_pages = sum(-(-n // page_size) for n in lens) + 3
    perm = torch.randperm(n_pages, generator=g)
    width = max(-(-n // page_size) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    at = 0
    for b, n in enumerate(lens):
        m = -(-n // page_size)
        table[b, :m] = perm[at:at + m]
        at += m
    keys = indexer_cache.quantise_keys(torch.randn(n_pages * page_size, d, generator=g))
    values = keys.values.view(n_pages, page_size, d)
    scales = keys.scales.view(n_pages, page_size)
    rows = len(lens) * next_n
    q = torch.randn(rows, h, d, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(rows, h, generator=g)
    return values, scales, table, q, w


@pytest.mark.parametrize(("page_size", "next_n"), [(4, 1), (4, 2), (3, 2), (64, 1)])
def test_paged_logits_match_the_gathered_dense_ones(page_size: int, next_n: int) -> None:
    lens = [9, 1, 13] if page_size < 64 else [70, 5]
    values, scales, table, q, w = _paged_setup(page_size, lens, next_n)
    lens_t = torch.tensor(lens)
    row_req = torch.arange(len(lens)).repeat_interleave(next_n)
    visible = mtp_visible(lens_t, next_n)
    width = table.shape[1] * page_size
    got = paged_mqa_logits(Operand(q), values, scales, w, table, lens_t, row_req, visible, width,
                           torch.float64)
    for r in range(q.shape[0]):
        b = int(row_req[r])
        slots = (table[b][torch.arange(lens[b]) // page_size] * page_size
                 + torch.arange(lens[b]) % page_size)
        kv = values.reshape(-1, values.shape[-1])[slots]
        ks = scales.reshape(-1)[slots]
        want, _ = naive_mqa_logits(q[r:r + 1], torch.ones(1, q.shape[1]), kv, ks, w[r:r + 1],
                                   [0], [int(visible[r])], width)
        assert torch.equal(torch.isinf(got.logits[r]), torch.isinf(want[0]))
        fin = torch.isfinite(want[0])
        torch.testing.assert_close(got.logits[r][fin], want[0][fin], rtol=1e-12, atol=1e-12)


def test_mtp_rows_are_bottom_right_causal() -> None:
    assert mtp_visible(torch.tensor([5, 1]), 2).tolist() == [4, 5, 0, 1]


def test_paged_logits_never_read_a_page_tail() -> None:
    values, scales, table, q, w = _paged_setup(4, [6], 1)
    last = int(table[0, 1])
    poisoned = values.clone()
    poisoned.view(torch.uint8)[last, 2:] = 0x7F  # NaN in the tail of the last page
    lens = torch.tensor([6])
    a = paged_mqa_logits(Operand(q), values, scales, w, table, lens, torch.tensor([0]),
                         torch.tensor([6]), 8, torch.float64)
    b = paged_mqa_logits(Operand(q), poisoned, scales, w, table, lens, torch.tensor([0]),
                         torch.tensor([6]), 8, torch.float64)
    assert torch.equal(a.logits, b.logits) and not torch.isnan(b.logits).any()


def test_paged_rejects_a_row_that_sees_past_its_request() -> None:
    values, scales, table, q, w = _paged_setup(4, [6], 1)
    with pytest.raises(ValueError, match="kv_len"):
        paged_mqa_logits(Operand(q), values, scales, w, table, torch.tensor([6]),
                         torch.tensor([0]), torch.tensor([7]), 8)
