"""FP32 golden vs FP64 golden, and the golden's memory-bounded blocking.

FP32 vs FP64 bound. The FP32 golden's error is dominated by the score dot products (length
D = 576 for decode, 192 for prefill); softmax and the P·V sums (weights summing to 1) add
little. With u = 2^-24 ≈ 6e-8, a typical length-D fp32 dot product error is ~u·sqrt(D)·|terms|
(SIMD/blocked summation), i.e. for the V3 decode u·24·|q·k|max·scale ≈ 6e-8·24·~100·0.135 ≈
2e-5 on the largest scores and ~3e-6 typical; the LSE moves by the score error, a row's output
by about the score error times |v|/|out|. Bounds (about 4x the worst measured value):
  tensor-wide  max|err| / max|out|               < 2e-5
  per row      max|err_row| / max|out_row|       < 5e-5   (row = token x head)
  LSE          max|lse32 - lse64|                < 3e-5
Measured on this CPU (x86-64, torch 2.13; `pytest -s` prints them), seeds 0..2:
  decode 2 x 4096 kv, 16 heads, bf16:  tensor 3.0e-6..5.3e-6, row 4.1e-6..7.4e-6, lse 2.1e-6..4.8e-6
  decode 4096 kv MTP2, fp8 e4m3fn:     tensor 3.5e-6..5.4e-6, row 5.5e-6..9.5e-6, lse 3.2e-6..9.1e-6
  prefill 3 segments (ctx 300, 0, 1000): tensor 4.5e-7..8.3e-7, row 1.7e-6..2.6e-6, lse ~1.2e-6
"""

from __future__ import annotations

import pytest
import torch

from mlacheck import golden, inputs
from mlacheck.golden import core, decode
from mlacheck.spec import (
    DecodeCase,
    PrefillCase,
    Quant,
    Request,
    Segment,
    SparseDecodeCase,
)

REL_TENSOR = 2e-5
REL_ROW = 5e-5
LSE_ABS = 3e-5

PRECISION_CASES = {
    "decode-4096": DecodeCase(requests=(Request(1, 4096), Request(3, 4096)), num_heads=16, page_size=64),
    "decode-4096-fp8": DecodeCase(
        requests=(Request(2, 4096),), num_heads=16, page_size=16,
        quant=Quant("fp8_e4m3fn", "fp8_e4m3fn"),
    ),
    "prefill-multiseg": PrefillCase(
        segments=(Segment(100, 300), Segment(37), Segment(64, 1000)), num_heads=8
    ),
    "prefill-full-cap": PrefillCase(
        segments=(Segment(50, 200), Segment(20)), num_heads=4, causal=False, soft_cap=20.0
    ),
}


@pytest.mark.parametrize("name", list(PRECISION_CASES))
def test_fp32_golden_close_to_fp64(name: str) -> None:
    b = inputs.build(PRECISION_CASES[name])
    r32 = golden.reference(b, precision="fp32")
    r64 = golden.reference(b, precision="fp64")
    assert r32.out.dtype == torch.float32 and r64.out.dtype == torch.float64
    assert torch.isfinite(r64.out).all() and torch.isfinite(r64.lse).all()
    err = (r32.out.double() - r64.out).abs()
    tensor_rel = float(err.max() / r64.out.abs().max())
    row_rel = float((err.amax(-1) / r64.out.abs().amax(-1)).max())
    lse_abs = float((r32.lse.double() - r64.lse).abs().max())
    print(f"\n[fp32 vs fp64 {name}] tensor rel {tensor_rel:.2e}, worst row rel {row_rel:.2e}, "
          f"lse abs {lse_abs:.2e}")
    assert 0 < tensor_rel < REL_TENSOR  # > 0: the fp32 run really ran in fp32
    assert row_rel < REL_ROW
    assert lse_abs < LSE_ABS


# --------------------------------------------------------------------------- blocking

BUDGET = 4096


def _spy_block_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the size of every score block the golden materialises (each goes through the
    in-place softmax once)."""
    sizes: list[int] = []
    real = core._softmax_in_place

    def spy(s: torch.Tensor) -> torch.Tensor:
        sizes.append(s.numel())
        return real(s)

    monkeypatch.setattr(core, "_softmax_in_place", spy)
    return sizes


@pytest.mark.parametrize("mqa", [False, True], ids=["mha", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_blocked_attend_equals_unblocked(
    mqa: bool, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(1)
    h, sq, sk, d, dv = 16, 24, 300, (576 if mqa else 192), (512 if mqa else 128)
    hk = 1 if mqa else h
    q = torch.randn(sq, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sk, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(sk, hk, dv, generator=g, dtype=torch.float64)
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 1e-5)):
        qq, kk, vv = q.to(dtype), k.to(dtype), v.to(dtype)
        full = core.attend(qq, kk, vv, 0.1, causal, soft_cap=15.0)
        sizes = _spy_block_sizes(monkeypatch)
        blocked = core.attend(qq, kk, vv, 0.1, causal, soft_cap=15.0, budget=BUDGET)
        monkeypatch.undo()
        assert len(sizes) > 10 and max(sizes) <= BUDGET  # really blocked, within the budget
        scale = float(full.out.abs().max())
        torch.testing.assert_close(blocked.out, full.out, rtol=0, atol=tol * scale)
        torch.testing.assert_close(blocked.lse, full.lse, rtol=0, atol=tol * 10)


def test_blocked_golden_prefill_and_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole reference (multi-segment prefill, MTP decode, sparse decode) run with a tiny
    score budget equals the default run (FP64: equal up to summation order)."""
    cases = [
        PrefillCase(segments=(Segment(30, 100), Segment(7), Segment(12, 40)), num_heads=4),
        DecodeCase(requests=(Request(3, 500), Request(1, 64)), num_heads=16, page_size=16),
    ]
    for case in cases:
        b = inputs.build(case)
        ref = golden.reference(b, precision="fp64")
        with monkeypatch.context() as m:
            m.setattr(core, "score_block_elements", lambda dtype: BUDGET)
            blocked = golden.reference(b, precision="fp64")
        torch.testing.assert_close(blocked.out, ref.out, rtol=0, atol=1e-13)
        torch.testing.assert_close(blocked.lse, ref.lse, rtol=0, atol=1e-12)

    sparse = SparseDecodeCase(
        requests=(Request(2, 300), Request(1, 20)), topk=64, num_heads=16, page_size=16
    )
    b = inputs.build(sparse)
    ref = decode.sparse_reference(b, dtype=torch.float64)
    sizes = _spy_block_sizes(monkeypatch)
    blocked = decode.sparse_reference(b, dtype=torch.float64, budget=1024)
    monkeypatch.undo()
    assert sizes == [1024] * 3  # one token (16 heads x topk 64) per block
    torch.testing.assert_close(blocked.out, ref.out, rtol=0, atol=1e-13)
    torch.testing.assert_close(blocked.lse, ref.lse, rtol=0, atol=1e-12)


def test_nan_in_masked_kv_does_not_leak_into_other_rows() -> None:
    """A NaN in V at a position a query cannot see must not reach that query's row, whatever
    the blocking (a plain p @ v gives 0 * NaN = NaN); rows that see it are NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, n, generator=g) for n in (8, 8, 4))
    v[3] = float("nan")  # only query 3 sees kv 3 (causal, q_len == kv_len)
    for budget in (core.score_block_elements(torch.float32), 4):
        res = core.attend(q, k, v, 0.3, causal=True, budget=budget)
        assert torch.isfinite(res.out[:3]).all(), budget
        assert torch.isnan(res.out[3]).all(), budget
    q[1, 0, 0] = float("nan")  # a NaN query shows in its own row only (output and LSE)
    res = core.attend(q, k, v.nan_to_num(), 0.3, causal=False)
    assert torch.isnan(res.out[1, 0]).all() and torch.isnan(res.lse[1, 0])
    assert torch.isfinite(res.out[[0, 2, 3]]).all() and torch.isfinite(res.out[1, 1]).all()


def test_fp64_golden_dequantises_fp8_exactly() -> None:
    """An FP8 value times an amax scale rounds in fp32; the fp64 reference must multiply in
    fp64 (the audit saw ~2e-7 differences when it went through fp32 first)."""
    from mlacheck.golden.core import Operand

    case = DecodeCase(requests=(Request(1, 300),), num_heads=4,
                      quant=Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax"))
    b = inputs.build(case)
    kv = b.pool.gather(0, dequant=False)
    exact = kv.double() * b.pool.scale.double()
    got = Operand(kv, float(b.pool.scale)).get(torch.float64)
    assert torch.equal(got, exact)
    assert not torch.equal((kv.float() * b.pool.scale).double(), exact)  # in fp32 it rounds


def _sparse_fp64(b: inputs.DecodeInputs, topk: torch.Tensor, dequant_in_fp32: bool) -> core.Result:
    """Sparse decode from first principles: stored q / kv times their scales (in fp64, or in
    fp32 first as the audit found), one token at a time over its valid top-k positions."""
    def deq(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (stored.float() * scale).double() if dequant_in_fp32 else stored.double() * scale.double()

    case = b.case
    q = deq(b.q.stored, b.q.scale)
    kvs = [deq(b.pool.gather(r, dequant=False), b.pool.scale)[:, 0] for r in range(len(case.requests))]
    owner = [r for r, req in enumerate(case.requests) for _ in range(req.q_len)]
    rank = case.dims.kv_lora_rank
    outs, lses = [], []
    for t, idx in enumerate(topk.long()):
        kv = kvs[owner[t]][idx[idx >= 0]]
        s = q[t] @ kv.T * case.softmax_scale
        outs.append(torch.softmax(s, -1) @ kv[:, :rank])
        lses.append(torch.logsumexp(s, -1))
    return core.Result(torch.stack(outs), torch.stack(lses))


@pytest.mark.parametrize("op", ["decode", "sparse"])
def test_fp64_golden_reference_matches_fp64_dequantisation(op: str) -> None:
    """The whole fp64 reference (dense and sparse decode) sees q and kv dequantised in fp64:
    it matches a first-principles fp64 computation to fp64 roundoff (1e-12), while the same
    computation on fp32-dequantised inputs is ~1e-7 away (the gap the audit found)."""
    quant = Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax")
    reqs = (Request(2, 300), Request(1, 90))
    case = (SparseDecodeCase(requests=reqs, topk=128, num_heads=4, page_size=16, quant=quant)
            if op == "sparse" else DecodeCase(requests=reqs, num_heads=4, page_size=16, quant=quant))
    b = inputs.build(case)
    if b.topk_indices is not None:
        topk = b.topk_indices
    else:  # dense decode: every position up to the causal limit, as a full sparse row
        visible = [torch.arange(r.kv_len - r.q_len + i + 1) for r in reqs for i in range(r.q_len)]
        topk = torch.nn.utils.rnn.pad_sequence(visible, batch_first=True, padding_value=-1)
    ideal, rounded = _sparse_fp64(b, topk, False), _sparse_fp64(b, topk, True)
    ref = golden.reference(b, precision="fp64")
    assert ref.out.dtype == torch.float64
    torch.testing.assert_close(ref.out, ideal.out, rtol=0, atol=1e-12)
    torch.testing.assert_close(ref.lse, ideal.lse, rtol=0, atol=1e-12)
    assert (rounded.out - ideal.out).abs().max() > 1e-9  # the test can tell the two apart
