"""Decode pools have a KV layout too: a later case field, read by inputs / kvcache, checked
against every backend's declared `Capability.layouts` (a backend that does not take a layout
SKIPs naming it; one that reads through the layout runs)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mlacheck import fp8, inputs, layouts
from mlacheck.backends.base import Capability, Output, skip_reason
from mlacheck.backends.registry import resolve
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.harness import run_case
from mlacheck.kvcache import KVPool
from mlacheck.matrices import load
from mlacheck.spec import DecodeCase, Quant, Request, SparseDecodeCase, case_from_json
from mlacheck.verdict import FAIL, PASS, SKIP

VEC = layouts.VECTORIZED.name
LIN = layouts.LINEAR.name
DECODE = DecodeCase(requests=(Request(2, 37), Request(1, 20)), num_heads=4, page_size=16)
SPARSE = SparseDecodeCase(requests=(Request(2, 70),), topk=16, num_heads=16, page_size=16)


def test_linear_decode_ids_and_seeds_are_the_ones_pinned_before_the_field() -> None:
    dec = DecodeCase(requests=(Request(1, 100),), num_heads=4)
    assert dec.layout == LIN and dec.id == "dec-b1-kv100-h4-p16-bf16-shuffled-7be7dff0"
    assert dec.seed_material == 558021938110956826
    assert "layout" not in json.loads(dec.identity_json())
    assert json.loads(dec.to_json())["layout"] == LIN  # the results file records it


@pytest.mark.parametrize("case", [DECODE, SPARSE], ids=lambda c: c.kind)
def test_another_layout_is_another_case_and_round_trips(case: DecodeCase) -> None:
    vec = dataclasses.replace(case, layout=VEC)
    assert vec.id != case.id and f"p16{layouts.VECTORIZED.tag}-" in vec.id
    assert f"p16{layouts.VECTORIZED.tag}" not in case.id
    back = case_from_json(vec.to_json())
    assert back == vec and back.id == vec.id


def test_bad_layout_and_page_size_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="layout must be one of"):
        DecodeCase(layout="tiled")
    fp8_kv = Quant("fp8_e4m3fn", "fp8_e4m3fn")
    with pytest.raises(ValueError, match="vectorized layout needs page_size % 16 == 0"):
        SparseDecodeCase(page_size=8, quant=fp8_kv, layout=VEC)


@pytest.mark.parametrize("case", [DECODE, SPARSE], ids=lambda c: c.kind)
def test_the_pool_is_stored_in_the_case_layout_and_gathers_back_the_tokens(
        case: DecodeCase) -> None:
    vec = dataclasses.replace(case, layout=VEC)
    inp = inputs.build(vec)
    assert inp.pool.layout == VEC
    page = layouts.VECTORIZED.page_shape(16, 1, vec.dims.latent, vec.quant.kv, "latent")
    assert tuple(inp.pool.data.shape[1:]) == page != (16, 1, vec.dims.latent)
    for r in range(len(vec.requests)):
        got = inp.pool.gather(r, dequant=False)
        assert torch.equal(fp8.as_ints(got), fp8.as_ints(inp.kv[r].stored)), r


def test_capability_layouts_are_checked_for_decode() -> None:
    vec = dataclasses.replace(DECODE, layout=VEC)
    assert Capability(layouts=(LIN,)).why_not(vec, "cpu") == "layout vectorized not in {linear}"
    assert Capability(layouts=(LIN,)).why_not(DECODE, "cpu") is None
    assert Capability().why_not(vec, "cpu") is None  # ANY: reads through the layout


@pytest.mark.parametrize("name", ["torch", "torch-split", "aiter-model",
                                  "aiter-model-nonpersistent"])
@pytest.mark.parametrize("case", [DECODE, SPARSE], ids=lambda c: c.kind)
def test_a_vectorized_decode_case_runs_or_skips_naming_the_layout(
        name: str, case: DecodeCase) -> None:
    backend = resolve(name)
    declared = backend.capabilities()[case.op].layouts
    assert declared is not None, f"{name} must list its {case.op} layouts"
    vec = dataclasses.replace(case, layout=VEC)
    v = run_case(vec, backend)
    if VEC in declared:
        assert v.status == PASS, v.summary()
    else:
        # the reason names the layouts declared, then (real adapters) where the limit is read
        assert v.status == SKIP and v.reason.split(" (", 1)[0] == (
            f"layout {VEC} not in {{{', '.join(declared)}}}"), v.reason
    linear_why = skip_reason(backend, case, "cpu")
    assert linear_why is None or "layout" not in linear_why


class ReadsPagesAsLinear:
    """A decode backend that takes any layout but reads the pool's memory as linear pages:
    right on linear pools, wrong on any other (why backends must declare their layouts)."""

    name = "reads-pages-as-linear"

    def capabilities(self) -> dict[str, Capability]:
        return {"mla_decode": Capability(causal=(True,))}

    def unavailable(self) -> str | None:
        return None

    def run(self, case: DecodeCase, inp: inputs.DecodeInputs) -> Output:
        pool = inp.pool
        as_linear = pool.data.view(pool.num_pages, case.page_size, 1, case.dims.latent)
        misread = KVPool(as_linear, pool.fmt, pool.scale, pool.table, LIN, pool.kind)
        return TorchBackend().run(case, dataclasses.replace(inp, pool=misread))


def test_the_judge_fails_a_backend_that_misreads_the_layout() -> None:
    assert run_case(DECODE, ReadsPagesAsLinear()).status == PASS
    v = run_case(dataclasses.replace(DECODE, layout=VEC), ReadsPagesAsLinear())
    assert v.status == FAIL, v.summary()


def test_given_pool_must_have_the_case_layout() -> None:
    vec = dataclasses.replace(DECODE, layout=VEC)
    built = inputs.build(vec)
    q = built.q.ideal
    kv = [t.ideal for t in built.kv]
    with pytest.raises(ValueError, match="pool is stored vectorized, the case's layout is linear"):
        inputs.decode_inputs_from_tensors(DECODE, q, kv, pool=built.pool)
    again = inputs.decode_inputs_from_tensors(vec, q, kv)
    assert again.pool.layout == VEC


def test_a_matrix_decode_group_can_take_a_layout_axis(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("""
name: m
description: decode layouts
groups:
  - name: dec
    kind: decode
    base: {requests: [[1, 40]], num_heads: 4, page_size: 16}
    axes: {layout: [linear, vectorized]}
""")
    cases = [mc.case for mc in load(str(path)).cases]
    assert [c.layout for c in cases] == [LIN, VEC]
    assert cases[0].id == dataclasses.replace(cases[1], layout=LIN).id
