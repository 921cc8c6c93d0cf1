"""FlashInfer's `mla_sparse_prefill` through mla_sparse_decode's page-size-1 composition, on a
CPU with the fake `flashinfer` (tests/unit/nvidia/_nvidia_fakes.py: fp32 math per FlashInfer
request, base-2 LSE, a finite LSE for a request without keys).

FlashInfer has no sparse prefill entry point; a sparse prefill is the same attention per query
token as a top-k decode, so the adapter runs it as one (SparsePrefillInputs.as_sparse_decode): the
premerge cases PASS through mlacheck's judge for both release lines and both kernels, the
verdict says how it ran and why max_logits is not checked (the kernel has none: the adapter
states it in Output.metadata["max_logits"]), and a composition that gives a token another
token's index list FAILs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from _nvidia_fakes import fake_flashinfer, install, on_cpu  # noqa: I001  (test-local helper)

from mlacheck.backends import flashinfer
from mlacheck.harness import RunOptions, run_case
from mlacheck.matrices import load
from mlacheck.pipeline_inputs import SparsePrefillInputs, build_sparse_prefill
from mlacheck.spec import Op, Segment, SparsePrefillCase
from mlacheck.verdict import FAIL, PASS

PREMERGE = [mc.case for mc in load("premerge").cases if mc.case.op == Op.SPARSE_PREFILL]
# Two segments (their tokens see different windows), a token with no valid index, lists of
# different lengths (the second segment's tokens see 1..5 positions, the first's 40 of 44+).
SMALL = SparsePrefillCase(segments=(Segment(6, 40), Segment(5, 0)), topk=64, num_heads=16,
                          empty_rows=1)


def backend(monkeypatch: pytest.MonkeyPatch, kernel: str = "fa2", version: str = "0.2.14",
            bug: str = "") -> flashinfer.FlashInferBackend:
    install(monkeypatch, fake_flashinfer(bug, version=version))
    return on_cpu(flashinfer.FlashInferBackend(kernel))


@pytest.mark.parametrize("version", ["0.2.14", "0.7"])
@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_premerge_sparse_prefill_runs_as_the_page_size_1_composition(
        monkeypatch: pytest.MonkeyPatch, kernel: str, version: str) -> None:
    """Was a SKIP ("adapter: not wired"); every premerge case now executes and PASSes."""
    assert len(PREMERGE) >= 5
    b = backend(monkeypatch, kernel, version)
    for case in PREMERGE:
        v = run_case(case, b, RunOptions("cpu"))
        assert v.status == PASS, v.summary()
        meta = v.implementation["flashinfer"]
        assert meta["kernel"] == kernel and "page size 1" in meta["view"]
        assert f"one request per query token ({case.total_q})" in meta["view"]
        assert "page-size-1 pool" in meta["composition"]
        # max_logits: not the kernel's, and said so (a missing one without a reason FAILs)
        assert v.implementation["max_logits"] == flashinfer.NO_MAX_LOGITS
        checks = {c.name: c for c in v.checks}
        assert checks["max_logits"].passed  # nothing made up in its place
        assert checks["max_logits"].detail.endswith(f"not checked: {flashinfer.NO_MAX_LOGITS}")
        assert checks["lse"].passed and "not checked" not in checks["lse"].detail


def test_a_token_given_another_tokens_index_list_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong composition is caught: each query token handed its neighbour's list (tokens
    mapped to the wrong request) FAILs on the output rows."""
    real = SparsePrefillInputs.as_sparse_decode

    def shifted(inputs: SparsePrefillInputs) -> Any:
        twin, twin_inputs = real(inputs)
        return twin, replace(twin_inputs, topk_indices=twin_inputs.topk_indices.roll(1, 0))

    b = backend(monkeypatch)
    assert run_case(SMALL, b, RunOptions("cpu")).status == PASS
    monkeypatch.setattr(SparsePrefillInputs, "as_sparse_decode", shifted)
    v = run_case(SMALL, b, RunOptions("cpu"))
    assert v.status == FAIL and "row_error" in {c.name for c in v.failed_checks}, v.summary()


def test_a_kernel_fault_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    v = run_case(SMALL, backend(monkeypatch, bug="lse-natural"), RunOptions("cpu"))
    assert v.status == FAIL and "lse" in {c.name for c in v.failed_checks}, v.summary()


def _planned(monkeypatch: pytest.MonkeyPatch, b: flashinfer.FlashInferBackend,
             indices: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """(what plan() got, out, LSE) of one run of SMALL with these indices [T, topk]."""
    wrapper = __import__("sys").modules["flashinfer.mla"].BatchMLAPagedAttentionWrapper
    seen: dict[str, Any] = {}
    real_plan = wrapper.plan

    def plan(self: Any, **kw: Any) -> None:
        seen.update(kw)
        real_plan(self, **kw)

    monkeypatch.setattr(wrapper, "plan", plan)
    inputs = build_sparse_prefill(SMALL)
    inputs.indices = indices[:, None, :].to(torch.int32)
    got = b.run(SMALL, inputs)
    return seen, got.out.clone(), got.lse.clone()


def test_invalid_indices_anywhere_in_a_row_are_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per token: its valid indices as its own request's pages (lists of different lengths,
    kv_len 0 for the token without one), int32, page size 1, causal off, the case's
    softmax scale. -1 anywhere in a row and indices >= N (invalid, as FlashMLA documents and
    the golden reads them) are no key: shuffled rows with such sentinels give the same result."""
    b = backend(monkeypatch)
    idx = build_sparse_prefill(SMALL).indices[:, 0].long()
    valid = (idx >= 0).sum(1)
    seen, out, lse = _planned(monkeypatch, b, idx)
    assert seen["kv_len_arr"].tolist() == valid.tolist()
    assert len(set(valid.tolist())) >= 3 and 0 in valid.tolist()
    assert seen["kv_indices"].dtype == torch.int32 and seen["page_size"] == 1
    assert seen["causal"] is False and seen["sm_scale"] == SMALL.softmax_scale
    assert seen["qo_indptr"].tolist() == list(range(SMALL.total_q + 1))
    gen = torch.Generator().manual_seed(0)
    mixed = torch.stack([row[torch.randperm(row.numel(), generator=gen)] for row in idx])
    mixed[(mixed < 0) & (torch.rand(mixed.shape, generator=gen) < 0.5)] = SMALL.total_kv + 7
    assert (mixed >= SMALL.total_kv).any() and ((mixed >= 0) != (idx >= 0)).any()
    seen2, out2, lse2 = _planned(monkeypatch, b, mixed)
    assert seen2["kv_len_arr"].tolist() == valid.tolist()
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(lse2, lse)
