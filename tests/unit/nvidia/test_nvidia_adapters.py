"""The FlashMLA and FlashInfer adapters against executable fakes of the libraries (CPU).

What runs here: argument plumbing (page tables, strided latent views, q reshapes, repacking
to page 64, per-q_len calls, LSE base), capability declarations, signature checks, and
that a planted library fault FAILs through the adapter. What does not: the real kernels
(docs/gpu-results.md has the H100 runs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from _nvidia_fakes import fake_flash_mla, fake_flashinfer, install, on_cpu, record_calls  # noqa: I001  (test-local helper)

from mlacheck.backends import flashinfer, flashmla
from mlacheck.backends.base import Capability
from mlacheck.harness import RunOptions, run_case
from mlacheck.inputs import build
from mlacheck.kvcache import repaged
from mlacheck.spec import (
    Case,
    DecodeCase,
    Op,
    Paging,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
    SparseDecodeCase,
    SparsePrefillCase,
)

BF16 = Quant("bf16", "bf16")

DECODE_CASES = [
    DecodeCase(requests=(Request(1, 70), Request(1, 129)), page_size=64, quant=BF16),
    DecodeCase(requests=(Request(2, 33), Request(0, 40), Request(1, 1), Request(3, 100)),
               page_size=16, quant=BF16, num_heads=8),
    DecodeCase(requests=(Request(1, 5), Request(0, 0), Request(4, 9)), page_size=1,
               quant=Quant("fp16", "fp16")),
    DecodeCase(requests=(Request(1, 1030),), page_size=1024, quant=BF16,
               placement=Placement("packed", tail_poison="sentinel")),
]
PREFILL_CASES = [
    PrefillCase(segments=(Segment(20, 4), Segment(0, 3), Segment(7, 0)), quant=BF16),
    PrefillCase(segments=(Segment(9, 30),), quant=BF16, causal=False),
    PrefillCase(segments=(Segment(16, 0),), quant=Quant("fp16", "fp16"), soft_cap=30.0),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.id)
def test_flashmla_adapter_passes_against_a_faithful_fake(
        monkeypatch: pytest.MonkeyPatch, case: DecodeCase) -> None:
    install(monkeypatch, {"flash_mla": fake_flash_mla()})
    v = run_case(case, on_cpu(flashmla.FlashMLABackend()), RunOptions("cpu"))
    assert v.status == "PASS", v.reason
    meta = v.implementation["flashmla"]
    assert meta["repacked_from_page_size"] == (None if case.page_size == 64 else case.page_size)
    assert meta["calls"] == len({r.q_len for r in case.requests if r.q_len})


def test_flashmla_fault_reading_the_poisoned_tail_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, {"flash_mla": fake_flash_mla("reads-whole-last-page")})
    for case in DECODE_CASES[:2]:  # page 64 as is, and page 16 repacked: both keep the poison
        v = run_case(case, on_cpu(flashmla.FlashMLABackend()), RunOptions("cpu"))
        assert v.status == "FAIL", (case.id, v.reason)


def test_repaged_pool_holds_the_same_tokens_and_poisons_the_tail() -> None:
    case = DECODE_CASES[1]
    inputs = build(case)
    pool = repaged(inputs.pool, 64, "nan", torch.Generator().manual_seed(1))
    assert pool.table.page_size == 64
    for r in range(pool.table.batch):
        assert torch.equal(pool.gather(r, dequant=False).view(torch.int16),
                           inputs.pool.gather(r, dequant=False).view(torch.int16))
    last = pool.table.pages_of(3)[-1]
    assert torch.isnan(pool.data[last, 100 % 64:].float()).all()


@pytest.mark.parametrize("case", DECODE_CASES + PREFILL_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
@pytest.mark.parametrize("version", ["0.2.14", "0.7"])
def test_flashinfer_adapter_passes_against_a_faithful_fake(
        monkeypatch: pytest.MonkeyPatch, case: DecodeCase | PrefillCase, kernel: str,
        version: str) -> None:
    install(monkeypatch, fake_flashinfer(version=version))
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend(kernel)), RunOptions("cpu"))
    assert v.status == "PASS", v.reason
    assert v.implementation["flashinfer"]["kernel"] == kernel
    if case.op == Op.DECODE:  # the MLA wrapper's call: structural where 0.7's API is there
        assert v.implementation["flashinfer"]["api"] == flashinfer.MLA_API[version == "0.7"]


@pytest.mark.parametrize(("bug", "case"), [("lse-natural", DECODE_CASES[0]),
                                           ("ignores-causal", PREFILL_CASES[0])])
def test_flashinfer_planted_faults_fail(monkeypatch: pytest.MonkeyPatch, bug: str,
                                       case: DecodeCase | PrefillCase) -> None:
    install(monkeypatch, fake_flashinfer(bug))
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend()), RunOptions("cpu"))
    assert v.status == "FAIL", v.reason


def test_fp8_is_a_skip_that_names_the_format(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, {"flash_mla": fake_flash_mla(), **fake_flashinfer()})
    case = DecodeCase(quant=Quant("fp8_e4m3fn", "fp8_e4m3fn"))
    for backend in (flashmla.FlashMLABackend(), flashinfer.FlashInferBackend()):
        reason = on_cpu(backend).capabilities()["mla_decode"].why_not(case, "cpu")
        assert reason and "fp8_e4m3fn" in reason
        v = run_case(case, on_cpu(backend), RunOptions("cpu"))  # a SKIP still says what was there
        assert v.status == "SKIP" and "fp8_e4m3fn" in v.reason
        assert "+fake" in v.implementation["version"] and v.implementation["torch"]


def test_changed_signatures_refuse_the_op_with_the_missing_keyword(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fmla = fake_flash_mla()
    fmla.flash_mla_with_kvcache = lambda q, k_cache, block_table, seqlens: None
    fi = fake_flashinfer()
    fi["flashinfer.prefill"].BatchPrefillWithRaggedKVCacheWrapper.plan = (
        lambda self, qo_indptr, kv_indptr: None)
    install(monkeypatch, {"flash_mla": fmla, **fi})
    mla_reason = flashmla.FlashMLABackend().capabilities()["mla_decode"].refusal
    assert mla_reason and "cache_seqlens" in mla_reason
    caps = flashinfer.FlashInferBackend().capabilities()
    assert caps["mla_decode"].refusal is None
    assert caps["mla_prefill"].refusal and "num_qo_heads" in caps["mla_prefill"].refusal


def test_not_installed_is_a_one_line_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "flash_mla", None)
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", None)
    assert "not installed" in flashmla.FlashMLABackend().unavailable()
    assert "not installed" in flashinfer.FlashInferBackend().unavailable()


def test_a_vectorized_decode_pool_is_a_skip_naming_the_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both libraries read linear pages only: a vectorized latent pool is not repacked."""
    install(monkeypatch, {"flash_mla": fake_flash_mla(), **fake_flashinfer()})
    vec = DecodeCase(requests=(Request(1, 70),), page_size=64, quant=BF16, layout="vectorized")
    for backend in (flashmla.FlashMLABackend(), flashinfer.FlashInferBackend()):
        v = run_case(vec, on_cpu(backend), RunOptions("cpu"))
        assert v.status == "SKIP" and v.reason.startswith("layout vectorized not in {linear}"), \
            v.reason
        assert run_case(DECODE_CASES[0], on_cpu(backend), RunOptions("cpu")).status == "PASS"


# --------------------------------------------------------------------------- issue 32:
# FlashInfer paged prefill, top-k through the MLA wrapper at page size 1, the 0.7 API

PAGED_CASES = [
    PrefillCase(segments=(Segment(20, 44), Segment(0, 9), Segment(5, 0)), quant=BF16,
                paging=Paging(16)),
    PrefillCase(segments=(Segment(9, 30),), quant=Quant("fp16", "fp16"), causal=False,
                paging=Paging(1)),
    PrefillCase(segments=(Segment(33, 100),), quant=BF16, soft_cap=30.0, paging=Paging(64)),
]
SPARSE_CASES = [
    SparseDecodeCase(requests=(Request(1, 300), Request(2, 77), Request(0, 40)), topk=64,
                     num_heads=8, page_size=16, quant=BF16),
    SparseDecodeCase(requests=(Request(1, 50), Request(1, 20)), topk=32, valid_cap=0,
                     num_heads=8, page_size=1, quant=BF16),
    SparseDecodeCase(requests=(Request(3, 129),), topk=100, valid_cap=40, num_heads=16,
                     page_size=64, quant=Quant("fp16", "fp16")),
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: c.id)
def test_flashinfer_paged_prefill_passes_with_the_k_and_v_pools_as_they_are(
        monkeypatch: pytest.MonkeyPatch, case: PrefillCase) -> None:
    install(monkeypatch, fake_flashinfer(version="0.7"))
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend("fa2")), RunOptions("cpu"))
    assert v.status == "PASS", v.reason
    assert v.op == "paged_prefill" and v.implementation["flashinfer"]["kernel"] == "fa2"


@pytest.mark.parametrize("version", ["0.2.14", "0.7"])
def test_flashinfer_fa3_paged_prefill_is_the_kernels_head_dim_refusal(
        monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """The sm_90 paged prefill takes only head_dim_qk == head_dim_vo (cudaErrorNotSupported
    otherwise: every paged case CRASHed on the H100 before this refusal was declared)."""
    install(monkeypatch, fake_flashinfer(version=version))
    v = run_case(PAGED_CASES[0], on_cpu(flashinfer.FlashInferBackend("fa3")), RunOptions("cpu"))
    assert v.status == "SKIP" and "head_dim_qk == head_dim_vo" in v.reason, v.reason
    assert "adapter:" not in v.reason  # a kernel limit, not the adapter's choice
    forced = on_cpu(flashinfer.FlashInferBackend("fa3"))
    forced.capabilities = lambda: {"paged_prefill": Capability(devices=("cpu",), empty_requests=True)}
    crashed = run_case(PAGED_CASES[0], forced, RunOptions("cpu"))
    assert crashed.status == "CRASH" and "operation not supported" in crashed.reason


def test_flashinfer_02_fa2_paged_prefill_is_the_kernels_stride_refusal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """0.2.x's fa2 paged prefill refuses K/V caches of different strides: a SKIP saying so,
    and the refusal is real (the fake, as csrc/batch_prefill.cu, raises when called)."""
    install(monkeypatch, fake_flashinfer(version="0.2.14"))
    backend = on_cpu(flashinfer.FlashInferBackend("fa2"))
    v = run_case(PAGED_CASES[0], backend, RunOptions("cpu"))
    assert v.status == "SKIP" and "k/v strides must be identical" in v.reason, v.reason
    assert "adapter:" not in v.reason  # a kernel limit, not the adapter's choice
    forced = on_cpu(flashinfer.FlashInferBackend("fa2"))
    forced.capabilities = lambda: {"paged_prefill": Capability(devices=("cpu",), empty_requests=True)}
    crashed = run_case(PAGED_CASES[0], forced, RunOptions("cpu"))
    assert crashed.status == "CRASH" and "k/v strides must be identical" in crashed.reason


def test_flashinfer_paged_prefill_reading_the_poisoned_tail_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_flashinfer("reads-whole-last-page", version="0.7"))
    v = run_case(PAGED_CASES[0], on_cpu(flashinfer.FlashInferBackend("fa2")), RunOptions("cpu"))
    assert v.status == "FAIL", v.reason


@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("version", ["0.2.14", "0.7"])
def test_flashinfer_topk_decode_runs_as_page_size_1_over_a_view_of_the_pool(
        monkeypatch: pytest.MonkeyPatch, case: SparseDecodeCase, version: str) -> None:
    install(monkeypatch, fake_flashinfer(version=version))
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend("fa3")), RunOptions("cpu"))
    assert v.status == "PASS", v.reason
    view = v.implementation["flashinfer"]["view"]
    assert "page size 1" in view and "no copy" in view and f"({case.total_q})" in view
    assert v.implementation["flashinfer"]["api"] == flashinfer.MLA_API[version == "0.7"]


def test_flashinfer_topk_decode_with_a_planted_fault_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fake_flashinfer("lse-natural"))
    v = run_case(SPARSE_CASES[0], on_cpu(flashinfer.FlashInferBackend()), RunOptions("cpu"))
    assert v.status == "FAIL", v.reason


@pytest.mark.parametrize("scale", ["unit", "amax"])
def test_flashinfer_07_takes_an_fp8_kv_cache_under_bf16_q(
        monkeypatch: pytest.MonkeyPatch, scale: str) -> None:
    case = DecodeCase(requests=(Request(1, 70), Request(2, 129)), page_size=16, num_heads=8,
                      quant=Quant("bf16", "fp8_e4m3fn", scale))
    install(monkeypatch, fake_flashinfer(version="0.7"))
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend()), RunOptions("cpu"))
    assert v.status == "PASS", v.reason
    install(monkeypatch, fake_flashinfer("ignores-kv-scale", version="0.7"))
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend()), RunOptions("cpu"))
    assert v.status == ("FAIL" if scale == "amax" else "PASS"), v.reason  # unit: scale 1
    install(monkeypatch, fake_flashinfer(version="0.2.14"))
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend()), RunOptions("cpu"))
    assert v.status == "SKIP" and "fp8_e4m3fn" in v.reason and "0.7.x has one" in v.reason


# --------------------------------------------------------------------------- 0.7's FP8 prefill:
# fp8_e4m3fn K/V under a 16-bit q on fa2, per-tensor k_scale / v_scale by keyword

FP8_KV_PREFILL = [
    PrefillCase(segments=(Segment(20, 40), Segment(0, 3), Segment(7, 0)),
                quant=Quant("bf16", "fp8_e4m3fn", "amax")),
    PrefillCase(segments=(Segment(16, 0),), quant=Quant("bf16", "fp8_e4m3fn", "unit"),
                soft_cap=30.0, causal=False),
    PrefillCase(segments=(Segment(20, 44), Segment(0, 9), Segment(5, 0)),
                quant=Quant("bf16", "fp8_e4m3fn", "amax"), paging=Paging(16)),
    PrefillCase(segments=(Segment(33, 100),), quant=Quant("bf16", "fp8_e4m3fn", "unit"),
                soft_cap=30.0, paging=Paging(1)),
]


def _recording_runs(fi: dict) -> list[dict]:
    """Record the keywords each prefill wrapper's run() gets (signature kept for the checks)."""
    seen: list[dict] = []
    for name in ("BatchPrefillWithRaggedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"):
        record_calls(getattr(fi["flashinfer.prefill"], name), "run", seen)
    return seen


@pytest.mark.parametrize("case", FP8_KV_PREFILL, ids=lambda c: c.id)
def test_flashinfer_07_fa2_prefill_takes_fp8_kv_with_its_per_tensor_scales(
        monkeypatch: pytest.MonkeyPatch, case: PrefillCase) -> None:
    fi = fake_flashinfer(version="0.7")
    seen = _recording_runs(fi)
    install(monkeypatch, fi)
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend("fa2")), RunOptions("cpu"))
    assert v.status == "PASS", v.reason
    inputs = build(case)
    k, vv = ((inputs.k_pool, inputs.v_pool) if case.paging else (inputs.k, inputs.v))
    want = {"k_scale": float(k.scale), "v_scale": float(vv.scale)}
    assert seen and all({n: kw[n] for n in want} == want for kw in seen), seen
    assert all(isinstance(kw["k_scale"], float) for kw in seen)
    assert v.implementation["flashinfer"]["kv_scales"] == want
    if case.quant.scale == "amax":
        assert want["k_scale"] != 1.0 and want["v_scale"] != 1.0  # the scales matter here
        install(monkeypatch, fake_flashinfer("ignores-kv-scale", version="0.7"))
        v = run_case(case, on_cpu(flashinfer.FlashInferBackend("fa2")), RunOptions("cpu"))
        assert v.status == "FAIL", v.reason


@pytest.mark.parametrize("op", [Op.PREFILL, Op.PAGED_PREFILL])
def test_flashinfer_07_fa2_fp8_kv_prefill_finding_is_known_on_its_minimal_case(
        monkeypatch: pytest.MonkeyPatch, op: Op) -> None:
    """Finding 5 (docs/gpu-results.md): with K rows read as 0.7.2's fa2 loads them (128 of
    MLA's 192 elements) the rule's minimal case FAILs and is KNOWN; read whole, it passes and
    still carries the rule (the gate's strict XPASS: a fixed kernel retires the rule)."""
    from mlacheck import known

    rule = next(r for r in known.RULES if r.name.startswith("flashinfer-fa2-fp8-kv") and r.op == op)
    install(monkeypatch, fake_flashinfer("k-rows-past-128-unread", version="0.7"))
    v = run_case(rule.minimal_case, on_cpu(flashinfer.FlashInferBackend("fa2")), RunOptions("cpu"))
    assert v.status == "FAIL" and v.known_rule == rule.name and v.bucket == "KNOWN", v.summary()
    install(monkeypatch, fake_flashinfer(version="0.7"))
    v = run_case(rule.minimal_case, on_cpu(flashinfer.FlashInferBackend("fa2")), RunOptions("cpu"))
    assert v.status == "PASS" and v.known_rule == rule.name, v.summary()


def test_flashinfer_16_bit_prefill_passes_no_scale_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    fi = fake_flashinfer(version="0.7")
    seen = _recording_runs(fi)
    install(monkeypatch, fi)
    for case in (PREFILL_CASES[0], PAGED_CASES[0]):
        assert run_case(case, on_cpu(flashinfer.FlashInferBackend("fa2")),
                        RunOptions("cpu")).status == "PASS"
    assert len(seen) == 2 and not any({"k_scale", "v_scale"} & set(kw) for kw in seen)


def _prefill(quant: Quant, paged: bool) -> PrefillCase:
    return PrefillCase(segments=(Segment(9, 30),), quant=quant,
                       paging=Paging(16) if paged else None)


@pytest.mark.parametrize("paged", [False, True], ids=["ragged", "paged"])
@pytest.mark.parametrize(("version", "kernel", "quant", "says"), [
    ("0.7", "fa2", Quant("fp8_e4m3fn", "fp8_e4m3fn"), "modules.py:1042"),
    ("0.7", "fa2", Quant("bf16", "fp8_e4m3fnuz"), "fnuz formats are AMD's"),
    ("0.7", "fa2", Quant("bf16", "fp8_e4m3fn", per_token=True), "one k_scale / v_scale per tensor"),
    ("0.7", "fa3", Quant("fp8_e4m3fn", "fp8_e4m3fn"), "batch_prefill_fp8_sm90.cu:156"),
    ("0.7", "fa3", Quant("bf16", "fp8_e4m3fn"), "FA3 FP8 KV cache currently requires FP8 query"),
    ("0.2.14", "fa2", Quant("bf16", "fp8_e4m3fn"), "0.2.14.post1, measured"),
], ids=lambda x: getattr(x, "slug", str(x)))
def test_flashinfer_fp8_prefill_skips_are_the_kernels_refusals_with_their_source(
        monkeypatch: pytest.MonkeyPatch, version: str, kernel: str, quant: Quant, says: str,
        paged: bool) -> None:
    if paged and quant.per_token:
        pytest.skip("per-token scales are decode-only for paged pools (inputs.build)")
    install(monkeypatch, fake_flashinfer(version=version))
    case = _prefill(quant, paged)
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend(kernel)), RunOptions("cpu"))
    assert v.status == "SKIP", v.reason
    assert "adapter:" not in v.reason
    if not (paged and (kernel == "fa3" or version == "0.2.14")):  # those refuse paged wholesale
        assert says in v.reason, v.reason


def test_flashinfer_07_fa2_fp8_q_refusal_is_real(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced past the capability, the (fake) library raises what 0.7.2's generator asserts."""
    install(monkeypatch, fake_flashinfer(version="0.7"))
    forced = on_cpu(flashinfer.FlashInferBackend("fa2"))
    forced.capabilities = lambda: {"mla_prefill": Capability(devices=("cpu",))}
    v = run_case(_prefill(Quant("fp8_e4m3fn", "fp8_e4m3fn"), False), forced, RunOptions("cpu"))
    assert v.status == "CRASH" and "fp8 tensor core is not supported in fa2 backend" in v.reason


# --------------------------------------------------------------------------- issue 32: every
# FlashInfer SKIP a kernel limit with its source (the sparse-path ops, 0.7's causal tile check)

H100_SMEM_PER_SM = 233472  # bytes of shared memory per SM of an H100 (228 KiB)
SPARSE_PATH_OPS = (Op.MQA_LOGITS, Op.PAGED_MQA_LOGITS, Op.SPARSE_PIPELINE, Op.INDEX_CONVERSION)


@pytest.fixture(scope="module")
def premerge_case_of() -> dict[str, object]:
    """The first premerge (seed 0) case of each op."""
    from mlacheck.matrices.loader import load

    cases: dict[str, object] = {}
    for mc in load("premerge", seed=0).cases:
        case = getattr(mc, "case", mc)
        cases.setdefault(case.op, case)
    return cases


def _coverage_column(verdicts: list) -> dict[tuple[str, str], str]:
    """(backend, op) -> the coverage column its verdicts fall in (one each here)."""
    from mlacheck.report.coverage import coverage

    cov = coverage(verdicts)
    return {(b, op): next(iter(c)) for (b, _, op), c in cov.counts.items()}


@pytest.mark.parametrize("version", ["0.7", "0.2.14"])
@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_flashinfer_sparse_path_skips_are_kernel_limits_on_an_h100(
        monkeypatch: pytest.MonkeyPatch, premerge_case_of: dict, version: str, kernel: str) -> None:
    """No FlashInfer kernel for the indexer logits (0.7: SM100+ only; 0.2.14: none), the
    pipeline they start, or a standalone positions -> slots conversion: kernel limits naming
    the source, in the coverage table's kernel-limit column."""
    from mlacheck.report.coverage import KERNEL

    install(monkeypatch, fake_flashinfer(version=version))
    monkeypatch.setattr(flashinfer, "gpu_arch", lambda: (9, 0))
    backend = on_cpu(flashinfer.FlashInferBackend(kernel))
    verdicts = [run_case(premerge_case_of[op], backend, RunOptions("cpu")) for op in SPARSE_PATH_OPS]
    says = {Op.MQA_LOGITS: "dense_mqa.py:28", Op.PAGED_MQA_LOGITS: "attn_scores/attn_scores.py:759",
            Op.SPARSE_PIPELINE: "the paged indexer logits",
            Op.INDEX_CONVERSION: "top_k_page_table_transform, topk.py:1077"}
    for op, v in zip(SPARSE_PATH_OPS, verdicts, strict=True):
        assert v.status == "SKIP" and says[op] in v.reason, (op, v.reason)
        if op != Op.INDEX_CONVERSION:
            assert ("none for this GPU (sm_90)" if version == "0.7" else "has no") in v.reason
    assert set(_coverage_column(verdicts).values()) == {KERNEL}


def test_flashinfer_07_sparse_path_on_a_gpu_with_the_kernel_is_the_adapters_choice(
        monkeypatch: pytest.MonkeyPatch, premerge_case_of: dict) -> None:
    """On sm_100 FlashInfer 0.7 has the indexer logits: not wiring them is the adapter's SKIP;
    0.2.14 has no top-k index kernel: a kernel limit."""
    from mlacheck.report.coverage import ADAPTER, KERNEL

    install(monkeypatch, fake_flashinfer(version="0.7"))
    monkeypatch.setattr(flashinfer, "gpu_arch", lambda: (10, 0))
    backend = on_cpu(flashinfer.FlashInferBackend("fa2"))
    ops = (Op.MQA_LOGITS, Op.PAGED_MQA_LOGITS, Op.SPARSE_PIPELINE)
    columns = _coverage_column([run_case(premerge_case_of[op], backend, RunOptions("cpu"))
                                for op in (*ops, Op.INDEX_CONVERSION)])
    assert {op: columns["flashinfer", op] for op in ops} == dict.fromkeys(ops, ADAPTER)
    assert columns["flashinfer", Op.INDEX_CONVERSION] == KERNEL
    install(monkeypatch, fake_flashinfer(version="0.2.14"))
    v = run_case(premerge_case_of[Op.TOPK], on_cpu(flashinfer.FlashInferBackend("fa2")),
                 RunOptions("cpu"))
    assert v.status == "SKIP" and "has no top-k index kernel" in v.reason, v.reason
    assert _coverage_column([v]) == {("flashinfer", Op.TOPK): KERNEL}


@pytest.mark.parametrize("version", ["0.7", "0.2.14"])
def test_flashinfer_decode_format_and_layout_skips_name_their_source(
        monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    install(monkeypatch, fake_flashinfer(version=version))
    backend = on_cpu(flashinfer.FlashInferBackend("fa2"))
    vec = DecodeCase(requests=(Request(1, 70),), page_size=64, quant=BF16, layout="vectorized")
    v = run_case(vec, backend, RunOptions("cpu"))
    assert v.status == "SKIP" and "csrc/batch_mla_run.cu:55-58" in v.reason, v.reason
    fnuz = DecodeCase(requests=(Request(1, 70),), page_size=64,
                      quant=Quant("bf16", "fp8_e4m3fnuz", "unit"))
    v = run_case(fnuz, backend, RunOptions("cpu"))
    says = "_fa_common.py:140" if version == "0.7" else "measured with 0.2.14.post1"
    assert v.status == "SKIP" and v.reason.startswith("kv format fp8_e4m3fnuz") and says in v.reason


@pytest.mark.parametrize("row", __import__("_h100_fi07_causal_tile").H100_FI07_CAUSAL_TILE,
                         ids=lambda r: f"{r[0]}-{r[1]}-h{r[2]}-b{len(r[3])}")
def test_flashinfer_07_causal_tile_rule_says_what_the_h100_refused(row: tuple) -> None:
    """The rule computed before plan() against what 0.7.2.post1's plan() did on the H100:
    the same (request, query, key, KV tile) where it refused, nothing where it ran the case."""
    kernel, kv, heads, q_lens, kv_lens, refused = row
    tile_kv = flashinfer.fa_kv_tile(kernel, kv, H100_SMEM_PER_SM)
    cut = flashinfer.fa_causal_tile_cut(list(q_lens), list(kv_lens), heads, tile_kv)
    assert (None if cut is None else (*cut[:3], tile_kv)) == refused


FINDING_3 = DecodeCase(requests=(Request(2, 65),), num_heads=96, page_size=64)  # known.py's


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_flashinfer_07_causal_tile_cut_is_a_kernel_limit_skip(
        monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """Finding 3's case: 0.7's plan() refuses it, so the adapter SKIPs it first, saying why (a
    kernel limit); forced past the rule, the (fake) library's plan() raises that refusal; one
    key more is no cut and runs; 0.2.14 (no such check) runs it."""
    from mlacheck.report.coverage import KERNEL, skip_class

    install(monkeypatch, fake_flashinfer(version="0.7"))
    monkeypatch.setattr(flashinfer, "smem_per_sm", lambda: H100_SMEM_PER_SM)
    backend = on_cpu(flashinfer.FlashInferBackend(kernel))
    v = run_case(FINDING_3, backend, RunOptions("cpu"))
    assert v.status == "SKIP", v.reason
    assert "_validate_fa_causal_tile_bound" in v.reason and "_fa_common.py:325-357" in v.reason
    assert "request 0, query token 1" in v.reason and "key 64 starts a 64-key KV tile" in v.reason
    assert skip_class(v.reason) == KERNEL
    forced = on_cpu(flashinfer.FlashInferBackend(kernel))
    caps = forced.capabilities()
    forced.capabilities = lambda: {**caps, "mla_decode": replace(caps["mla_decode"], rules=())}
    crashed = run_case(FINDING_3, forced, RunOptions("cpu"))
    assert "native execution would omit a visible key" in crashed.reason, crashed.reason
    one_more = replace(FINDING_3, requests=(Request(2, 66),))
    assert run_case(one_more, backend, RunOptions("cpu")).status == "PASS"
    install(monkeypatch, fake_flashinfer(version="0.2.14"))
    ran = run_case(FINDING_3, on_cpu(flashinfer.FlashInferBackend(kernel)), RunOptions("cpu"))
    assert ran.executed, ran.reason


def test_flashinfer_07_fa2_16_bit_tile_needs_the_gpus_shared_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fa2's 16-bit KV tile follows the GPU's shared memory: unknown (no GPU), the rule does not
    guess and the library's own refusal stands; an FP8 cache's tile (32) needs no GPU facts."""
    install(monkeypatch, fake_flashinfer(version="0.7"))
    monkeypatch.setattr(flashinfer, "smem_per_sm", lambda: None)
    backend = on_cpu(flashinfer.FlashInferBackend("fa2"))
    v = run_case(FINDING_3, backend, RunOptions("cpu"))
    assert v.status != "SKIP" and "native execution would omit a visible key" in v.reason
    fp8 = DecodeCase(requests=(Request(1, 300), Request(2, 65), Request(1, 1025)), num_heads=48,
                     page_size=64, quant=Quant("bf16", "fp8_e4m3fn", "unit"))
    v = run_case(fp8, backend, RunOptions("cpu"))
    assert v.status == "SKIP" and "key 64 starts a 32-key KV tile" in v.reason, v.reason


@pytest.mark.parametrize("form", ["decode", "prefill"])
@pytest.mark.parametrize("logits", ["distinct", "ties"])
def test_flashinfer_07_topk_runs_through_top_k_ragged_transform(
        monkeypatch: pytest.MonkeyPatch, premerge_case_of: dict, form: str, logits: str) -> None:
    """With the top-k module prebuilt, both row forms (request-local rows; batch-wide rows with
    each row's window start as row_starts) PASS against a faithful fake; a fake returning
    columns instead of positions relative to row_starts FAILs the prefill form (the decode
    form's rows start at 0)."""
    base = premerge_case_of[Op.TOPK]
    case = replace(base, form=form, logits=logits,
                   requests=(Request(2, 300), Request(0, 50), Request(3, 2100)))
    install(monkeypatch, fake_flashinfer(version="0.7"))
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend("fa2")), RunOptions("cpu"))
    assert v.status == "PASS", v.reason
    assert v.implementation["flashinfer"]["topk"].startswith("top_k_ragged_transform")
    install(monkeypatch, fake_flashinfer("topk-absolute-positions", version="0.7"))
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend("fa2")), RunOptions("cpu"))
    assert v.status == ("FAIL" if form == "prefill" else "PASS"), v.reason


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_flashinfer_07_topk_without_the_prebuilt_module_is_the_machines_skip(
        monkeypatch: pytest.MonkeyPatch, premerge_case_of: dict, kernel: str) -> None:
    """No prebuilt top-k module: the adapter does not call the top-k (the real one would build
    its JIT module inside the item, minutes; the fake fails if called) and the SKIP is the
    machine's, naming where the module was looked for and the tool that builds it."""
    from mlacheck.report.coverage import MACHINE

    install(monkeypatch, fake_flashinfer(version="0.7", topk_prebuilt=False))
    backend = on_cpu(flashinfer.FlashInferBackend(kernel))
    v = run_case(premerge_case_of[Op.TOPK], backend, RunOptions("cpu"))
    assert v.status == "SKIP", v.reason
    assert "top-k JIT module is not prebuilt here (no " in v.reason, v.reason
    assert "no-aot/topk/topk.so" in v.reason and "flashinfer_prebuild --topk-only" in v.reason
    assert _coverage_column([v]) == {(backend.name, Op.TOPK): MACHINE}


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_flashinfer_07_topk_with_a_prebuilt_module_that_does_not_load_is_the_machines_skip(
        monkeypatch: pytest.MonkeyPatch, premerge_case_of: dict, kernel: str) -> None:
    """The .so is there but does not load (built for another CUDA, cut short): FlashInfer
    would fall back to its 16-minute JIT build inside the item; the adapter says so instead."""
    from mlacheck.report.coverage import MACHINE

    install(monkeypatch, fake_flashinfer(version="0.7", topk_loads=False))
    backend = on_cpu(flashinfer.FlashInferBackend(kernel))
    v = run_case(premerge_case_of[Op.TOPK], backend, RunOptions("cpu"))
    assert v.status == "SKIP", v.reason
    assert "is there but does not load (FlashInfer's try_load" in v.reason, v.reason
    assert _coverage_column([v]) == {(backend.name, Op.TOPK): MACHINE}


def test_flashinfer_07_topk_when_the_module_cannot_be_asked_is_the_machines_skip(
        monkeypatch: pytest.MonkeyPatch, premerge_case_of: dict) -> None:
    """The generator checks the GPU first (check_cuda_arch, jit/core.py:122): its error is the
    machine's one-line reason, never a crash or a build."""
    from mlacheck.report.coverage import MACHINE

    modules = fake_flashinfer(version="0.7")

    def no_gpu() -> None:
        raise RuntimeError("FlashInfer requires GPUs with sm75 or higher.")

    monkeypatch.setattr(modules["flashinfer.jit.topk"], "gen_topk_module", no_gpu)
    install(monkeypatch, modules)
    v = run_case(premerge_case_of[Op.TOPK], on_cpu(flashinfer.FlashInferBackend("fa2")),
                 RunOptions("cpu"))
    assert v.status == "SKIP" and "RuntimeError: FlashInfer requires GPUs" in v.reason, v.reason
    assert _coverage_column([v]) == {("flashinfer", Op.TOPK): MACHINE}


# --------------------------------------------------------------------------- 0.7's structural
# MLA API: plan(metadata=MLAPlanMetadata.csr(...)) / run(query=, kv_cache=), where 0.7.2.post1
# deprecates the flat plan metadata and the q_nope / q_pe / ckv_cache / kpe_cache keywords

SPARSE_PREFILL_CASE = SparsePrefillCase(segments=(Segment(6, 40), Segment(5, 0)), topk=64,
                                        num_heads=16, empty_rows=1)
FLAT_PLAN = set(flashinfer.CALLED_PARAMETERS["mla.BatchMLAPagedAttentionWrapper.plan"])
FLAT_RUN = set(flashinfer.CALLED_PARAMETERS["mla.BatchMLAPagedAttentionWrapper.run"])


def _recorded_mla(monkeypatch: pytest.MonkeyPatch, version: str, case: Case, kernel: str = "fa2"
                  ) -> tuple[Any, list[dict], list[dict]]:
    """(verdict, plan() keywords, run() keywords) of one case through the MLA wrapper."""
    fi = fake_flashinfer(version=version)
    plans: list[dict] = []
    runs: list[dict] = []
    wrapper = fi["flashinfer.mla"].BatchMLAPagedAttentionWrapper
    record_calls(wrapper, "plan", plans)
    record_calls(wrapper, "run", runs)
    install(monkeypatch, fi)
    v = run_case(case, on_cpu(flashinfer.FlashInferBackend(kernel)), RunOptions("cpu"))
    return v, plans, runs


def _adjacent_views(pair: tuple[torch.Tensor, torch.Tensor], rank: int, width: int) -> bool:
    """(no-PE, PE) are views of one [..., width] buffer: no copy was made for the call."""
    nope, pe = pair
    return (nope.stride() == pe.stride() and nope.stride(-2) == width
            and pe.data_ptr() - nope.data_ptr() == rank * nope.element_size()
            and nope.untyped_storage().data_ptr() == pe.untyped_storage().data_ptr())


@pytest.mark.parametrize("case", [DECODE_CASES[1], DECODE_CASES[2], SPARSE_CASES[0],
                                  SPARSE_PREFILL_CASE], ids=lambda c: c.id)
def test_flashinfer_07_mla_wrapper_gets_the_structural_call(
        monkeypatch: pytest.MonkeyPatch, case: Case) -> None:
    """Decode, the top-k decode and sparse prefill compositions: metadata=MLAPlanMetadata.csr
    with the flat form's split layouts and a base-2 LSE declared at plan time, query= /
    kv_cache= as (no-PE, PE) views; none of 0.7.2's deprecated keywords (the fake fails them)."""
    v, plans, runs = _recorded_mla(monkeypatch, "0.7", case)
    assert v.status == "PASS", v.reason
    assert v.implementation["flashinfer"]["api"] == flashinfer.MLA_API[True]
    assert len(plans) == len(runs) == 1
    plan, run = plans[0], runs[0]
    assert set(plan) == set(flashinfer.STRUCTURAL_MLA_PARAMETERS[
        "mla.BatchMLAPagedAttentionWrapper.plan"]) and not FLAT_PLAN - set(plan) - {
        "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"}
    assert (plan["query_layout"], plan["kv_cache_layout"], plan["lse_mode"]) == (
        "split", "split", "base2")
    assert plan["sm_scale"] == case.softmax_scale and plan["causal"] is (case.op == Op.DECODE)
    meta = plan["metadata"]
    assert type(meta).__name__ == "MLAPlanMetadata" and meta.block_tables is None
    assert all(t.dtype == torch.int32 for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                                meta.kv_len_arr))
    assert set(run) == {"query", "kv_cache", "out", "return_lse"} and run["return_lse"] is True
    rank, width = case.dims.kv_lora_rank, case.dims.kv_lora_rank + case.dims.qk_rope
    assert _adjacent_views(run["query"], rank, width)
    assert _adjacent_views(run["kv_cache"], rank, width)
    assert run["kv_cache"][0].shape[1] == plan["page_size"]
    lse = next(c for c in v.checks if c.name == "lse")  # the run still returns the LSE
    assert lse.passed and "not checked" not in lse.detail, lse.detail


@pytest.mark.parametrize("case", [DECODE_CASES[1], SPARSE_CASES[0], SPARSE_PREFILL_CASE],
                         ids=lambda c: c.id)
def test_flashinfer_02_mla_wrapper_keeps_the_flat_call(
        monkeypatch: pytest.MonkeyPatch, case: Case) -> None:
    """0.2.14.post1 (no MLAPlanMetadata) gets the call as it was: the flat keywords only."""
    v, plans, runs = _recorded_mla(monkeypatch, "0.2.14", case)
    assert v.status == "PASS", v.reason
    assert v.implementation["flashinfer"]["api"] == flashinfer.MLA_API[False]
    assert [set(p) for p in plans] == [FLAT_PLAN] and [set(r) for r in runs] == [FLAT_RUN]


def test_flashinfer_07_fake_refuses_what_0_7_2_deprecates() -> None:
    """The 0.7 fake fails the calls 0.7.2 warns on, so the tests above can fail: the flat plan
    metadata, the separate-tensor run keywords, positional arguments, and an LSE asked of a plan
    that declared none (0.7.2 raises on that last one itself, _contracts.py:141-142)."""
    fi = fake_flashinfer(version="0.7")
    mla = fi["flashinfer.mla"]
    i32 = torch.int32
    table = dict(qo_indptr=torch.tensor([0, 1], dtype=i32),
                 kv_indptr=torch.tensor([0, 1], dtype=i32),
                 kv_indices=torch.tensor([0], dtype=i32), kv_len_arr=torch.tensor([3], dtype=i32))
    plan = dict(num_heads=1, head_dim_ckv=512, head_dim_kpe=64, page_size=4, causal=False,
                sm_scale=0.1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    w = mla.BatchMLAPagedAttentionWrapper(torch.empty(1), backend="fa2")
    with pytest.raises(AssertionError, match="flat plan metadata"):
        w.plan(**table, **plan)
    with pytest.raises(AssertionError, match="positional"):
        w.plan(*table.values(), **plan)
    bad = dict(table, kv_len_arr=torch.tensor([5], dtype=i32))  # 5 keys in 1 page of 4
    with pytest.raises(AssertionError, match="pages per request"):
        w.plan(metadata=mla.MLAPlanMetadata.csr(**bad), **plan)
    w.plan(metadata=mla.MLAPlanMetadata.csr(**table), **plan, query_layout="split",
           kv_cache_layout="split")  # lse_mode "none"
    q = torch.zeros(1, 1, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    query, kv_cache = (q[..., :512], q[..., 512:]), (kv[..., :512], kv[..., 512:])
    with pytest.raises(AssertionError, match="deprecated"):
        w.run(q_nope=query[0], q_pe=query[1], ckv_cache=kv_cache[0], kpe_cache=kv_cache[1],
              return_lse=True)
    with pytest.raises(ValueError, match="LSE mode mismatch"):
        w.run(query=query, kv_cache=kv_cache, return_lse=True)
    assert w.run(query=query, kv_cache=kv_cache).shape == (1, 1, 512)


def test_flashinfer_07_structural_signature_change_refuses_the_mla_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With 0.7's API the wrapper is checked against the structural keywords: a run() without
    kv_cache= refuses the MLA ops naming it (the flat keywords it still has do not count)."""
    fi = fake_flashinfer(version="0.7")
    wrapper = fi["flashinfer.mla"].BatchMLAPagedAttentionWrapper
    wrapper.run = lambda self, q_nope=None, q_pe=None, ckv_cache=None, kpe_cache=None, out=None, \
        return_lse=False, *, query=None: None
    install(monkeypatch, fi)
    caps = flashinfer.FlashInferBackend().capabilities()
    for op in (Op.DECODE, Op.SPARSE_DECODE, Op.SPARSE_PREFILL):
        assert caps[op].refusal and "'kv_cache'" in caps[op].refusal, caps[op].refusal
    assert caps[Op.PREFILL].refusal is None


def test_flashinfer_topk_generator_not_where_07_keeps_it_is_the_adapters_skip(
        monkeypatch: pytest.MonkeyPatch, premerge_case_of: dict) -> None:
    """A release that moved or renamed `jit.topk.gen_topk_module` still has the kernel; the
    adapter no longer finds its module. That is the adapter's to follow (coverage's adapter
    column), not a machine without a prebuilt module (found in review)."""
    from mlacheck.report.coverage import ADAPTER

    modules = fake_flashinfer(version="0.7")
    monkeypatch.delattr(modules["flashinfer.jit.topk"], "gen_topk_module")
    install(monkeypatch, modules)
    v = run_case(premerge_case_of[Op.TOPK], on_cpu(flashinfer.FlashInferBackend("fa2")),
                 RunOptions("cpu"))
    assert v.status == "SKIP" and "jit.topk.gen_topk_module is not there" in v.reason, v.reason
    assert _coverage_column([v]) == {("flashinfer", Op.TOPK): ADAPTER}
