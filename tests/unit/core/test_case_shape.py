"""Cases with one shape (issue 31): every case answers the shared questions the same way,
and the ops are one string-valued enum, so files and ids keep their strings."""

from __future__ import annotations

import io
import json
import tokenize
from pathlib import Path

import pytest

from mlacheck.ops import OPS, Op, unit_of
from mlacheck.spec import (
    DecodeCase,
    Paging,
    PrefillCase,
    Request,
    Segment,
    SparseDecodeCase,
    case_from_json,
)

ROOT = Path(__file__).resolve().parents[3]

CASES = [
    PrefillCase(segments=(Segment(3, 5), Segment(0, 4), Segment(7))),
    PrefillCase(segments=(Segment(16, 32),), paging=Paging(64, "linear")),
    DecodeCase(requests=(Request(1, 70), Request(2, 130), Request(0, 9)), page_size=16),
    SparseDecodeCase(requests=(Request(1, 300),), topk=128, page_size=64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_case_answers_the_shared_questions(case) -> None:  # noqa: ANN001
    units = case.units
    assert case.q_lengths == tuple(u.q_len for u in units)
    assert case.kv_lengths == tuple(u.kv_len for u in units)
    assert case.total_q == sum(case.q_lengths) and case.total_kv == sum(case.kv_lengths)
    assert case.max_q_len == max(case.q_lengths)
    assert case.has_empty == (0 in case.q_lengths)
    assert case.unit_name == ("segment" if isinstance(case, PrefillCase) else "request")
    assert case.unit_name == case.op.unit == unit_of(case.op)
    if isinstance(case, PrefillCase):
        assert case.paging is case.paging  # the field itself (None when unpaged)
    else:
        assert case.paging == Paging(case.page_size, case.layout)
    assert case.page_token_values > 0
    assert case.out_width == (case.dims.v_head if isinstance(case, PrefillCase)
                              else case.dims.kv_lora_rank)
    # the accessors are not fields: the JSON, the id and the seed do not change
    back = case_from_json(case.to_json())
    assert back == case and back.id == case.id
    assert not {"units", "unit_name", "q_lengths", "kv_lengths", "op", "page_token_values"} & set(
        json.loads(case.to_json()))


def test_ops_are_their_strings() -> None:
    assert [str(o) for o in OPS] == ["mla_prefill", "mla_decode", "mla_sparse_decode",
                                      "paged_prefill", "mqa_logits", "paged_mqa_logits",
                                      "topk_indices", "index_conversion", "mla_sparse_prefill",
                                      "sparse_pipeline"]
    assert Op.DECODE == "mla_decode" and {"mla_decode": 1}[Op.DECODE] == 1
    assert json.dumps({Op.DECODE: [Op.PREFILL]}) == '{"mla_decode": ["mla_prefill"]}'
    assert f"{Op.SPARSE_DECODE:20s}|" == "mla_sparse_decode   |"
    assert DecodeCase().op is Op.DECODE and PrefillCase(paging=Paging()).op is Op.PAGED_PREFILL
    assert unit_of("mla_prefill") == "segment" and unit_of("some_future_op") == "request"


def test_ops_are_named_not_spelt_out() -> None:
    """An op written as a string literal in code would escape the one list (mlacheck/ops.py).
    A line that says "(not an op)" spells the same word for something else (a library's
    parameter named `topk_indices`)."""
    names = {f'"{o.value}"' for o in Op} | {f"'{o.value}'" for o in Op}
    found = []
    for p in sorted((ROOT / "mlacheck").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel == "mlacheck/ops.py" or "/jit/" in rel:
            continue
        tokens = tokenize.generate_tokens(io.StringIO(p.read_text(encoding="utf-8")).readline)
        found += [f"{rel}:{t.start[0]}" for t in tokens
                  if t.type == tokenize.STRING and t.string in names
                  and "(not an op)" not in t.line]
    assert not found, "name the op (mlacheck.ops.Op) instead:\n" + "\n".join(found)
