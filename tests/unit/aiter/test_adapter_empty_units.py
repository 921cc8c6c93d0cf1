"""Empty requests / segments (q_len 0, as padded batch slots give) are left out of the AITER
ASM adapter's calls, as the flashmla and aiter-triton adapters leave them out (issue 32):
the kernel gets the kept units' qo_indptr / cu_seqlens and pages only, so what AITER's
planner and kernels would do with a qo_len of 0 never matters. Checked over mlacheck's model
of AITER's API: every call's row offsets strictly increase, and the verdict passes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _aiter_cases import describe, model_adapter, modelled_chip, require_model  # noqa: I001

from mlacheck import spec
from mlacheck.harness import run_case
from mlacheck.spec import Quant, Request, Segment
from mlacheck.verdict import PASS

pytestmark = pytest.mark.usefixtures("_model_present")

FP8_OF = {"gfx942": Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "amax"),
          "gfx950": Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax")}
# the row offsets each AITER entry point takes
ROW_OFFSETS = {"mla.mla_decode_fwd": "qo_indptr", "mha_batch_prefill_func": "cu_seqlens_q",
               "mla.mla_prefill_ps_fwd": "qo_indptr"}


@pytest.fixture
def _model_present() -> None:
    require_model()


def run_recording(case: spec.Case, persistent: bool = True) -> tuple[Any, list[list[int]]]:
    """The verdict and the row offsets every attention call received."""
    backend = model_adapter(persistent)
    seen: list[list[int]] = []
    real_call = backend._call

    def call(api: Any, qualname: str, **kwargs: Any) -> Any:
        if qualname in ROW_OFFSETS:
            seen.append(torch.as_tensor(kwargs[ROW_OFFSETS[qualname]]).tolist())
        return real_call(api, qualname, **kwargs)

    backend._call = call  # type: ignore[method-assign]
    return run_case(case, backend), seen


def assert_left_out(v: Any, seen: list[list[int]], kept: int) -> None:
    assert v.status == PASS, describe([v])
    assert seen, "no attention call recorded"
    for offsets in seen:
        assert len(offsets) == kept + 1 and offsets == sorted(set(offsets)), offsets


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "nonpersistent"])
@pytest.mark.parametrize("gfx", ["gfx942", "gfx950"])
def test_decode_leaves_empty_requests_out(monkeypatch: pytest.MonkeyPatch, gfx: str,
                                          persistent: bool) -> None:
    for quant in (Quant(), FP8_OF[gfx]):
        case = spec.DecodeCase((Request(0, 40), Request(1, 300), Request(0, 7), Request(1, 129)),
                          page_size=16, quant=quant)
        with modelled_chip(monkeypatch, gfx):
            v, seen = run_recording(case, persistent)
        assert_left_out(v, seen, kept=2)
        assert v.implementation["left_out"].startswith("2 empty requests")


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "nonpersistent"])
def test_sparse_decode_with_empty_requests_runs(monkeypatch: pytest.MonkeyPatch,
                                                persistent: bool) -> None:
    """Sparse decode hands every query token over as its own pseudo-request: an empty
    request has no token, so it is in no call."""
    case = spec.SparseDecodeCase((Request(1, 300), Request(0, 50), Request(2, 150)), topk=128,
                            page_size=16)
    with modelled_chip(monkeypatch, "gfx950"):
        v, seen = run_recording(case, persistent)
    assert_left_out(v, seen, kept=3)  # 3 tokens, one pseudo-request each


@pytest.mark.parametrize("gfx", ["gfx942", "gfx950"])
def test_paged_prefill_leaves_empty_segments_out(monkeypatch: pytest.MonkeyPatch,
                                                 gfx: str) -> None:
    case = spec.PrefillCase((Segment(0, 20), Segment(37), Segment(0), Segment(20, 45)),
                       paging=spec.Paging(16))
    with modelled_chip(monkeypatch, gfx):
        v, seen = run_recording(case)
    assert_left_out(v, seen, kept=2)
    assert v.implementation["left_out"].startswith("2 empty segments")


def test_fp8_prefill_leaves_empty_segments_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty segment holding cached K/V rows between its neighbours' keys: the kept
    segments name their K/V rows through kv_page_indices (block size 1), no copy."""
    case = spec.PrefillCase((Segment(0, 20), Segment(64), Segment(0), Segment(33, 17), Segment(0, 5)),
                       quant=FP8_OF["gfx950"])
    with modelled_chip(monkeypatch, "gfx950"):
        v, seen = run_recording(case)
    assert_left_out(v, seen, kept=2)
    assert v.implementation["left_out"].startswith("3 empty segments")
