"""DeepGEMM's indexer kernels through the `deepgemm` adapter, on a CPU with the fake
`deep_gemm` (tests/unit/nvidia/_nvidia_fakes.py: sm_90's asserts, fp32 math): the premerge
indexer cases it takes PASS, the rest SKIP with DeepGEMM's reason, planted kernel faults (no
ReLU, the next key's scale) FAIL on the logits, and importing mlacheck imports no deep_gemm.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from _nvidia_fakes import DEEP_GEMM_BUGS, fake_deep_gemm, install, on_cpu  # noqa: I001

from mlacheck.backends import deepgemm
from mlacheck.harness import run_case
from mlacheck.matrices import load
from mlacheck.spec import PagedIndexerCase, Request
from mlacheck.verdict import FAIL, PASS, SKIP

PREMERGE = [mc.case for mc in load("premerge").cases
            if mc.case.op in ("mqa_logits", "paged_mqa_logits")]
PAGED = PagedIndexerCase(requests=(Request(2, 100), Request(2, 64)), num_heads=64)


def backend(monkeypatch: pytest.MonkeyPatch, bug: str = "") -> deepgemm.DeepGemmBackend:
    install(monkeypatch, {"deep_gemm": fake_deep_gemm(bug)})
    return on_cpu(deepgemm.DeepGemmBackend())


def test_premerge_indexer_cases_pass_or_skip_with_deepgemms_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    b = backend(monkeypatch)
    statuses = {}
    for case in PREMERGE:
        v = run_case(case, b)
        statuses[case.id] = v.status
        if v.status == SKIP:
            assert "DeepGEMM" in v.reason, v.reason
        else:
            assert v.status == PASS, v.summary()
    assert {c.op for c in PREMERGE if statuses[c.id] == PASS} == {"mqa_logits", "paged_mqa_logits"}


@pytest.mark.parametrize("bug", DEEP_GEMM_BUGS)
def test_planted_kernel_faults_fail_on_the_logits(monkeypatch: pytest.MonkeyPatch,
                                                  bug: str) -> None:
    v = run_case(PAGED, backend(monkeypatch, bug))
    assert v.status == FAIL and "logit_error" in {c.name for c in v.failed_checks}, v.summary()


def test_columns_past_a_rows_length_are_the_adapters_minus_inf(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel leaves them unwritten (NaN in the fake): the adapter sets -inf there and
    says so; the case passes."""
    v = run_case(PAGED, backend(monkeypatch))
    assert v.status == PASS, v.summary()
    assert "not written" in v.implementation["deepgemm"]["past_length_columns"]


def test_no_deep_gemm_import_and_a_skip_without_it() -> None:
    code = ("import sys, mlacheck, mlacheck.backends.deepgemm as d; b = d.factory(); "
            "print(b.unavailable()); print('deep_gemm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith("deep_gemm not installed") and out[1] == "False"


def test_the_composed_nvidia_path_passes_where_both_kernels_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deepgemm-flashmla: DeepGEMM's paged logits -> top-k -> FlashMLA's sparse decode (both
    fakes): the premerge pipeline cases on V3.2's inputs PASS, the others SKIP naming the
    stage that refuses them; a DeepGEMM fault shows as a wrong selection."""
    from _nvidia_fakes import fake_flash_mla

    from mlacheck.backends.deepgemm import DeepGemmFlashMLAPipeline

    install(monkeypatch, {"deep_gemm": fake_deep_gemm(), "flash_mla": fake_flash_mla()})
    b = on_cpu(DeepGemmFlashMLAPipeline())
    b.deepgemm, b.flashmla = on_cpu(b.deepgemm), on_cpu(b.flashmla)
    cases = [mc.case for mc in load("premerge").cases if mc.case.op == "sparse_pipeline"]
    got = {c.id: run_case(c, b) for c in cases}
    passed = [i for i, v in got.items() if v.status == PASS]
    assert len(passed) >= 2, {i: v.summary() for i, v in got.items()}
    for v in got.values():
        assert v.status in (PASS, SKIP), v.summary()
    install(monkeypatch, {"deep_gemm": fake_deep_gemm("no-relu"), "flash_mla": fake_flash_mla()})
    bad = on_cpu(DeepGemmFlashMLAPipeline())
    bad.deepgemm, bad.flashmla = on_cpu(bad.deepgemm), on_cpu(bad.flashmla)
    v = run_case(next(c for c in cases if c.id == passed[0]), bad)
    assert v.status == FAIL and "selection" in {c.name for c in v.failed_checks}, v.summary()
