"""The sparse-pipeline faults (mlacheck/backends/faults/pipeline.py) are caught for their
MECHANISM: each passes where the mechanism cannot act (page-multiple kv lengths, next_n 1,
rows that see k positions or more, the decode form, one request, a packed pool, full top-k
rows) and fails where it does, on the check its spec expects.
"""

from __future__ import annotations

import dataclasses

import pytest

from mlacheck.backends.faults import FAULTS, make
from mlacheck.harness import run_case
from mlacheck.spec import (
    IndexConversionCase,
    PagedIndexerCase,
    Placement,
    Request,
    Segment,
    SparsePipelineCase,
    SparsePrefillCase,
    TopkCase,
)
from mlacheck.verdict import FAIL, PASS

PAGED = PagedIndexerCase(requests=(Request(1, 37), Request(1, 64)), num_heads=16, page_size=16)
TOPK = TopkCase(requests=(Request(1, 40), Request(2, 70), Request(1, 10)), topk=32,
                form="prefill")
CONV = IndexConversionCase(requests=(Request(1, 40), Request(2, 70)), topk=48, page_size=16)
SPF = SparsePrefillCase(segments=(Segment(5, 30), Segment(3, 0)), topk=16, num_heads=16)
PIPE = SparsePipelineCase(requests=(Request(1, 20), Request(1, 50)), topk=24, num_heads=16,
                          index_heads=16, page_size=16)
FULL_ROWS = (Request(1, 60), Request(2, 70))  # every row sees more than 48 positions


# (fault, where the mechanism acts, where it cannot)
CONTRASTS = {
    "indexer-page-tail-read": (PAGED, dataclasses.replace(
        PAGED, requests=(Request(1, 32), Request(1, 64)))),
    "indexer-mtp-full-context": (dataclasses.replace(
        PAGED, requests=(Request(2, 37), Request(2, 64))), PAGED),
    "topk-masked-chosen": (TOPK, dataclasses.replace(
        TOPK, requests=(Request(1, 40), Request(2, 70)))),
    "topk-not-localised": (TOPK, dataclasses.replace(TOPK, form="decode")),
    "conversion-minus1-to-slot": (CONV, dataclasses.replace(CONV, requests=FULL_ROWS)),
    "conversion-contiguous-base": (CONV, dataclasses.replace(CONV,
                                                             placement=Placement("packed"))),
    # the same mechanism in AITER's ragged layout (the form the AITER adapters convert to)
    "conversion-contiguous-base-ragged": (
        dataclasses.replace(CONV, index_layout="ragged"),
        dataclasses.replace(CONV, index_layout="ragged", placement=Placement("packed"))),
    "conversion-ragged-indptr": (dataclasses.replace(CONV, index_layout="ragged"),
                                 dataclasses.replace(CONV, index_layout="ragged",
                                                     requests=FULL_ROWS)),
    "sparse-prefill-minus1-slot0": (SPF, dataclasses.replace(
        SPF, segments=(Segment(4, 40),))),
    "pipeline-ragged-rowmajor": (PIPE, dataclasses.replace(
        PIPE, requests=(Request(1, 40), Request(1, 50)))),
    "pipeline-local-as-global": (PIPE, dataclasses.replace(
        PIPE, requests=(Request(1, 50),), placement=Placement("packed"))),
}


@pytest.mark.parametrize("name", list(CONTRASTS))
def test_a_pipeline_fault_fails_where_its_mechanism_acts_and_only_there(name: str) -> None:
    acts, cannot = CONTRASTS[name]
    spec = FAULTS[name.removesuffix("-ragged")]
    assert acts.op in spec.ops and cannot.op in spec.ops
    v = run_case(acts, make(spec.name))
    assert v.status == FAIL, v.summary()
    assert {c.name for c in v.failed_checks} & set(spec.expect), v.summary()
    ok = run_case(cannot, make(spec.name))
    assert ok.status == PASS, ok.summary()


def test_every_pipeline_fault_with_a_contrast_is_tested_here() -> None:
    pipeline = [n for n, s in FAULTS.items() if s.factory.startswith(
        "mlacheck.backends.faults.pipeline:") and s.contrast]
    assert set(pipeline) <= set(CONTRASTS), set(pipeline) - set(CONTRASTS)
