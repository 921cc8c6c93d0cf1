"""mlacheck.backends.aiter.metadata: it accepts the (model's) AITER schedules of many random batches and
rejects planted corruptions with a message that says what is wrong and where."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_model_api import alloc, model_env

import mlacheck.backends.aiter_model as aiter
from mlacheck.backends.aiter import rules
from mlacheck.backends.aiter.metadata import validate_mla_metadata, validate_ps_metadata
from mlacheck.backends.aiter_model._metadata import (
    KV_END,
    KV_START,
    PARTIAL_QO_LOC,
    QO_START,
)

BF16 = torch.bfloat16
DTYPES = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}


@dataclass
class Built:
    bufs: dict[str, torch.Tensor]
    batch: dict[str, Any]  # what validate_mla_metadata needs besides the buffers

    def validate(self, **override: Any) -> list[str]:
        return validate_mla_metadata(**{**self.bufs, **self.batch, **override})

    @property
    def works(self) -> torch.Tensor:
        return self.bufs["work_info_set"][: int(self.bufs["work_indptr"][-1])]


def build(gfx: str = "gfx942", heads: int = 16, q_lens: list[int] | None = None,
          kv_lens: list[int] | None = None, page_size: int = 1, fp8: bool = False,
          topk: int | None = None, cu: int = 8, kv_granularity: int | None = None,
          max_split_per_batch: int = 32, planner_topk: int | None = None,
          planner_q_len: int | None = None, info_q_len: int | None = None) -> Built:
    """The model's schedule for a batch, plus the batch description (planner_* / info_*
    override what the planner / sizing are told, to plant mistakes)."""
    q_lens = q_lens or [1, 1, 1]
    kv_lens = kv_lens or [300, 90, 700]
    with model_env(gfx, cu):
        dt = DTYPES[gfx] if fp8 else BF16
        pages = [math.ceil(n / page_size) for n in kv_lens]
        kv_indptr = torch.tensor([0, *torch.cumsum(torch.tensor(pages), 0).tolist()],
                                 dtype=torch.int32)
        last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages, strict=True)],
                            dtype=torch.int32)
        qo = torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()], dtype=torch.int32)
        max_q = max(q_lens)
        sparse = topk is not None
        p_topk = topk if planner_topk is None else planner_topk
        info = aiter.get_mla_metadata_info_v1(len(q_lens), info_q_len or max_q, heads, dt, dt,
                                              is_sparse=sparse,
                                              max_split_per_batch=max_split_per_batch)
        big = aiter.get_mla_metadata_info_v1(len(q_lens), max(max_q, info_q_len or 0) * 4,
                                             heads, dt, dt, is_sparse=True,
                                             max_split_per_batch=max_split_per_batch)
        bufs = alloc(big if info_q_len else info)
        gran = kv_granularity or max(page_size, 16)
        plan_q = planner_q_len or (1 if p_topk is not None and p_topk >= 0 else max_q)
        uni = plan_q if planner_q_len or len(set(q_lens)) == 1 else -1
        aiter.get_mla_metadata_v1(
            qo, kv_indptr, last, heads, 1, True, bufs["work_metadata_ptrs"],
            bufs["work_info_set"], bufs["work_indptr"], bufs["reduce_indptr"],
            bufs["reduce_final_map"], bufs["reduce_partial_map"], page_size=page_size,
            kv_granularity=gran, max_seqlen_qo=plan_q,
            uni_seqlen_qo=1 if p_topk is not None and p_topk >= 0 else uni,
            topk=-1 if p_topk is None else p_topk, max_split_per_batch=max_split_per_batch,
            dtype_q_nope=dt, dtype_kv_nope=dt)
    batch = dict(qo_indptr=qo, kv_indptr=kv_indptr, kv_last_page_lens=last,
                 page_size=page_size, num_heads=heads, max_seqlen_qo=1 if sparse else plan_q,
                 topk=topk, info_sizes=info, gfx=gfx, q_dtype=dt, kv_dtype=dt,
                 kv_granularity=gran, uni_seqlen_qo=None if sparse else uni)
    return Built(bufs, batch)


@st.composite
def batches(draw: st.DrawFn) -> dict[str, Any]:
    gfx = draw(st.sampled_from(["gfx942", "gfx950"]))
    fp8 = draw(st.booleans())
    heads = draw(st.sampled_from([16, 16, 32, 48, 64, 128]))
    sparse = draw(st.booleans()) and draw(st.booleans())
    n = draw(st.integers(1, 6))
    q_lens = [draw(st.integers(1, 4)) for _ in range(n)]
    if sparse or draw(st.booleans()):
        q_lens = [q_lens[0]] * n
    fold = rules.head_fold(gfx, heads, 1 if sparse else max(q_lens), fp8, fp8)
    # Head folding needs one q length for all requests (AITER reads qo_indptr with the
    # pseudo-batch index otherwise) and, with pages, AITER stores a wrong kv_offset
    # (test_model_decode::test_folded_heads_with_pages...): both are AITER limits, not drawn.
    if fold > 1:
        q_lens = [max(q_lens)] * n
    page_size = 1 if sparse or fold > 1 else draw(st.sampled_from([1, 16, 64]))
    kv_lens = [draw(st.integers(ql, draw(st.sampled_from([40, 400, 3000])))) for ql in q_lens]
    return dict(gfx=gfx, fp8=fp8, heads=heads, q_lens=q_lens, kv_lens=kv_lens,
                page_size=page_size, topk=draw(st.sampled_from([64, 2048])) if sparse else None,
                cu=draw(st.integers(1, 16)),
                kv_granularity=draw(st.sampled_from([None, 1, 4, 32])),
                max_split_per_batch=draw(st.sampled_from([-1, 1, 2, 32])))


@settings(max_examples=60, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_validator_accepts_model_schedules(params: dict[str, Any]) -> None:
    assert build(**params).validate() == []


# --------------------------------------------------------------------------- corruptions


def _split_tile_works(b: Built) -> list[int]:
    """Works of split tiles (partial_qo_loc >= 0), in order."""
    return [w for w in range(b.works.shape[0]) if int(b.works[w, PARTIAL_QO_LOC]) >= 0]


def _drop_work(b: Built, w: int) -> None:
    rows = b.bufs["work_info_set"]
    rows[w:-1] = rows[w + 1:].clone()
    ind = b.bufs["work_indptr"]
    ind[ind > w] -= 1


def test_a_dropped_work_is_named() -> None:
    b = build(q_lens=[1, 1, 1, 1], kv_lens=[40, 1200, 60, 50])
    direct = [w for w in range(b.works.shape[0]) if int(b.works[w, PARTIAL_QO_LOC]) == -1]
    w = direct[-1]
    row = int(b.works[w, QO_START])
    _drop_work(b, w)
    msgs = b.validate()
    assert f"query rows {row} (request {row} token 0) are covered by no work" in msgs, msgs


def test_a_dropped_split_fragment_loses_kv() -> None:
    b = build(q_lens=[1, 1], kv_lens=[40, 1200])
    w = _split_tile_works(b)[0]
    ks, ke = int(b.works[w, KV_START]), int(b.works[w, KV_END])
    _drop_work(b, w)
    msgs = b.validate()
    lo = int(b.batch["kv_indptr"][1])
    assert f"query rows 1 (request 1 token 0): kv tokens {ks - lo}-{ke - lo - 1} covered by no " \
           "work" in msgs, msgs
    assert any("which no work writes" in m for m in msgs)


def test_an_overlapping_kv_range_is_named() -> None:
    b = build(q_lens=[1, 1], kv_lens=[40, 1200])
    w = _split_tile_works(b)[0]
    b.bufs["work_info_set"][w, KV_END] += 16
    msgs = b.validate()
    assert any("covered more than once" in m and f"works {w}, {w + 1}" in m for m in msgs), msgs


def test_a_kv_range_outside_its_request_is_named() -> None:
    b = build(q_lens=[1, 1, 1], kv_lens=[300, 90, 700], page_size=16, kv_granularity=1)
    w = max(w for w in range(b.works.shape[0]) if int(b.works[w, 0]) == 2)  # request's end
    b.bufs["work_info_set"][w, KV_END] += 4
    lo = int(b.batch["kv_indptr"][2])
    ks, ke = int(b.works[w, KV_START]) - lo, int(b.works[w, KV_END]) - lo
    msgs = b.validate()
    assert any(m.startswith(f"work {w} on CU ") and f"covers kv pages {ks}-{ke - 1} of request 2,"
               " which has 44 pages" in m for m in msgs), msgs


def test_a_reused_partial_row_is_named() -> None:
    b = build(q_lens=[2, 2], kv_lens=[900, 1200])
    first, second = _split_tile_works(b)[:2]
    b.bufs["work_info_set"][second, PARTIAL_QO_LOC] = b.works[first, PARTIAL_QO_LOC]
    p = int(b.works[first, PARTIAL_QO_LOC])
    msgs = b.validate()
    assert any(m.startswith(f"partial row {p} is written by work {first} and work {second}")
               for m in msgs), msgs


def test_a_reduce_tile_listing_a_partial_twice_is_named() -> None:
    b = build(q_lens=[1, 1], kv_lens=[40, 1200])
    rptr = b.bufs["reduce_indptr"]
    t = next(t for t in range(rptr.numel() - 1) if int(rptr[t + 1] - rptr[t]) >= 2)
    pmap = b.bufs["reduce_partial_map"]
    pmap[int(rptr[t]) + 1] = pmap[int(rptr[t])]
    msgs = b.validate()
    assert f"reduce tile {t} lists partial row {int(pmap[int(rptr[t])])} twice" in msgs, msgs
    assert any("that no reduce tile merges" in m for m in msgs)


def test_sparse_buffers_filled_dense_are_named() -> None:
    """bug class 3: buffers sized with is_sparse=True, planner called without topk."""
    b = build(q_lens=[2, 2], kv_lens=[300, 500], topk=2048, planner_topk=-1)
    msgs = b.validate()
    assert any("with top-k every query token is its own pseudo-batch" in m for m in msgs), msgs


def test_metadata_for_q_len_1_used_with_q_len_4_is_named() -> None:
    """bug class 9: the planner told max_seqlen_qo = uni_seqlen_qo = 1 for an MTP batch
    covers one token per request; with 128 fp8 heads the q_len-1 sizes are also too small."""
    b = build(q_lens=[4, 4], kv_lens=[300, 500], planner_q_len=1)
    msgs = b.validate()
    assert "request 0 has 4 query tokens but the metadata was built for max_seqlen_qo 1 " \
           "(metadata sized for a shorter q_len?)" in msgs, msgs
    assert any("uni_seqlen_qo=1 but request 0 has 4 query tokens" in m for m in msgs)
    assert any("are covered by no work" in m for m in msgs)
    b = build(heads=128, fp8=True, q_lens=[4, 4], kv_lens=[300, 500], info_q_len=1)
    msgs = b.validate()
    assert any("get_mla_metadata_info_v1 sizes reduce_indptr for 3 entries" in m
               for m in msgs), msgs


def test_metadata_of_another_batch_is_named() -> None:
    """bug class 10: a schedule reused for a batch with longer contexts."""
    old = build(q_lens=[1, 1, 1], kv_lens=[300, 90, 700])
    new = build(q_lens=[1, 1, 1], kv_lens=[300, 190, 700])
    msgs = validate_mla_metadata(**{**old.bufs, **new.batch})
    assert any("query rows 1 (request 1 token 0): kv tokens 90-189 covered by no work" in m
               for m in msgs), msgs
    assert any("covers kv tokens" in m and "of request 2, which has 700 tokens" in m
               or "kv_offset" in m for m in msgs)


def test_single_partial_tiles_are_skipped_at_aiter_main() -> None:
    b = build(q_lens=[1, 1], kv_lens=[40, 1200])
    rptr = b.bufs["reduce_indptr"]
    t = next(t for t in range(rptr.numel() - 1) if int(rptr[t + 1] - rptr[t]) >= 2)
    rptr[t + 1:] -= int(rptr[t + 1] - rptr[t]) - 1  # keep the first partial only
    msgs = b.validate()
    assert any(f"reduce tile {t} lists a single partial" in m and "never written" in m
               for m in msgs), msgs


# --------------------------------------------------------------------------- PS prefill


def ps_build(segments: list[tuple[int, int]], heads: int, causal: bool = True, cu: int = 8,
             revision: str = "head") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with model_env("gfx950", cu, revision):
        qo = torch.tensor([0, *torch.cumsum(torch.tensor([q for q, _ in segments]), 0).tolist()],
                          dtype=torch.int32)
        kv = torch.tensor([0, *torch.cumsum(torch.tensor([q + c for q, c in segments]),
                                            0).tolist()], dtype=torch.int32)
        ctx = kv[1:] - kv[:-1]
        info = aiter.get_ps_metadata_info_v1(len(segments), heads, max(q for q, _ in segments))
        bufs = alloc(info)
        aiter.get_ps_metadata_v1(qo, kv, ctx, 1, heads, bufs["work_metadata_ptrs"],
                                 bufs["work_indptr"], bufs["work_info_set"],
                                 bufs["reduce_indptr"], bufs["reduce_final_map"],
                                 bufs["reduce_partial_map"], qlen_granularity=256,
                                 kvlen_granularity=128, block_size=1, is_causal=causal)
    del bufs["work_metadata_ptrs"]
    return bufs, dict(qo_indptr=qo, kv_indptr=kv, context_lens=ctx, num_heads_k=heads,
                      is_causal=causal, info_sizes=info, reduce_single_partials=revision != "head")


@pytest.mark.parametrize("segments,heads,causal,cu,revision", [
    ([(300, 0), (40, 100), (600, 50)], 1, True, 8, "head"),
    ([(300, 0), (40, 100), (600, 50)], 2, False, 8, "head"),
    ([(700, 300), (5, 0)], 16, True, 48, "head"),
    ([(300, 0), (40, 100), (600, 50)], 4, True, 6, "pr3606"),
    ([(1000, 0)], 1, True, 3, "pr3606"),
])
def test_ps_validator_accepts_model_schedules(segments: list[tuple[int, int]], heads: int,
                                              causal: bool, cu: int, revision: str) -> None:
    bufs, batch = ps_build(segments, heads, causal, cu, revision)
    assert validate_ps_metadata(**bufs, **batch) == []


def test_ps_corruptions_are_named() -> None:
    bufs, batch = ps_build([(300, 0), (40, 100), (600, 50)], 2, cu=8, revision="pr3606")
    batch["reduce_single_partials"] = False  # #3606 schedules under AITER main's reduce
    msgs = validate_ps_metadata(**bufs, **batch)
    assert any("lists a single partial" in m for m in msgs), msgs
    bufs, batch = ps_build([(300, 0), (40, 100), (600, 50)], 2, cu=8)
    works = bufs["work_info_set"]
    n = int(bufs["work_indptr"][-1])
    w = next(w for w in range(n) if int(works[w, PARTIAL_QO_LOC]) >= 0
             and int(works[w, 7]) >> 16 == 2)  # a split fragment of head 1
    works[w, 7] = (1 << 16) | 0  # now claims head 0
    msgs = validate_ps_metadata(**bufs, **batch)
    assert any("covered more than once" in m and "head 0" in m for m in msgs), msgs
    assert any("no work writes it for heads 1" in m for m in msgs), msgs
    bufs, batch = ps_build([(300, 0), (40, 100), (600, 50)], 1, cu=8)
    ind = bufs["work_indptr"]
    ind[ind == int(ind[-1])] -= 1  # the last work is dropped
    msgs = validate_ps_metadata(**bufs, **batch)
    assert any("covered by no work" in m or "merged by no reduce tile" in m for m in msgs), msgs
