"""The AITER model runs works of one shape as one batched launch sequence: same results
(up to fp32 reassociation), same verdicts and the same refusals as one work at a time.

Sparse prefill is persistent decode with a work per query token (16k works of 2048 keys in
the nightly): one by one, the model's kernel phase was launch-bound on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from test_model_api import ModelBackend, model_env

from mlacheck import harness
from mlacheck.backends.aiter_model import _kernels
from mlacheck.spec import DecodeCase, Placement, Quant, Request, SparseDecodeCase
from mlacheck.verdict import PASS

BF16 = Quant("bf16", "bf16")
HEADS, D, DV = 16, 576, 512
BATCHED = _kernels.BATCH_ELEMENTS  # 0: one work per launch sequence


def _stage1(works: list[list[int]], indptr: list[int], kv_indices: torch.Tensor,
            batched: bool, monkeypatch: pytest.MonkeyPatch, keep_knob: bool = False
            ) -> dict[str, torch.Tensor]:
    """Stage 1 over a hand-written schedule on two query tokens and a 100-page KV; returns
    the buffers it wrote (NaN where nothing was written)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, D, generator=gen).to(torch.bfloat16)
    kv = torch.randn(100, 1, 1, D, generator=gen).to(torch.bfloat16)
    bufs = dict(split_data=torch.full((2, 1, HEADS, DV), float("nan")),
                split_lse=torch.full((2, 1, HEADS, 1), float("nan")),
                output=torch.full((2, HEADS, DV), float("nan"), dtype=torch.bfloat16),
                lse=torch.full((2, HEADS), float("nan")))
    if not keep_knob:
        monkeypatch.setattr(_kernels, "BATCH_ELEMENTS", BATCHED if batched else 0)
    with model_env("gfx950"):  # has a persistent 16-head kernel with LSE
        _kernels.mla_decode_stage1_asm_fwd(
            q, kv, torch.tensor([0, 1, 2], dtype=torch.int32),
            torch.tensor([0, 50, 100], dtype=torch.int32), kv_indices,
            torch.ones(2, dtype=torch.int32), None, None, torch.tensor(indptr, dtype=torch.int32),
            torch.tensor(works, dtype=torch.int32), 1, 1, 1, 0.05, bufs["split_data"],
            bufs["split_lse"], bufs["output"], bufs["lse"])
    return bufs


# [batch, partial_qo_loc, qo_start, qo_end, kv_start, kv_end, kv_offset, pad]: token 0 whole,
# token 1 in two equal fragments (partials), -1 padding inside both fragments
WORKS = [[0, -1, 0, 1, 0, 50, 0, 0], [1, 0, 1, 2, 50, 75, 25, 0], [1, 1, 1, 2, 75, 100, 0, 0]]


def _padded_indices() -> torch.Tensor:
    idx = torch.arange(100, dtype=torch.int32).flip(0)
    idx[[60, 61, 90]] = -1
    return idx


def test_batched_works_match_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = _kernels._attend_batch
    monkeypatch.setattr(_kernels, "_attend_batch",
                        lambda geo, works: calls.append(len(works)) or real(geo, works))
    one = _stage1(WORKS, [0, 1, 3], _padded_indices(), False, monkeypatch)
    assert calls == [1, 1, 1]
    calls.clear()
    batched = _stage1(WORKS, [0, 1, 3], _padded_indices(), True, monkeypatch)
    assert sorted(calls) == [1, 2]  # the two fragments share one launch sequence
    _assert_same(batched, one)
    assert not batched["split_data"].isnan().any()  # every partial row was written
    assert not batched["output"][0].isnan().any()  # token 1's output is the reduce's


def test_a_batch_bounds_the_q_it_gathers_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for two fragments' KV (25 keys each) is not room for their 16 q rows as well."""
    calls: list[int] = []
    real = _kernels._attend_batch
    monkeypatch.setattr(_kernels, "_attend_batch",
                        lambda geo, works: calls.append(len(works)) or real(geo, works))
    monkeypatch.setattr(_kernels, "BATCH_ELEMENTS", 2 * 25 * D)
    _stage1(WORKS, [0, 1, 3], _padded_indices(), True, monkeypatch, keep_knob=True)
    assert calls == [1, 1, 1]


def test_a_fragment_with_every_key_padded_sees_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    idx = _padded_indices()
    idx[50:75] = -1  # fragment 1 (batched with fragment 2) sees no key: LSE -inf, output 0
    batched = _stage1(WORKS, [0, 1, 3], idx, True, monkeypatch)
    one = _stage1(WORKS, [0, 1, 3], idx, False, monkeypatch)
    assert bool(torch.isneginf(batched["split_lse"][0]).all())
    assert bool((batched["split_data"][0] == 0).all())
    _assert_same(batched, one)


def _assert_same(batched: dict[str, torch.Tensor], one: dict[str, torch.Tensor]) -> None:
    """fp32 buffers at fp32 tolerance; the bf16 output within its own rounding."""
    for name, want in one.items():
        tol = {} if want.dtype == torch.bfloat16 else dict(rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(batched[name], want, equal_nan=True, **tol)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("change,indptr,message", [
    # an earlier work's bad partial rows win over a later work's bad kv range
    ({1: {1: 5}, 2: {5: 101}}, [0, 1, 3], "partial rows 5-5 outside the 2-row partial buffer"),
    ({2: {5: 101}}, [0, 1, 3], r"kv_indices\[75:101\] outside its 100 entries"),
    ({}, [0, 1, 5], "CU 1 reads work 3 outside work_info_set"),
    ({1: {3: 3}}, [0, 1, 3], "query rows 1-2 outside q's 2 rows"),
])
def test_out_of_bounds_work_is_refused_after_the_works_before_it(
        change: dict[int, dict[int, int]], indptr: list[int], message: str, batched: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    works = [list(w) for w in WORKS]
    for w, fields in change.items():
        for field, value in fields.items():
            works[w][field] = value
    with pytest.raises(RuntimeError, match=message):
        _stage1(works, indptr, _padded_indices(), batched, monkeypatch)


@pytest.mark.parametrize("batched", [False, True])
def test_bad_page_id_is_refused_with_its_value(batched: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    idx = _padded_indices()
    idx[80] = 200
    with pytest.raises(RuntimeError, match="kv index 200 is outside the 100-page buffer"):
        _stage1(WORKS, [0, 1, 3], idx, batched, monkeypatch)


def test_works_before_a_refusal_still_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """As one by one: the kernel ran the works before the bad one."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, D, generator=gen).to(torch.bfloat16)
    kv = torch.randn(100, 1, 1, D, generator=gen).to(torch.bfloat16)
    out = torch.full((2, HEADS, DV), float("nan"), dtype=torch.bfloat16)
    works = [list(w) for w in WORKS]
    works[2][5] = 101
    with model_env("gfx942"), pytest.raises(RuntimeError, match="outside its 100 entries"):
        _kernels.mla_decode_stage1_asm_fwd(
            q, kv, torch.tensor([0, 1, 2], dtype=torch.int32),
            torch.tensor([0, 50, 100], dtype=torch.int32), _padded_indices(),
            torch.ones(2, dtype=torch.int32), None, None, torch.tensor([0, 1, 3],
                                                                        dtype=torch.int32),
            torch.tensor(works, dtype=torch.int32), 1, 1, 1, 0.05,
            torch.full((2, 1, HEADS, DV), float("nan")),
            torch.full((2, 1, HEADS, 1), float("nan")), out, None)
    assert not out[0].isnan().any() and out[1].isnan().all()


def test_overlapping_writes_run_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two works writing the same output rows: the later one wins, as in work order."""
    works = [[0, -1, 0, 1, 0, 50, 0, 0], [0, -1, 0, 1, 50, 100, 0, 0]]
    calls: list[int] = []
    real = _kernels._attend_batch
    monkeypatch.setattr(_kernels, "_attend_batch",
                        lambda geo, ws: calls.append(len(ws)) or real(geo, ws))
    batched = _stage1(works, [0, 2], _padded_indices(), True, monkeypatch)
    assert calls == [1, 1]  # same shape, yet one by one
    last_only = _stage1(works[1:], [0, 1], _padded_indices(), True, monkeypatch)
    torch.testing.assert_close(batched["output"][0], last_only["output"][0])


class _Capture(ModelBackend):
    """ModelBackend that keeps a copy of what the model wrote."""

    def run(self, case, inputs):  # noqa: ANN001, ANN201
        out = super().run(case, inputs)
        self.written = out.out.detach().clone()
        return out


@pytest.mark.parametrize("case", [
    SparseDecodeCase(requests=(Request(1, 400), Request(1, 200)), topk=96, valid_cap=50,
                     num_heads=48, page_size=16, quant=BF16, placement=Placement("shuffled")),
    DecodeCase(requests=(Request(1, 300), Request(1, 90), Request(1, 520)), num_heads=16,
               page_size=1, quant=BF16),  # KV splits: partials and the reduce
], ids=["sparse-padded-folded", "decode-partials"])
def test_batched_verdict_and_output_match_one_by_one(case: DecodeCase,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[bool, tuple[str, torch.Tensor]] = {}
    for batched in (False, True):
        monkeypatch.setattr(_kernels, "BATCH_ELEMENTS", BATCHED if batched else 0)
        backend = _Capture("gfx942")
        v = harness.run_case(case, backend)
        seen[batched] = (v.status, backend.written)
    assert seen[True][0] == seen[False][0] == PASS
    torch.testing.assert_close(seen[True][1], seen[False][1])  # bf16: within its rounding
