"""AITER Triton topk's two-stage plan as the adapter reads it (aiter/ops/triton/topk.py:63-109 at
e4048607a): the stage-2 sort size behind the measured SKIP, and the all -inf chunk behind the
known rule aiter-triton-topk-minus-inf-in-stage-2 (docs/gpu-results.md, finding 6)."""

from __future__ import annotations

import pytest

from mlacheck import known
from mlacheck.backends import aiter_triton as at
from mlacheck.spec import Request, TopkCase


@pytest.mark.parametrize(("width", "k", "plan"), [
    (100, 64, at.TopkPlan(False, 256, 1, 64)),  # one stage: rows <= 1024, k <= 1024
    (1000, 64, at.TopkPlan(False, 256, 4, 256)),
    (4096, 64, at.TopkPlan(True, 1024, 4, 256)),  # chunk 1024 for rows of >= 1024
    (4096, 2048, at.TopkPlan(True, 2048, 2, 4096)),  # chunk raised to next_pow2(k)
    (10240, 2048, at.TopkPlan(True, 2048, 5, 16384)),
    (700, 2048, at.TopkPlan(True, 2048, 1, 2048)),  # k > 1024 on a short row: two-stage
])
def test_plan_follows_topk_py(width: int, k: int, plan: at.TopkPlan) -> None:
    assert at.TopkPlan.of(width, k) == plan


def _case(lengths: tuple[int, ...], k: int, form: str = "decode") -> TopkCase:
    return TopkCase(requests=tuple(Request(1, n) for n in lengths), topk=k, form=form)  # type: ignore[arg-type]


def test_stage2_beyond_the_measured_sort_is_a_sourced_skip() -> None:
    assert at.topk_stage2_rule(_case((2047, 4096), 2048)) is None  # 4096: ran on the H100
    why = at.topk_stage2_rule(_case((2047, 4096, 4096), 2048, "prefill"))  # 10239 wide: 16384
    assert why is not None and "16384" in why and "topk.py:108-119" in why and "measured" in why
    assert at.topk_stage2_rule(_case((20, 100), 64, "prefill")) is None  # one stage


@pytest.mark.parametrize(("lengths", "k", "form", "reaches"), [
    ((2048, 4096), 2048, "decode", True),  # row 0: columns 2048..4095 all -inf
    ((2049, 4096), 2048, "decode", False),  # one finite logit in the second chunk
    ((4096, 4096), 2048, "decode", False),
    ((3000, 3000), 64, "decode", False),  # chunks of 1024, every chunk has finite logits
    ((1000, 3000), 64, "decode", True),  # row 0: chunks 1 and 2 all -inf
    ((2048, 2048), 2048, "prefill", True),  # batch-wide rows: each window misses a chunk
    ((20, 100), 64, "decode", False),  # one stage: no stage 2
    ((700, 1500), 64, "decode", False),  # 1500 wide: the second chunk runs past the row
])
def test_an_all_minus_inf_chunk_reaches_stage_2(lengths: tuple[int, ...], k: int, form: str,
                                               reaches: bool) -> None:
    case = _case(lengths, k, form)
    assert at.topk_masked_chunk_reaches_stage2(case) is reaches
    rule = known.lookup("aiter-triton", case)
    assert (rule is not None and rule.name == "aiter-triton-topk-minus-inf-in-stage-2") is reaches


def test_the_pipelines_top_k_stage_has_the_same_stage_2_limit() -> None:
    """The composed path's top-k runs over request-local rows as wide as its longest request."""
    from mlacheck.backends import aiter_triton_compat as compat
    from mlacheck.spec import Quant, SparsePipelineCase

    mp = pytest.MonkeyPatch()
    mp.setattr(at, "load", lambda: at.Loaded("e4048607a"))
    mp.setattr(compat, "compile_only", lambda: True)
    try:
        cap = at.factory().capabilities()["sparse_pipeline"]
        wide = SparsePipelineCase((Request(1, 9000), Request(1, 700)), topk=2048,
                                  quant=Quant("bf16", "bf16"))
        why = cap.why_not(wide, "cuda")
        assert why is not None and why.startswith("topk_indices stage: AITER topk's stage 2")
        short = SparsePipelineCase((Request(1, 300), Request(1, 90)), topk=128,
                                   quant=Quant("bf16", "bf16"))
        assert cap.why_not(short, "cuda") is None
    finally:
        mp.undo()
