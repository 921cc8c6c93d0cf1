"""FlashMLA's sparse prefill (`flash_mla_sparse_fwd`, DeepSeek-V3.2) through the adapter, on a
CPU with the fake `flash_mla` (tests/unit/nvidia/_nvidia_fakes.py: sm_90's checks, fp32 math,
+inf LSE and -inf max_logits for rows without a valid index): the premerge sparse-prefill
cases the kernel takes PASS through mlacheck's judge, the rest SKIP with the kernel's reason,
and planted kernel faults (index -1 read as row 0, max_logits without the softmax scale) FAIL
on the check that names them.
"""

from __future__ import annotations

import pytest
from _nvidia_fakes import FLASH_MLA_SPARSE_PREFILL_BUGS, fake_flash_mla, install, on_cpu  # noqa: I001

from mlacheck.backends import flashmla
from mlacheck.harness import run_case
from mlacheck.matrices import load
from mlacheck.spec import Quant, Segment, SparsePrefillCase
from mlacheck.verdict import FAIL, PASS, SKIP

PREMERGE = [mc.case for mc in load("premerge").cases if mc.case.op == "mla_sparse_prefill"]
SMALL = SparsePrefillCase(segments=(Segment(6, 40), Segment(3, 0)), topk=128, num_heads=64,
                          empty_rows=1)


def backend(monkeypatch: pytest.MonkeyPatch, bug: str = "") -> flashmla.FlashMLABackend:
    install(monkeypatch, {"flash_mla": fake_flash_mla(bug)})
    return on_cpu(flashmla.FlashMLABackend())


def test_premerge_sparse_prefill_passes_or_skips_with_the_kernels_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    b = backend(monkeypatch)
    statuses = {}
    for case in PREMERGE:
        v = run_case(case, b)
        statuses[case.id] = v.status
        if v.status == SKIP:
            assert "h_q 64 or 128" in v.reason or "bf16" in v.reason, v.reason
        else:
            assert v.status == PASS, v.summary()
            assert not [c for c in v.checks if c.name == "max_logits" and "not checked" in c.detail]
    assert list(statuses.values()).count(PASS) >= 5, statuses


@pytest.mark.parametrize("topk", [64, 200])
def test_topk_not_a_multiple_of_128_runs_padded_with_minus_one(
        monkeypatch: pytest.MonkeyPatch, topk: int) -> None:
    """The kernel asserts topk % 128 == 0 (the fake too); the adapter pads with -1 (no key), the
    verdict says so, and a planted "-1 reads row 0" fault still FAILs through the padding."""
    case = SparsePrefillCase(segments=(Segment(4, 300), Segment(3, 0)), topk=topk, num_heads=64)
    v = run_case(case, backend(monkeypatch))
    assert v.status == PASS, v.summary()
    assert v.implementation["flashmla"]["indices_padded_to"] == -(-topk // 128) * 128
    assert run_case(SMALL, backend(monkeypatch)).implementation["flashmla"][
        "indices_padded_to"] is None
    v = run_case(case, backend(monkeypatch, "minus-one-reads-token-0"))
    assert v.status == FAIL, v.summary()


@pytest.mark.parametrize("bug,check", [("minus-one-reads-token-0", "row_error"),
                                       ("max-logits-unscaled", "max_logits")])
def test_planted_kernel_faults_fail_on_their_check(monkeypatch: pytest.MonkeyPatch, bug: str,
                                                   check: str) -> None:
    assert bug in FLASH_MLA_SPARSE_PREFILL_BUGS
    v = run_case(SMALL, backend(monkeypatch, bug))
    assert v.status == FAIL, v.summary()
    assert check in {c.name for c in v.failed_checks}, v.summary()


def test_the_lonely_rows_lse_is_read_as_minus_inf(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashMLA's +inf LSE of a row with no valid index is mlacheck's -inf (only there): the
    LSE and max_logits checks run and pass on a case with such a row."""
    assert SMALL.empty_rows and SMALL.quant == Quant("bf16", "bf16")
    v = run_case(SMALL, backend(monkeypatch))
    assert v.status == PASS, v.summary()
    checked = {c.name: c for c in v.checks}
    assert checked["lse"].passed and "not checked" not in checked["lse"].detail
    assert checked["max_logits"].passed and "not checked" not in checked["max_logits"].detail
