"""Determinism of inputs, stability of case ids, and case (de)serialisation."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlacheck import fp8, inputs, kvcache, spec
from mlacheck.spec import (
    NO_YARN,
    DecodeCase,
    MLADims,
    Paging,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
    SparseDecodeCase,
)

CASES = {
    "prefill-paged": PrefillCase(
        segments=(Segment(20, 13), Segment(9)), num_heads=2,
        quant=Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "unit"), paging=Paging(16, "vectorized"),
        placement=Placement("shuffled", spare_pages=3, tail_poison="sentinel"), profile="stress",
    ),
    "prefill": PrefillCase(segments=(Segment(5, 3),), num_heads=3, soft_cap=30.0, causal=False),
    "decode": DecodeCase(
        requests=(Request(2, 37), Request(1, 5)), num_heads=2, page_size=16,
        quant=Quant("fp8_e4m3fn", "fp8_e4m3fn"), placement=Placement("high", offset_bytes=1 << 20),
    ),
    "sparse": SparseDecodeCase(
        requests=(Request(3, 70), Request(1, 8)), topk=16, valid_cap=9, num_heads=2, page_size=1,
        dims=NO_YARN,
    ),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return fp8.as_ints(t)


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor reachable from an inputs bundle, by path (page tables included)."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        found[prefix] = obj
    elif isinstance(obj, list | tuple):
        for i, x in enumerate(obj):
            found.update(_tensors(x, f"{prefix}[{i}]"))
    elif isinstance(obj, dict):
        for k, x in obj.items():
            found.update(_tensors(x, f"{prefix}.{k}"))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            found.update(_tensors(getattr(obj, f.name), f"{prefix}.{f.name}"))
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_same_case_same_bits(name: str) -> None:
    case = CASES[name]
    a, b = _tensors(inputs.build(case)), _tensors(inputs.build(case))
    assert a.keys() == b.keys()
    must = {".q.stored", ".q.ideal", ".q.scale", ".out.full"}
    must |= {".k_pool.data", ".v_pool.data", ".k_pool.table.indices"} if "paged" in name else set()
    must |= {".pool.data", ".pool.table.indices", ".kv[0].stored"} if name in ("decode", "sparse") else set()
    must |= {".topk_indices"} if name == "sparse" else set()
    assert must <= a.keys(), must - a.keys()
    for path in a:
        assert a[path].dtype == b[path].dtype and a[path].shape == b[path].shape, path
        assert torch.equal(_bits(a[path]), _bits(b[path])), path  # NaN poison included
    wa, wb = inputs.weights_for(case), inputs.weights_for(case)
    assert torch.equal(wa.w_uk, wb.w_uk) and torch.equal(wa.w_uv, wb.w_uv)


@pytest.mark.parametrize("name", list(CASES))
def test_different_seeds_differ(name: str) -> None:
    case = CASES[name]
    other = dataclasses.replace(case, seed=case.seed + 1)
    assert other.id != case.id and other.seed_material != case.seed_material
    a, b = inputs.build(case), inputs.build(other)
    assert not torch.equal(a.q.ideal, b.q.ideal)
    assert not torch.equal(inputs.weights_for(case).w_uk, inputs.weights_for(other).w_uk)
    if isinstance(a, inputs.DecodeInputs):
        assert isinstance(b, inputs.DecodeInputs)
        assert not torch.equal(a.kv[0].ideal, b.kv[0].ideal)
        assert not torch.equal(a.table.indices, b.table.indices)  # placement is seeded too
        if a.topk_indices is not None:
            assert b.topk_indices is not None
            assert not torch.equal(a.topk_indices, b.topk_indices)


def test_case_ids_are_stable() -> None:
    """Hard-coded: an accidental change of the id scheme (slug, JSON, hash) must fail here,
    since ids name stored results, baselines and replays."""
    dec = DecodeCase(requests=(Request(1, 100),), num_heads=4)
    assert dec.id == "dec-b1-kv100-h4-p16-bf16-shuffled-7be7dff0"
    assert dec.seed_material == 558021938110956826
    pf = PrefillCase(
        segments=(Segment(32, 100), Segment(7)), num_heads=8,
        quant=Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "unit"), paging=Paging(64, "vectorized"),
        placement=Placement("high", offset_bytes=2**31, tail_poison="sentinel"),
    )
    assert pf.id == "pf-s2-q39-ctx100-h8-e4m3fnuz-unit-causal-p64vec-high31-sentinel-4fafd194"
    sp = SparseDecodeCase(requests=(Request(2, 3000),), topk=2048, valid_cap=100, num_heads=16)
    assert sp.id == "sparse-b1-mtp2-kv3000-top2048-cap100-h16-p64-bf16-shuffled-071848cb"
    # content-addressed: equal cases share an id, any field change gives another
    assert DecodeCase(requests=(Request(1, 100),), num_heads=4).id == dec.id
    assert dataclasses.replace(dec, page_size=64).id != dec.id
    assert dataclasses.replace(dec, dims=NO_YARN).id != dec.id


NESTED = [
    *CASES.values(),
    PrefillCase(
        segments=(Segment(1),), paging=Paging(1024, "linear"),
        dims=MLADims(qk_nope=64, qk_rope=32, v_head=64, kv_lora_rank=256, rope_factor=4.0,
                     mscale_all_dim=0.707),
        quant=Quant("fp16", "fp8_e4m3fn", "amax"), seed=12,
    ),
    DecodeCase(placement=Placement("high", offset_bytes=1 << 32, spare_pages=0), profile="stress"),
    SparseDecodeCase(),
]


@pytest.mark.parametrize("case", NESTED, ids=lambda c: c.slug)
def test_json_round_trip(case: spec.Case) -> None:
    text = case.to_json()
    assert "\n" not in text and json.loads(text)["kind"] == case.kind
    back = spec.case_from_json(text)
    assert back == case and type(back) is type(case)
    assert back.id == case.id and back.to_json() == text
    assert spec.case_from_dict(spec.case_to_dict(case)) == case
    # the nested parts come back as their types, not dicts
    assert isinstance(back.quant, Quant) and isinstance(back.placement, Placement)
    assert isinstance(back.dims, MLADims)
    if isinstance(back, PrefillCase):
        assert back.paging is None or isinstance(back.paging, Paging)
        assert all(isinstance(s, Segment) for s in back.segments)
    else:
        assert all(isinstance(r, Request) for r in back.requests)


BAD_JSON = {
    "not json": "{",
    "not an object": "[1, 2]",
    "null": "null",
    "no kind": "{}",
    "unknown kind": '{"kind": "nope"}',
    "unknown field": '{"kind": "decode", "requests": [[1, 9]], "foo": 1}',
    "unknown nested field": '{"kind": "decode", "requests": [[1, 9]], "quant": {"zz": 1}}',
    "unknown dims field": '{"kind": "prefill", "segments": [[4, 0]], "dims": {"x": 2}}',
    "bad format": '{"kind": "decode", "requests": [[1, 9]], "quant": {"q": "fp9"}}',
    "bad request": '{"kind": "decode", "requests": [{"q_len": 0, "kv_len": 3}]}',
    "bad request arity": '{"kind": "decode", "requests": [[1, 2, 3]]}',
    "bad type": '{"kind": "decode", "requests": [[1, 9]], "num_heads": "16"}',
    "bad nested type": '{"kind": "prefill", "segments": [[4, 0]], "paging": 5}',
    "bad sequence": '{"kind": "sparse", "requests": 5}',
    "bad placement": '{"kind": "decode", "requests": [[1, 9]], "placement": {"kind": "high"}}',
    "bad page size": '{"kind": "decode", "requests": [[1, 9]], "page_size": 2048}',
    "bad valid_cap": '{"kind": "sparse", "requests": [[1, 9]], "topk": 8, "valid_cap": 9}',
    "bad vectorized page": '{"kind": "prefill", "segments": [[4, 0]], "paging": {"page_size": 8, "layout": "vectorized"},'
    ' "quant": {"q": "fp8_e4m3fn", "kv": "fp8_e4m3fn"}}',
}


@pytest.mark.parametrize("text", list(BAD_JSON.values()), ids=list(BAD_JSON))
def test_bad_json_is_a_one_line_value_error(text: str) -> None:
    with pytest.raises(ValueError) as info:
        spec.case_from_json(text)
    msg = str(info.value)
    assert msg and "\n" not in msg and len(msg) < 200, msg


@pytest.mark.parametrize("text, words", [
    ('{"kind": "decode", "num_heads": 16}',
     "missing required field 'requests' (a list of [q_len, kv_len] pairs)"),
    ('{"kind": "prefill"}', "missing required field 'segments'"),
    ('{"kind": "decode", "requests": [{"q_len": 1, "kv_len": "37"}]}',
     "requests[0].kv_len must be an integer, got '37' (a string)"),
    ('{"kind": "decode", "requests": [[1, 40], [1, 2.5]]}',
     "requests[1].kv_len must be an integer, got 2.5 (a number)"),
    ('{"kind": "prefill", "segments": [[4, 0]], "causal": "yes"}',
     "causal must be true or false, got 'yes' (a string)"),
    ('{"kind": "decode", "requests": [[1, 9]], "quant": {"kv": 8}}',
     "quant.kv must be a string, got 8 (an integer)"),
    ('{"kind": "sparse", "requests": [[1, 9]], "valid_cap": "4"}',
     "valid_cap must be an integer or null, got '4' (a string)"),
])
def test_a_bad_case_names_the_field_and_the_type(text: str, words: str) -> None:
    """Issue 33: a case JSON without `requests` became `dec-b1-kv256` and PASSed; a string
    kv_len gave "'<' not supported between instances of 'str' and 'int'"."""
    with pytest.raises(ValueError, match=re.escape(words)):
        spec.case_from_json(text)


def test_every_problem_of_a_case_in_one_line() -> None:
    with pytest.raises(ValueError) as info:
        spec.case_from_json('{"kind": "decode", "num_heads": "16", "seed": -1.5, "foo": 1}')
    msg = str(info.value)
    assert "\n" not in msg
    for words in ("missing required field 'requests'", "unknown field(s) foo",
                  "num_heads must be an integer, got '16'", "seed must be an integer"):
        assert words in msg, msg


_requests = st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 5000)).map(lambda t: Request(t[0], t[0] + t[1])),
    min_size=1, max_size=4,
).map(tuple)
_placement = st.one_of(
    st.builds(Placement, kind=st.sampled_from(["packed", "shuffled"]), spare_pages=st.integers(0, 9)),
    st.builds(Placement, kind=st.just("high"), offset_bytes=st.sampled_from([1 << 31, 1 << 32])),
)
_quant = st.builds(
    Quant, q=st.sampled_from(spec.FORMATS), kv=st.sampled_from(spec.FORMATS),
    scale=st.sampled_from(["unit", "amax"]), per_token=st.booleans(),
)


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(
    requests=_requests, page_size=st.integers(1, 1024), heads=st.sampled_from([1, 8, 16, 128]),
    placement=_placement, quant=_quant, seed=st.integers(0, 2**40), sparse=st.booleans(),
)
def test_json_round_trip_property(requests, page_size, heads, placement, quant, seed, sparse) -> None:
    if quant.per_token and quant.kv.startswith("fp8"):  # rejected by the spec (not modelled)
        quant = dataclasses.replace(quant, per_token=False)
    if sparse:
        case: spec.Case = SparseDecodeCase(
            requests=requests, topk=64, valid_cap=7, num_heads=heads, page_size=page_size,
            placement=placement, quant=quant, seed=seed,
        )
    else:
        case = DecodeCase(
            requests=requests, num_heads=heads, page_size=page_size, placement=placement,
            quant=quant, seed=seed,
        )
    back = spec.case_from_json(case.to_json())
    assert back == case and back.id == case.id


def test_free_pages_are_deterministic_too() -> None:
    a = inputs.build(CASES["decode"])
    b = inputs.build(CASES["decode"])
    assert torch.equal(kvcache.free_pages(a.pool), kvcache.free_pages(b.pool))
    assert kvcache.free_pages(a.pool).numel() == a.pool.num_pages - a.table.indices.numel()
