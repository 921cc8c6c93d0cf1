"""Golden (mlacheck.golden) vs an independent naive FP64 implementation (_core_naive).

The naive side reads the *logical* (unpaged) dequantised tensors, the golden "exact" side
reads through the paged pools and their page tables, so these tests check the attention math,
the bottom-right causal mask, soft cap, LSE convention and the paging at once.

Tolerances: golden FP32 vs naive FP64 at torch's default FP32 level (rtol 1.3e-6, atol 1e-5;
outputs are O(1), LSEs ~ 2..12, scores are 192/576-long fp32 dot products; measured worst
~3e-6 absolute on a 576-wide decode), and the golden in FP64 vs naive at 1e-10 relative,
which leaves no room for a wrong formula.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _core_naive import naive_attention, naive_sparse

from mlacheck import golden, inputs
from mlacheck.spec import (
    NO_YARN,
    DecodeCase,
    Paging,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
    SparseDecodeCase,
)

SEGMENTS = (Segment(5), Segment(7, context_len=9), Segment(3, context_len=20), Segment(1, 4))
REQUESTS = (Request(1, 37), Request(2, 64), Request(3, 17), Request(4, 130))


def exact(t: inputs.Quantised) -> torch.Tensor:
    """The stored values times their scale, in fp64: exact (no fp32 rounding of fp8 x scale)."""
    return t.stored.double() * t.scale.double()


def _check(gold32, gold64, out, lse) -> None:
    # torch's default fp32 tolerances (rtol 1.3e-6, atol 1e-5)
    torch.testing.assert_close(gold32.out, out.float())
    torch.testing.assert_close(gold32.lse, lse.float())
    torch.testing.assert_close(gold64.out, out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gold64.lse, lse, rtol=1e-10, atol=1e-12)


def _naive_prefill(b: inputs.PrefillInputs) -> tuple[torch.Tensor, torch.Tensor]:
    case = b.case
    q, k, v = exact(b.q), exact(b.k), exact(b.v)
    qc, kc = b.cu_seqlens_q.tolist(), b.cu_seqlens_k.tolist()
    outs, lses = [], []
    for i in range(len(case.segments)):
        o, lse = naive_attention(
            q[qc[i] : qc[i + 1]], k[kc[i] : kc[i + 1]], v[kc[i] : kc[i + 1]],
            case.softmax_scale, case.causal, case.soft_cap,
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.multiseg
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("soft_cap", [0.0, 2.0], ids=["nocap", "cap2"])
@pytest.mark.parametrize("quant", [Quant(), Quant("fp8_e4m3fn", "fp8_e4m3fn")], ids=lambda q: q.slug)
def test_prefill_matches_naive(causal: bool, soft_cap: float, quant: Quant) -> None:
    case = PrefillCase(segments=SEGMENTS, num_heads=3, causal=causal, soft_cap=soft_cap, quant=quant)
    b = inputs.build(case)
    out, lse = _naive_prefill(b)
    _check(golden.reference(b), golden.reference(b, precision="fp64"), out, lse)
    if soft_cap:
        # the cap must actually bite at this scale, or the test would not test it
        uncapped, _ = _naive_prefill(inputs.build(dataclasses.replace(case, soft_cap=0.0)))
        assert (uncapped - out).abs().max() > 1e-2


def test_causal_mask_is_bottom_right() -> None:
    """Query i of a segment with context c sees exactly kv 0..c+i: its row equals non-causal
    attention over that prefix (top-left alignment would give query 0 a single key)."""
    case = PrefillCase(segments=(Segment(3, context_len=5),), num_heads=2)
    b = inputs.build(case)
    res = golden.reference(b, precision="fp64")
    q, k, v = (exact(t) for t in (b.q, b.k, b.v))
    for i in range(3):
        prefix = naive_attention(q[i : i + 1], k[: 5 + i + 1], v[: 5 + i + 1], case.softmax_scale, False)
        torch.testing.assert_close(res.out[i], prefix[0][0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(res.lse[i], prefix[1][0], rtol=1e-10, atol=1e-12)
    top_left = naive_attention(q[:1], k[:1], v[:1], case.softmax_scale, False)[0][0]
    assert (res.out[0] - top_left).abs().max() > 1e-2


@pytest.mark.multiseg
@pytest.mark.parametrize("layout", ["linear", "vectorized"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3fnuz"])
def test_paged_prefill_matches_naive(layout: str, fmt: str) -> None:
    case = PrefillCase(
        segments=SEGMENTS, num_heads=2, quant=Quant(fmt, fmt), paging=Paging(16, layout),
        placement=Placement("shuffled", spare_pages=5),
    )
    b = inputs.build(case)
    assert b.k_pool is not None and b.k_pool.layout == layout
    out, lse = _naive_prefill(b)
    _check(golden.reference(b), golden.reference(b, precision="fp64"), out, lse)


def _naive_decode(b: inputs.DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
    case = b.case
    q = exact(b.q)
    qo = b.qo_indptr.tolist()
    rank = case.dims.kv_lora_rank
    outs, lses = [], []
    for r, kvq in enumerate(b.kv):
        kv = exact(kvq)
        o, lse = naive_attention(q[qo[r] : qo[r + 1]], kv, kv[..., :rank], case.softmax_scale, True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_mtp_matches_naive(page_size: int) -> None:
    case = DecodeCase(requests=REQUESTS, num_heads=2, page_size=page_size)
    b = inputs.build(case)
    out, lse = _naive_decode(b)
    _check(golden.reference(b), golden.reference(b, precision="fp64"), out, lse)


def test_decode_fp8_no_yarn_matches_naive() -> None:
    case = DecodeCase(
        requests=(Request(2, 50), Request(1, 3)), num_heads=3, page_size=16,
        quant=Quant("fp8_e4m3fn", "fp8_e4m3fn"), dims=NO_YARN,
    )
    b = inputs.build(case)
    out, lse = _naive_decode(b)
    _check(golden.reference(b), golden.reference(b, precision="fp64"), out, lse)


@pytest.mark.sparse
@pytest.mark.parametrize("valid_cap", [None, 5])
def test_sparse_decode_matches_naive(valid_cap: int | None) -> None:
    case = SparseDecodeCase(
        requests=(Request(1, 40), Request(3, 6), Request(2, 70)), topk=16, valid_cap=valid_cap,
        num_heads=2, page_size=16,
    )
    b = inputs.build(case)
    idx = b.topk_indices
    assert idx is not None and idx.shape == (case.total_q, 16)
    # one token with no valid index at all: defined result 0 / -inf
    idx[2] = -1
    owner, first = [], []
    for r, req in enumerate(case.requests):
        for i in range(req.q_len):
            owner.append(r)
            first.append(req.kv_len - req.q_len + i + 1)  # visible causal prefix
    valid_counts = (idx >= 0).sum(1).tolist()
    for t, row in enumerate(idx.tolist()):
        n = valid_counts[t]
        assert all(p >= 0 for p in row[:n]) and all(p == -1 for p in row[n:])  # -1 padded
        assert all(p < first[t] for p in row[:n])  # only causally visible positions
        assert len(set(row[:n])) == n
        if t != 2:
            expect = min(16, first[t]) if valid_cap is None else min(16, first[t], valid_cap)
            assert n == expect
    assert any(0 < n < 16 for n in valid_counts)  # variable lengths, -1 padding in use

    q = exact(b.q)
    rank = case.dims.kv_lora_rank
    outs, lses = [], []
    for t in range(case.total_q):
        o, lse = naive_sparse(q[t], exact(b.kv[owner[t]]), rank, idx[t].tolist(), case.softmax_scale)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.stack(outs), torch.stack(lses)
    g32 = golden.reference(b)
    _check(g32, golden.reference(b, precision="fp64"), out, lse)
    assert torch.equal(g32.out[2], torch.zeros_like(g32.out[2]))
    assert torch.isneginf(g32.lse[2]).all()
    assert torch.isfinite(g32.out).all()
    assert torch.isfinite(g32.lse[[t for t in range(case.total_q) if t != 2]]).all()


@pytest.mark.sparse
def test_sparse_all_tokens_empty() -> None:
    case = SparseDecodeCase(requests=(Request(2, 30),), topk=8, valid_cap=0, num_heads=2, page_size=1)
    b = inputs.build(case)
    assert b.topk_indices is not None and bool((b.topk_indices == -1).all())
    res = golden.reference(b)
    assert torch.equal(res.out, torch.zeros_like(res.out))
    assert torch.isneginf(res.lse).all()


def test_dispatcher_rejects_bad_arguments() -> None:
    b = inputs.build(DecodeCase(requests=(Request(1, 4),), num_heads=1, page_size=1))
    with pytest.raises(ValueError, match="variant"):
        golden.reference(b, variant="exactish")
    with pytest.raises(ValueError, match="precision"):
        golden.reference(b, precision="fp16")


def test_ideal_variant_uses_unquantised_inputs() -> None:
    case = DecodeCase(
        requests=(Request(1, 20),), num_heads=2, page_size=16, quant=Quant("fp8_e4m3fn", "fp8_e4m3fn")
    )
    b = inputs.build(case)
    rank = case.dims.kv_lora_rank
    kv = b.kv[0].ideal
    out, lse = naive_attention(b.q.ideal, kv, kv[..., :rank], case.softmax_scale, True)
    ideal = golden.reference(b, variant="ideal", precision="fp64")
    torch.testing.assert_close(ideal.out, out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ideal.lse, lse, rtol=1e-10, atol=1e-12)
    exact = golden.reference(b, precision="fp64")
    assert (exact.out - ideal.out).abs().max() > 1e-3  # fp8 really changed the inputs


# Empty segments / requests (q_len 0: repeated cu_seqlens / qo_indptr entries), before, between
# and after others, with and without cached kv: no rows of their own, nothing shifted.
EMPTY_SEGMENTS = (Segment(0, 6), Segment(5), Segment(0, 0), Segment(7, context_len=9),
                  Segment(0, 12))
EMPTY_REQUESTS = (Request(0, 0), Request(1, 37), Request(0, 20), Request(2, 64), Request(0, 0))


@pytest.mark.parametrize("paging", [None, Paging(16, "linear")], ids=["ragged", "paged"])
def test_prefill_with_empty_segments_matches_naive(paging: Paging | None) -> None:
    case = PrefillCase(segments=EMPTY_SEGMENTS, num_heads=2, paging=paging)
    b = inputs.build(case)
    assert b.cu_seqlens_q.tolist() == [0, 0, 5, 5, 12, 12]
    out, lse = _naive_prefill(b)
    assert out.shape[0] == 12
    _check(golden.reference(b), golden.reference(b, precision="fp64"), out, lse)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_with_empty_requests_matches_naive(page_size: int) -> None:
    case = DecodeCase(requests=EMPTY_REQUESTS, num_heads=2, page_size=page_size)
    b = inputs.build(case)
    assert b.qo_indptr.tolist() == [0, 0, 1, 1, 3, 3]
    assert b.table.pages_of(0).numel() == 0 and b.table.pages_of(4).numel() == 0
    out, lse = _naive_decode(b)
    _check(golden.reference(b), golden.reference(b, precision="fp64"), out, lse)


def test_a_batch_of_only_empty_requests_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one query token"):
        DecodeCase(requests=(Request(0, 5), Request(0, 0)))
    with pytest.raises(ValueError, match="at least one query token"):
        PrefillCase(segments=(Segment(0, 5),))
