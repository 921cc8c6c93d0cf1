"""The boundary-class faults (mlacheck/backends/faults/boundary.py) bite exactly where their
shape is: each fails on its class's shape and passes on the contrast next to it, and
premerge on a CPU (without its large_kv cases) has a case that catches each."""

from __future__ import annotations

import pytest

from mlacheck import boundaries
from mlacheck.backends.faults import FAULTS, make
from mlacheck.harness import run_case
from mlacheck.matrices import load
from mlacheck.spec import (
    Case,
    DecodeCase,
    Paging,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
    SparseDecodeCase,
)
from mlacheck.verdict import FAIL, PASS

PER_TOKEN = Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax", per_token=True)


def dec(*reqs: tuple[int, int], **kw: object) -> DecodeCase:
    return DecodeCase(requests=tuple(Request(*r) for r in reqs), **{"num_heads": 16, **kw})


def pf(*segs: tuple[int, int], **kw: object) -> PrefillCase:
    return PrefillCase(segments=tuple(Segment(*s) for s in segs), **{"num_heads": 16, **kw})


def sp(*reqs: tuple[int, int], **kw: object) -> SparseDecodeCase:
    return SparseDecodeCase(requests=tuple(Request(*r) for r in reqs),
                            **{"num_heads": 16, "topk": 64, "page_size": 16, **kw})


# fault -> (a case with the shape, the contrast: the nearest case the mechanism cannot touch;
# for the empty-request faults that is empties placed last, where nothing shifts)
SHAPES: dict[str, tuple[Case, Case]] = {
    "tile-multiple-drops-last": (dec((1, 512), (1, 300)), dec((1, 513), (1, 300))),
    # 192 = 3 x 64 and 384 = 3 x 128; the contrasts 193 and 320 (= 5 x 64, not x 128)
    "tile-multiple-drops-last-64": (dec((1, 192), (1, 300)), dec((1, 193), (1, 300))),
    "tile-multiple-drops-last-128": (dec((1, 384), (1, 300)), dec((1, 320), (1, 300))),
    # one past 512; the contrast: at and one below a multiple, and kv 1 (no tile after the
    # peeled first one)
    "tile-ceil-off-by-one": (dec((1, 513), (1, 300)), dec((1, 512), (1, 511), (1, 1))),
    "kv-clamp-8k": (dec((1, 8193)), dec((1, 8192))),
    "kv-clamp-16k": (dec((1, 16500)), dec((1, 16384))),
    "kv-clamp-64k": (dec((1, 70000)), dec((1, 65536))),
    "page-id-int16": (dec((1, 50000), page_size=1, placement=Placement("packed")),
                      dec((1, 30000), page_size=1, placement=Placement("packed"))),
    "page-id-uint16": (dec((1, 98305), page_size=1), dec((1, 60000), page_size=1)),
    "empty-request-shift": (dec((0, 40), (1, 60), (2, 90)), dec((1, 60), (2, 90), (0, 30))),
    "empty-segment-shift": (pf((0, 20), (10, 30), (5, 0)), pf((10, 30), (5, 0), (0, 9))),
    "single-token-no-context": (pf((10, 0), (1, 30)), pf((10, 0), (2, 30))),
    "soft-cap-ignored": (pf((30, 20), soft_cap=30.0), pf((30, 20))),
    "per-token-scale-ignored": (pf((30, 20), quant=PER_TOKEN),
                                pf((30, 20), quant=Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax"))),
    # contrast: 128 keys, two tiles (the rows judged together catch a bf16 accumulator from
    # ~512 keys on, the row bound alone from ~4096: docs/detection.md "Narrow accumulation")
    "narrow-accumulation": (dec((1, 4096)), dec((1, 128))),
}
# The same faults on their class's other ops: sparse requests after an empty one resolve
# their top-k positions through the predecessor's page-table row (poison past its pages);
# paged prefill segments after an empty one read the predecessor's pages.
OTHER_OPS: dict[str, tuple[Case, Case]] = {
    "empty-request-shift/sparse": (sp((0, 40), (1, 60), (2, 90)), sp((1, 60), (2, 90), (0, 30))),
    "empty-segment-shift/paged": (pf((0, 20), (10, 30), (5, 0), paging=Paging(16)),
                                  pf((10, 30), (5, 0), (0, 9), paging=Paging(16))),
}
ALL = {**SHAPES, **OTHER_OPS}


# ~1 GB beside the worker (the 98305-token decode): one such test at a time (tests/conftest.py)
HEAVY = {"page-id-uint16"}


@pytest.mark.parametrize("key", [pytest.param(k, marks=[pytest.mark.memory_heavy] if k in HEAVY else [])
                                 for k in sorted(ALL)])
def test_fault_fails_on_its_shape_and_passes_on_the_contrast(key: str) -> None:
    shaped, contrast = ALL[key]
    name = key.split("/")[0]
    spec = FAULTS[name]
    cls = boundaries.BY_NAME[str(spec.bug_class)]
    assert cls.applies(shaped) and shaped.op in spec.ops and shaped.op in cls.ops
    v = run_case(shaped, make(name))
    assert v.status == FAIL and set(spec.expect) & {c.name for c in v.failed_checks}, v.summary()
    assert run_case(contrast, make(name)).status == PASS


@pytest.mark.memory_heavy
def test_every_boundary_fault_is_caught_by_cpu_premerge() -> None:
    """Each new fault fails on at least one premerge case a CPU gate runs (not large_kv), on
    every op of its class that it acts on (empty requests: decode and sparse; empty
    segments: prefill and paged prefill)."""
    cases = [mc.case for mc in load("premerge").cases if "large_kv" not in mc.markers]
    for name in SHAPES:
        spec = FAULTS[name]
        cls = boundaries.BY_NAME[str(spec.bug_class)]
        fault = make(name)
        for op in sorted(set(spec.ops) & set(cls.ops)):
            shaped = [c for c in cases if c.op == op and cls.applies(c)]
            assert shaped, (name, op)
            # the cheapest shaped cases first: one failure is enough
            shaped.sort(key=lambda c: c.total_kv * c.num_heads)
            assert any(run_case(c, fault).status == FAIL for c in shaped[:4]), (name, op)
