"""The AITER (ASM) adapter's `index_conversion` goes through AITER (aiter_conversion, the code
aiter-triton runs too): `compute_global_topk_ragged_indices_and_indptr` called by keyword where
the installed AITER has it (v0.1.18 .. v0.1.19.post2), else its two kernels as AITER main has
them (the fake AITER's head, the AITER model), else a SKIP naming both and where they are.
Row-major slots: AITER has no conversion for them, a sourced kernel-limit SKIP."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _aiter_fakes import install_fake_aiter  # noqa: I001  (test-local helper)

from mlacheck import sparse_index
from mlacheck.backends.aiter import AiterAdapter, model_gfx950_factory
from mlacheck.backends.aiter_conversion import ENTRY, ENTRY_MODULE, KERNEL_MODULE, KERNELS
from mlacheck.harness import run_case
from mlacheck.matrices.loader import load
from mlacheck.report.coverage import KERNEL, skip_class
from mlacheck.spec import IndexConversionCase, Placement, Request
from mlacheck.verdict import FAIL, PASS, SKIP

REQUESTS = (Request(1, 64), Request(2, 40), Request(1, 300), Request(0, 16))
RAGGED = IndexConversionCase(REQUESTS, topk=64, valid_cap=20, page_size=16,
                             index_layout="ragged", placement=Placement("shuffled"))
ROW_MAJOR = IndexConversionCase(REQUESTS, topk=64, page_size=16)
ENTRY_KEY = f"{ENTRY_MODULE}.{ENTRY}"


class FakeEntry:
    """AITER's compute_global_topk_ragged_indices_and_indptr (sparse_attention_dsv4.py:159-206
    at ROCm/aiter 70e9b02): (global_topk_ragged [T * topk], topk_indptr [T + 1], topk_lens [T])
    of each token's valid positions through its request's block table. Records its calls.
    `bug`: "offset" adds one to every slot."""

    def __init__(self, bug: str = "") -> None:
        self.bug = bug
        self.calls: list[dict[str, Any]] = []

    def __call__(self, topk_indices: torch.Tensor, token_to_req_indices: torch.Tensor,
                 block_table: torch.Tensor, block_size: int, is_valid_token: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.calls.append(dict(topk_indices=topk_indices, token_to_req_indices=token_to_req_indices,
                               block_table=block_table, block_size=block_size,
                               is_valid_token=is_valid_token))
        slots = sparse_index.to_global_slots(topk_indices, token_to_req_indices, block_table,
                                             block_size)
        ragged = sparse_index.to_ragged(slots + (self.bug == "offset") * (slots >= 0))
        out = torch.full((topk_indices.numel(),), -7, dtype=torch.int32)
        out[: ragged.flat.numel()] = ragged.flat.to(torch.int32)
        lens = (ragged.indptr[1:] - ragged.indptr[:-1]).to(torch.int32)
        return out, ragged.indptr.to(torch.int32), lens


def _adapter(monkeypatch: pytest.MonkeyPatch, name: str, persistent: bool = True,
             **replace: Any) -> AiterAdapter:
    install_fake_aiter(monkeypatch, name, replace=replace)
    return AiterAdapter(name, persistent=persistent, devices=("cpu",))


@pytest.mark.parametrize("persistent", [True, False])
def test_conversion_calls_aiters_entry_point_by_keyword(monkeypatch: pytest.MonkeyPatch,
                                                        persistent: bool) -> None:
    entry = FakeEntry()
    adapter = _adapter(monkeypatch, f"fake_aiter_entry_{persistent}", persistent,
                       **{ENTRY_KEY: entry})
    v = run_case(RAGGED, adapter)
    assert v.status == PASS, v.reason
    (call,) = entry.calls
    assert call["token_to_req_indices"].tolist() == [0, 1, 1, 2]  # the empty request owns none
    assert call["block_size"] == 16 and bool(call["is_valid_token"].all())
    assert call["topk_indices"].shape == (4, 64) and call["block_table"].dtype == torch.int32
    assert v.implementation["conversion"].startswith(ENTRY)
    entry.bug = "offset"  # what AITER returns is what is judged
    assert run_case(RAGGED, adapter).status == FAIL


def test_conversion_launches_the_kernels_where_the_entry_point_is_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """AITER main (e4048607a5): the entry point deleted, its kernels kept (the fake's head)."""
    v = run_case(RAGGED, _adapter(monkeypatch, "fake_aiter_kernels"))
    assert v.status == PASS, v.reason
    assert v.implementation["conversion"].startswith("_compute_topk_lens_kernel -> indptr")
    assert "not the entry point: installed aiter" in v.implementation["conversion"]
    assert f"has no {ENTRY}" in v.implementation["conversion"]


def test_a_broken_entry_point_module_is_named_where_the_kernels_serve(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry-point module that exists but fails to import: the kernels convert, and the
    verdict says why the entry point was not used (not a silent fallback)."""
    from mlacheck.backends import aiter_conversion

    def import_module(rel: str) -> Any:
        if rel == ENTRY_MODULE:
            raise ImportError("cannot import name 'fp8_dtype'")
        return type("Kernels", (), {k: object() for k in KERNELS})

    found = aiter_conversion.find(import_module, "0.1.19")
    assert found.kernels is not None and found.entry is None
    assert "ImportError: cannot import name 'fp8_dtype'" in (found.no_entry or "")


@pytest.mark.parametrize("gone", [KERNELS, KERNELS[1:]])
def test_conversion_without_entry_point_or_kernels_is_a_sourced_skip(
        monkeypatch: pytest.MonkeyPatch, gone: tuple[str, ...]) -> None:
    adapter = _adapter(monkeypatch, f"fake_aiter_no_conversion_{len(gone)}",
                       **{f"{KERNEL_MODULE}.{k}": None for k in gone})
    v = run_case(RAGGED, adapter)
    assert v.status == SKIP
    assert f"has no {ENTRY} (aiter/ops/triton/attention/sparse_attention_dsv4.py:159-206" in v.reason
    assert gone[-1] in v.reason
    assert "_triton_kernels/attention/sparse_attention_dsv4.py:64-129 at ROCm/aiter e4048607a5" in v.reason
    assert adapter.unavailable() is None  # the other ops are unaffected
    assert adapter.capabilities()["mla_sparse_decode"].refusal is None


@pytest.mark.parametrize("entry", [True, False])
def test_premerge_ragged_conversion_at_topk_2048_passes(monkeypatch: pytest.MonkeyPatch,
                                                        entry: bool) -> None:
    """premerge's page-1 / page-64 conversions at topk 2048 in AITER's (ragged) layout, through
    the entry point (v0.1.18 .. v0.1.19.post2) and through the kernels (main)."""
    fake = FakeEntry()
    adapter = _adapter(monkeypatch, f"fake_aiter_premerge_{entry}",
                       **({ENTRY_KEY: fake} if entry else {}))
    cases = [mc.case for mc in load("premerge").cases
             if mc.group == "index-conversion-pages" and mc.case.index_layout == "ragged"]
    assert sorted(c.page_size for c in cases) == [1, 64]
    for case in cases:
        v = run_case(case, adapter)
        assert v.status == PASS, v.reason
        assert v.implementation["conversion"].startswith(ENTRY if entry else KERNELS[0])
    assert len(fake.calls) == (2 if entry else 0)


def test_row_major_conversion_is_aiters_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = FakeEntry()
    v = run_case(ROW_MAJOR, _adapter(monkeypatch, "fake_aiter_row_major", **{ENTRY_KEY: entry}))
    assert v.status == SKIP and skip_class(v.reason) == KERNEL
    assert "_triton_kernels/attention/sparse_attention_dsv4.py:90-129" in v.reason
    assert not entry.calls


def test_model_converts_through_the_modelled_kernels() -> None:
    v = run_case(RAGGED, model_gfx950_factory())
    assert v.status == PASS, v.reason
    assert v.implementation["conversion"].startswith("_compute_topk_lens_kernel")
