"""The AITER model's prefill paths agree with mlacheck's golden: the FP8 persistent ("PS")
MHA-form prefill (multi-segment varlen with cached context, causal and not; AITER main's
partial-LSE return vs ROCm/aiter#3606) and the CK paged batch prefill (linear and
vectorized layouts, page sizes 1/16/64, bf16 and FP8 in both chips' formats, soft cap)."""

from __future__ import annotations

import pytest
import torch
from test_model_api import PS_TILE_Q, ModelBackend, model_env

import mlacheck.backends.aiter_model as aiter
from mlacheck import harness, inputs
from mlacheck.spec import Paging, PrefillCase, Quant, Segment
from mlacheck.verdict import PASS

FN = Quant("fp8_e4m3fn", "fp8_e4m3fn")
FN_UNIT = Quant("fp8_e4m3fn", "fp8_e4m3fn", scale="unit")
FNUZ = Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz")
BF16 = Quant("bf16", "bf16")

# (segments, heads, causal, quant, CUs): several segments with context, q tiles of 256
PS_CASES = [
    ((Segment(300), Segment(40, 100), Segment(600, 50)), 1, True, FN, 8),
    ((Segment(260, 30), Segment(70)), 2, False, FN_UNIT, 8),
    ((Segment(300, 60), Segment(17, 3)), 16, True, FN, 32),  # 16 clusters x 2 CUs
]


@pytest.mark.parametrize("revision", ["head", "pr3606"])
@pytest.mark.parametrize("segments,heads,causal,quant,cu", PS_CASES)
def test_ps_prefill_matches_golden(segments: tuple[Segment, ...], heads: int, causal: bool,
                                   quant: Quant, cu: int, revision: str) -> None:
    case = PrefillCase(segments=segments, num_heads=heads, causal=causal, quant=quant)
    backend = ModelBackend("gfx950", cu=cu, revision=revision)
    v = harness.run_case(case, backend)
    assert v.status == PASS, v.summary()
    sched = backend.last_schedule
    work = sched["work_info_set"][: int(sched["work_indptr"][-1])]
    assert bool((work[:, 1] >= 0).any()), "no split tile: reduce untested"
    lse_check = next(c for c in v.checks if c.name == "lse")
    if revision == "head":  # AITER main returns the partial-LSE buffer, not [T, H]
        rows = sched["reduce_partial_map"].numel() * PS_TILE_Q
        assert tuple(sched["lse"].shape) == (rows, heads) and "not checked" in lse_check.detail
        assert bool((work[:, 1] == -1).any())  # unsplit tiles write the output directly
    else:  # ROCm/aiter#3606: every work is a partial, the final LSE is returned and checked
        assert bool((work[:, 1] >= 0).all()) and "not checked" not in lse_check.detail


def test_ps_prefill_lse_at_head_leaves_unsplit_rows_unwritten() -> None:
    """The documented AITER main bug, visible: rows of tiles one CU finished have no LSE
    (NaN in the model's buffers, garbage on a GPU); #3606 writes all of them."""
    case = PrefillCase(segments=(Segment(40), Segment(600)), num_heads=1, quant=FN)
    for revision, expect_nan in (("head", True), ("pr3606", False)):
        backend = ModelBackend("gfx950", revision=revision)
        inp = inputs.build(case)
        backend.run(case, inp)
        lse = backend.last_schedule["lse"]
        assert bool(torch.isnan(lse).any()) == expect_nan


def test_ps_prefill_needs_fp8_and_gfx950() -> None:
    case = PrefillCase(segments=(Segment(64),), num_heads=1, quant=FNUZ)
    with pytest.raises(RuntimeError, match="not supported on gfx942"):
        ModelBackend("gfx942").run(case, inputs.build(case))
    bf = PrefillCase(segments=(Segment(64),), num_heads=1, quant=BF16)
    with pytest.raises(RuntimeError, match="unsupport Q dtype"):
        ModelBackend("gfx950").run(bf, inputs.build(bf))


# (segments, heads, quant, page size, layout, causal, soft cap, gfx)
BATCH_CASES = [
    ((Segment(40, 30), Segment(17, 0), Segment(64, 100)), 8, BF16, 16, "linear", True, 0.0,
     "gfx942"),
    ((Segment(33, 65), Segment(50, 7)), 4, BF16, 64, "vectorized", True, 0.0, "gfx942"),
    ((Segment(30, 20), Segment(25, 40)), 4, BF16, 1, "linear", False, 30.0, "gfx942"),
    ((Segment(40, 24), Segment(9, 60)), 4, FNUZ, 16, "vectorized", True, 0.0, "gfx942"),
    ((Segment(20, 80), Segment(44, 3)), 8, FN, 64, "linear", True, 0.0, "gfx950"),
]


@pytest.mark.parametrize("segments,heads,quant,page_size,layout,causal,cap,gfx", BATCH_CASES)
def test_batch_prefill_matches_golden(segments: tuple[Segment, ...], heads: int, quant: Quant,
                                      page_size: int, layout: str, causal: bool, cap: float,
                                      gfx: str) -> None:
    case = PrefillCase(segments=segments, num_heads=heads, quant=quant, causal=causal,
                       soft_cap=cap, paging=Paging(page_size, layout))
    v = harness.run_case(case, ModelBackend(gfx))
    assert v.status == PASS, v.summary()


def test_batch_prefill_page_tables_and_layouts_agree() -> None:
    """Paged 4-D linear pages, in shuffled order, through the sglang-style indptr table and
    through the vLLM block_table give the result of one-token pages; a missing
    kv_last_page_lens is refused. The 3-D (page size 1) layout is refused when q/k and v head
    sizes differ (AITER's Python check compares K's and V's dim 2), as in MLA's 192 / 128."""
    with model_env("gfx942"):
        torch.manual_seed(0)
        heads, d, dv, lens, q_lens = 4, 64, 32, [37, 20], [5, 20]
        q = torch.randn(sum(q_lens), heads, d).bfloat16()
        k = torch.randn(sum(lens), heads, d).bfloat16()
        v = torch.randn(sum(lens), heads, dv).bfloat16()
        cu_q = torch.tensor([0, 5, 25], dtype=torch.int32)
        tok = torch.tensor([0, 37, 57], dtype=torch.int32)
        common = dict(max_seqlen_q=20, max_seqlen_k=37, causal=True, return_lse=True)
        with pytest.raises(ValueError, match="must match page size and head count"):
            aiter.mha_batch_prefill_func(q, k, v, cu_q, tok, torch.arange(57, dtype=torch.int32),
                                         **common)
        ref, ref_lse = aiter.mha_batch_prefill_func(
            q, k.unsqueeze(1), v.unsqueeze(1), cu_q, tok, torch.arange(57, dtype=torch.int32),
            **common)
        ps = 16
        pages = [(n + ps - 1) // ps for n in lens]  # 3 + 2 pages, request 0 then 1
        k4 = torch.zeros(sum(pages), ps, heads, d).bfloat16()
        v4 = torch.zeros(sum(pages), ps, heads, dv).bfloat16()
        order = torch.tensor([3, 0, 4, 1, 2])  # physical page of each logical page
        start = 0
        for r, n in enumerate(lens):
            blk_k = torch.zeros(pages[r] * ps, heads, d).bfloat16()
            blk_v = torch.zeros(pages[r] * ps, heads, dv).bfloat16()
            blk_k[:n], blk_v[:n] = k[start:start + n], v[start:start + n]
            first = sum(pages[:r])
            k4[order[first:first + pages[r]]] = blk_k.view(pages[r], ps, heads, d)
            v4[order[first:first + pages[r]]] = blk_v.view(pages[r], ps, heads, dv)
            start += n
        indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
        ids = order.to(torch.int32)
        last = torch.tensor([37 - 32, 20 - 16], dtype=torch.int32)
        out, lse = aiter.mha_batch_prefill_func(q, k4, v4, cu_q, indptr, ids,
                                                kv_last_page_lens=last, **common)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(lse, ref_lse)
        table = torch.tensor([[3, 0, 4], [1, 2, 0]], dtype=torch.int32)
        out_bt, _ = aiter.mha_batch_prefill_func(q, k4, v4, cu_q, indptr, ids, block_table=table,
                                                 seqlen_k=torch.tensor(lens, dtype=torch.int32),
                                                 **common)
        torch.testing.assert_close(out_bt, ref)
        with pytest.raises(RuntimeError, match="must pass kv_last_page_lens"):
            aiter.mha_batch_prefill_func(q, k4, v4, cu_q, indptr, ids, **common)
