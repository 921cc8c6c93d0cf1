"""Planted adapter bugs (bug classes 5, 10, 11, 12 and the AITER argument traps) must
FAIL, or CRASH where AITER / the model raises; the correct adapter PASSes the same cases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _aiter_cases import describe, model_adapter, modelled_chip, require_model  # noqa: I001

from mlacheck.backends.aiter import AiterAdapter, AiterApi, HeadPadding, MetadataBuffers
from mlacheck.harness import run_case
from mlacheck.inputs import DecodeInputs
from mlacheck.spec import Case, DecodeCase, Quant, Request, SparseDecodeCase
from mlacheck.verdict import CRASH, FAIL, PASS

pytestmark = pytest.mark.usefixtures("_model_present")

BATCH = (Request(1, 40), Request(1, 300), Request(1, 7), Request(1, 129))
PAGED = DecodeCase(requests=BATCH, page_size=16)


@pytest.fixture
def _model_present() -> None:
    require_model()


# --------------------------------------------------------------------------- the variants


class TokenLevelKvIndptr(AiterAdapter):
    """(a) kv_indptr counted in tokens (cumsum of kv lengths), not pages."""

    def page_table_for_decode(self, inputs: DecodeInputs
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, kv_indices, last = inputs.table.to_aiter()
        lens = inputs.table.kv_lens
        token_indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32)
        token_indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
        return token_indptr, kv_indices, last


class SwappedWorkBuffers(AiterAdapter):
    """(b) get_mla_metadata_v1 fed in the order get_mla_metadata_info_v1 returns the buffers
    (work_indptr before work_info_set): the wrapper's order is the opposite."""

    def fill_metadata(self, api: AiterApi, cache: MetadataBuffers,
                      bufs: dict[str, torch.Tensor], grew: bool,
                      fill_args: dict[str, Any]) -> None:
        self._call(api, "get_mla_metadata_v1", work_metadata_ptrs=bufs["work_metadata_ptrs"],
                   work_info_set=bufs["work_indptr"], work_indptr=bufs["work_info_set"],
                   reduce_indptr=bufs["reduce_indptr"], reduce_final_map=bufs["reduce_final_map"],
                   reduce_partial_map=bufs["reduce_partial_map"], **fill_args)
        cache.fills += 1


class NoHeadPadding(AiterAdapter):
    """(c) the case's head count handed to AITER as is."""

    def head_padding_for(self, api: AiterApi, case: DecodeCase | SparseDecodeCase
                         ) -> HeadPadding:
        return HeadPadding(case.num_heads, case.num_heads)


@dataclass(frozen=True)
class FloorDivisionPadding(HeadPadding):
    """vLLM's helper applied to any H < 16: q.repeat_interleave(16 // H), o with max(H, 16)
    heads, unpadded as o[:, ::16 // H]. Right for 8 heads; for 12, 16 // 12 == 1."""

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.uint8 if x.element_size() == 1 else torch.int16)
        return bits.repeat_interleave(16 // self.heads, dim=1).view(x.dtype).contiguous()

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :: 16 // self.heads]


class FloorDivisionHeadPadding(AiterAdapter):
    """(d) `16 // H` padding (bug class 5)."""

    def head_padding_for(self, api: AiterApi, case: DecodeCase | SparseDecodeCase
                         ) -> HeadPadding:
        return FloorDivisionPadding(case.num_heads, max(case.num_heads, 16))


class NoSoftmaxScale(AiterAdapter):
    """(e) sm_scale left to AITER's default 1/sqrt(576)."""

    def _call(self, api: AiterApi, qualname: str, **kwargs: Any) -> Any:
        if qualname == "mla.mla_decode_fwd":
            kwargs.pop("sm_scale", None)
        return super()._call(api, qualname, **kwargs)


# --------------------------------------------------------------------------- the checks


def _verdicts(cls: type[AiterAdapter], cases: list[Case], gfx: str,
              monkeypatch: pytest.MonkeyPatch, persistent: bool = True) -> list[Any]:
    with modelled_chip(monkeypatch, gfx):
        backend = model_adapter(persistent, cls=cls, name=f"{cls.__name__}")
        return [run_case(c, backend) for c in cases]


def _assert_caught(planted: list[Any], correct: list[Any]) -> None:
    assert all(v.status == PASS for v in correct), describe(correct)
    missed = [v for v in planted if v.status not in (FAIL, CRASH)]
    assert not missed, "planted bug not caught:\n" + describe(missed)


PLANTED: list[tuple[str, type[AiterAdapter], list[Case]]] = [
    ("token-level kv_indptr", TokenLevelKvIndptr, [
        PAGED, DecodeCase(requests=BATCH, page_size=64, quant=Quant("fp8_e4m3fn", "fp8_e4m3fn"))]),
    ("swapped work_indptr / work_info_set", SwappedWorkBuffers, [
        PAGED, DecodeCase(requests=(Request(2, 90),) * 3, page_size=1)]),
    ("no head padding", NoHeadPadding, [
        DecodeCase(requests=BATCH, num_heads=8, page_size=16),
        DecodeCase(requests=BATCH, num_heads=12, page_size=16)]),
    ("16 // H padding", FloorDivisionHeadPadding, [
        DecodeCase(requests=BATCH, num_heads=12, page_size=16)]),
    ("sm_scale not passed", NoSoftmaxScale, [
        PAGED, SparseDecodeCase(requests=(Request(1, 300),), topk=128, page_size=16)]),
]


@pytest.mark.parametrize("gfx", ["gfx942", "gfx950"])
@pytest.mark.parametrize(("bug", "cls", "cases"), PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_adapter_bug_is_caught(monkeypatch: pytest.MonkeyPatch, gfx: str, bug: str,
                                       cls: type[AiterAdapter], cases: list[Case]) -> None:
    cases = [_on_chip(c, gfx) for c in cases]
    planted = _verdicts(cls, cases, gfx, monkeypatch)
    correct = _verdicts(AiterAdapter, cases, gfx, monkeypatch)
    _assert_caught(planted, correct)


def test_floor_division_padding_is_right_for_eight_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The contrast that makes (d) a bug class: vLLM's `16 // H` is correct for H = 8."""
    case = DecodeCase(requests=BATCH, num_heads=8, page_size=16)
    for gfx in ("gfx942", "gfx950"):
        v = _verdicts(FloorDivisionHeadPadding, [case], gfx, monkeypatch)[0]
        assert v.status == PASS, describe([v])


def test_missing_head_padding_nonpersistent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-persistent: 12 unpadded heads are caught; 8 are not a bug there, AITER has
    8-head non-persistent q_len-1 kernels (mla_a16w16_qh8_qseqlen1_gqaratio8_v3)."""
    twelve = DecodeCase(requests=BATCH, num_heads=12, page_size=16)
    planted = _verdicts(NoHeadPadding, [twelve], "gfx942", monkeypatch, persistent=False)
    correct = _verdicts(AiterAdapter, [twelve], "gfx942", monkeypatch, persistent=False)
    _assert_caught(planted, correct)
    eight = DecodeCase(requests=BATCH, num_heads=8, page_size=16)
    v = _verdicts(NoHeadPadding, [eight], "gfx942", monkeypatch, persistent=False)[0]
    assert v.status == PASS, describe([v])


def test_sm_scale_not_passed_nonpersistent(monkeypatch: pytest.MonkeyPatch) -> None:
    planted = _verdicts(NoSoftmaxScale, [PAGED], "gfx950", monkeypatch, persistent=False)
    correct = _verdicts(AiterAdapter, [PAGED], "gfx950", monkeypatch, persistent=False)
    _assert_caught(planted, correct)


def _on_chip(case: Case, gfx: str) -> Case:
    """The chip's FP8 flavour for FP8 cases (the other one SKIPs by capability)."""
    from dataclasses import replace

    if not case.quant.is_fp8:
        return case
    fmt = "fp8_e4m3fnuz" if gfx == "gfx942" else "fp8_e4m3fn"
    return replace(case, quant=replace(case.quant, q=fmt, kv=fmt))
