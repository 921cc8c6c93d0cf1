"""Known failures are rules (mlacheck/known.py): each documents a real finding, reproduces on
its minimal case, matches cases of the shipped matrices, and is strict (XPASS fails)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from mlacheck import harness, known
from mlacheck.backends.aiter_triton import NVIDIA_FP8_Q_MIN_PAGE, NVIDIA_PAGES, fp8_q_needs_page
from mlacheck.backends.base import Capability, Range
from mlacheck.backends.registry import resolve
from mlacheck.matrices import load, names
from mlacheck.spec import OPS, DecodeCase, Op, Request

# The 41 ids that the H100 nightly of 2026-11-22 reported for finding 1 (the rule's origin).
FINDING_1_NIGHTLY_IDS = frozenset({
    "dec-b1-kv300-h16-p16-bf16-shuffled-a66560d0",
    "dec-b1-kv513-h16-p16-bf16-shuffled-29e4445a",
    "dec-b1-kv513-h16-p16-fp16-shuffled-63b13712",
    "dec-b1-kv513-h16-p64-bf16-shuffled-445e8f89",
    "dec-b1-kv513-h16-p64-e4m3fn-amax-shuffled-97823351",
    "dec-b1-kv513-h16-p64-e4m3fn-unit-shuffled-db24d198",
    "dec-b1-kv513-h16-p64-fp16-shuffled-d71a016d",
    "dec-b128-kv1-160-h16-p16-bf16-shuffled-bca36e12",
    "dec-b128-kv1000-32768-h128-p64-bf16-shuffled-7f65875f",
    "dec-b128-kv1000-32768-h128-p64-e4m3fn-amax-shuffled-7a838006",
    "dec-b128-kv1000-32768-h16-p64-bf16-shuffled-7d44f33a",
    "dec-b128-kv1000-32768-h16-p64-e4m3fn-amax-shuffled-752d649e",
    "dec-b2-kv17-900-h16-p16-bf16-shuffled-a83a6c30",
    "dec-b2-kv45-200-h16-p16-bf16-e4m3fn-amax-shuffled-a21043ab",
    "dec-b2-kv45-200-h16-p64-bf16-e4m3fn-amax-shuffled-a66851d8",
    "dec-b3-kv33-260-h12-p64-bf16-shuffled-b3216ee5",
    "dec-b3-kv33-260-h128-p64-bf16-shuffled-387ac3f7",
    "dec-b3-kv33-260-h16-p64-bf16-shuffled-c87ccb0c",
    "dec-b3-kv33-260-h24-p64-bf16-shuffled-d45ba7a1",
    "dec-b3-kv33-260-h32-p64-bf16-shuffled-987d6ac4",
    "dec-b3-kv33-260-h64-p64-bf16-shuffled-9bff1f56",
    "dec-b3-kv33-260-h8-p64-bf16-shuffled-57fec49c",
    "dec-b3-kv37-1100-h16-p16-bf16-high31-18b286f7",
    "dec-b3-kv37-1100-h16-p16-bf16-high32-69efb50e",
    "dec-b3-kv37-1100-h16-p64-bf16-high31-78fd5f15",
    "dec-b3-kv37-1100-h16-p64-bf16-high32-9546e944",
    "dec-b3-kv37-1100-h16-p64-e4m3fn-amax-high31-08882aa0",
    "dec-b3-kv37-1100-h16-p64-e4m3fn-amax-high32-154efdb4",
    "dec-b3-mtp2-kv37-1100-h16-p16-bf16-high31-de7544aa",
    "dec-b3-mtp2-kv37-1100-h16-p16-bf16-high32-04d9d59f",
    "dec-b3-mtp2-kv37-1100-h16-p64-bf16-high31-c89a6a21",
    "dec-b3-mtp2-kv37-1100-h16-p64-bf16-high32-0ce3fbde",
    "dec-b3-mtp2-kv37-1100-h16-p64-e4m3fn-amax-high31-9bd14009",
    "dec-b3-mtp2-kv37-1100-h16-p64-e4m3fn-amax-high32-bcba5d54",
    "dec-b32-kv10-400-h16-p16-bf16-shuffled-3329d8f9",
    "dec-b8-kv1-700-h16-p16-bf16-shuffled-f7b5906f",
    "dec-b8-kv1-700-h16-p16-fp16-shuffled-376f8a5c",
    "dec-b8-kv1-700-h16-p64-bf16-shuffled-fa459ec0",
    "dec-b8-kv1-700-h16-p64-e4m3fn-amax-shuffled-a41bd48b",
    "dec-b8-kv1-700-h16-p64-e4m3fn-unit-shuffled-aa21a73a",
    "dec-b8-kv1-700-h16-p64-fp16-shuffled-83846f78",
})


@pytest.mark.parametrize("rule", known.RULES, ids=lambda r: r.name)
def test_rule_names_its_finding_a_backend_and_reproduces_on_its_minimal_case(rule) -> None:  # noqa: ANN001
    for b in rule.backends:
        resolve(b)  # a typo in a backend name would match nothing
        assert rule.matches(b, rule.minimal_case)
    assert rule.op in OPS
    assert re.search(r"docs/gpu-results\.md, finding \d", rule.finding), rule.finding


@pytest.mark.parametrize("rule", known.RULES, ids=lambda r: r.name)
def test_every_rule_matches_a_case_of_some_matrix(rule) -> None:  # noqa: ANN001
    """For each backend it names: a rule is strict per backend, and a backend whose matrix
    cases it never matches documents nothing there."""
    cases = [mc.case for m in names() for mc in load(m).cases]
    unmatched = [b for b in rule.backends if not any(rule.matches(b, c) for c in cases)]
    assert not unmatched, f"{rule.name} matches no case of any matrix for {unmatched}"


def _h100_triton_decode() -> Capability:
    """aiter-triton's mla_decode capability on the H100 (NVIDIA, Triton 3.6), as measured."""
    fmts = ("bf16", "fp16", "fp8_e4m3fn")
    pairs = {(f, f) for f in fmts} | {("bf16", "fp8_e4m3fn")}
    return Capability(q_formats=fmts, kv_formats=fmts, format_pairs=frozenset(pairs),
                      scale_policies=("unit", "amax"), page_sizes=NVIDIA_PAGES,
                      rules=(fp8_q_needs_page(NVIDIA_FP8_Q_MIN_PAGE, NVIDIA_PAGES),),
                      head_counts=Range(1, 128),
                      uniform_q_len=True, causal=(True,), devices=("cuda",))


def test_finding_1_rule_selects_exactly_the_cases_that_failed_on_the_h100() -> None:
    """Of the nightly decode cases aiter-triton runs on the H100, the rule matches exactly
    the 41 that failed there (and none of the 13 that passed)."""
    cap = _h100_triton_decode()
    # the boundary-class groups came after that run
    # and so did the covering arrays (issue 34): the rule also selects 4 of decode-3wise's
    # cases, which that run never had (no H100 outcome to pin)
    later = {"decode-tile-boundary", "decode-tile-boundary-mtp", "decode-long-kv", "decode-empty",
             "decode-pairwise", "decode-3wise"}
    ran = [mc.case for mc in load("nightly").cases if mc.group not in later
           and isinstance(mc.case, DecodeCase) and cap.why_not(mc.case, "cuda") is None]
    matched = {c.id for c in ran if known.lookup("aiter-triton", c)}
    assert matched == FINDING_1_NIGHTLY_IDS
    assert len(ran) - len(matched) == 13


def test_finding_1_rule_reads_the_tile_a_large_page_runs_as(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """A page of whole tiles runs as a view with tile-sized pages (sm_90: 256 -> 64, 48 ->
    16): the kernel reads the tail of the last *tile*, so 128 tokens in a 256-token page have
    none; on ROCm 256 is a tile of its own."""
    from mlacheck.backends import aiter_triton_compat as compat

    def hit(kv: int, page: int) -> bool:
        return known.lookup("aiter-triton", DecodeCase((Request(1, kv),), page_size=page)) is not None

    monkeypatch.setattr(compat, "on_rocm", lambda: False)
    assert not hit(128, 256) and hit(300, 256) and not hit(32, 48) and hit(40, 48)
    monkeypatch.setattr(compat, "on_rocm", lambda: True)
    assert hit(128, 256) and not hit(256, 256)


def test_folded_heads_kv_offset_finding_reproduces_on_the_model() -> None:
    """Finding 2's minimal case: the model of AITER's planner writes another request's tail
    length into kv_offset, the metadata check fails, and the verdict carries the rule."""
    rule = next(r for r in known.RULES if r.name.endswith("gfx942"))
    v = harness.run_case(rule.minimal_case, resolve("aiter-model-gfx942"))
    assert v.status == "FAIL" and v.reason == "metadata", v.summary()
    assert v.known_rule == rule.name
    meta = next(c for c in v.checks if c.name == "metadata")
    assert "kv_offset 128, expected 132 (tokens of request 1" in meta.detail


class _torch_named:  # noqa: N801 - the correct torch backend under another backend's name
    def __init__(self, name: str) -> None:
        self.inner = resolve("torch")
        self.name = name

    def __getattr__(self, a: str):  # noqa: ANN204
        return getattr(self.inner, a)


def test_a_known_failure_that_passes_is_marked_for_xpass() -> None:
    """A rule matching a case that passes: the verdict still names the rule (the gate turns
    it into XPASS); a backend the rule does not name gets nothing."""
    rule = known.RULES[0]
    v = harness.run_case(rule.minimal_case, resolve("torch"))
    assert v.status == "PASS" and not v.known_rule

    v = harness.run_case(rule.minimal_case, _torch_named(rule.backends[0]))
    assert v.status == "PASS" and v.known_rule == rule.name


def test_nightly_case_of_finding_2_is_in_the_nightly_matrix() -> None:
    ids = {mc.case.id for mc in load("nightly").cases}
    assert "dec-b128-kv1000-32768-h128-p64-bf16-shuffled-7f65875f" in ids


# The H100 replay of 2026-11-26 (.dev/lead/fi96, fa3; fa2 failed the same nightly cases):
# (q_len, kv_len, heads) -> failed. The rule must select exactly the failing ones.
FINDING_3_REPLAY = {(2, 65, 96): True, (2, 66, 96): False, (2, 65, 128): False,
                    (2, 129, 96): True, (2, 65, 64): False}


def test_flashinfer_mtp_rule_selects_exactly_the_replayed_failures() -> None:
    for (q_len, kv_len, heads), failed in FINDING_3_REPLAY.items():
        case = DecodeCase(requests=(Request(q_len, kv_len),), num_heads=heads, page_size=64)
        assert known.flashinfer_mtp_last_key_dropped(case) is failed, (q_len, kv_len, heads)
    # and the two nightly cases that failed on the H100 (both kernels)
    ids = {"dec-b1-mtp2-kv3073-h96-p1-fp16", "dec-b35-mtp2-kv0-449-empty2-h96-p256-bf16"}
    hits = {c.id.rsplit("-", 1)[0] for c in (mc.case for mc in load("nightly").cases)
            if known.lookup("flashinfer", c)}
    assert {i for i in ids if any(h.startswith(i) for h in hits)} == ids


def test_flashinfer_mtp_rule_never_matches_single_token_decode() -> None:
    for heads in (8, 16, 32, 64, 96, 128):
        for kv in (1, 63, 64, 65, 129, 4097):
            case = DecodeCase(requests=(Request(1, kv),) * 3, num_heads=heads, page_size=64)
            assert not known.flashinfer_mtp_last_key_dropped(case)


def test_a_non_strict_rule_leaves_a_pass_unlabelled() -> None:
    """Non-strict (the dropped key's weight depends on the draw): a matching case that passes
    is a plain PASS, not XPASS; the strict rules stay strict."""
    rule = next(r for r in known.RULES if not r.strict)

    v = harness.run_case(rule.minimal_case, _torch_named(rule.backends[0]))
    assert v.status == "PASS" and not v.known_rule and v.bucket == "PASS"


def test_aiter_triton_indexer_rule_matches_real_scale_high_pools_only() -> None:
    from mlacheck.spec import PagedIndexerCase, Placement
    rule = next(r for r in known.RULES if r.op == "paged_mqa_logits")
    for offset, bits, expected in ((2**31, 32, True), (2**32, 32, True), (2**30, 32, False)):
        case = PagedIndexerCase(requests=(Request(1, 700),),
                                placement=Placement("high", offset_bytes=offset, offset_bits=bits))
        assert rule.matches("aiter-triton", case) is expected
    scaled = PagedIndexerCase(requests=(Request(1, 700),),
                              placement=Placement("high", offset_bytes=2**31).scaled(24))
    assert not rule.matches("aiter-triton", scaled)
    assert not rule.matches("deepgemm", rule.minimal_case)


def test_a_device_error_on_a_documented_case_is_known(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """A kernel that poisons the device (illegal address) on a case a rule documents as a
    CRASH: the CRASH the worker records before it stops carries the rule, like any other
    verdict (the H100 nightly's AITER indexer crashes past 2^31 were unlabelled CRASHes:
    exit 1). A small case of a rule, documented here as crashing too."""
    rule = dataclasses.replace(
        next(r for r in known.RULES if r.name.startswith("flashinfer-mla-mtp")),
        fails_as=("FAIL", "CRASH"))
    monkeypatch.setattr(known, "RULES", (rule,))
    torch_backend = _torch_named(rule.backends[0])

    class Faulting:
        name = rule.backends[0]

        def __getattr__(self, a: str):  # noqa: ANN204
            return getattr(torch_backend, a)

        def run(self, case, inputs):  # noqa: ANN001, ANN201
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(harness.DeviceError) as got:
        harness.run(rule.minimal_case, Faulting(), harness.RunOptions("cpu"))
    v = got.value.verdict
    assert v.status == "CRASH" and v.known_rule == rule.name and v.bucket == "KNOWN"
    assert "illegal memory access" in v.reason


# The H100 premerge runs of 2026-11-26 (FlashInfer 0.7.2.post1, fa2, `-k "pf- and e4m3"`, seeds
# 0-2; /work/state/gpu-s4/fp8p): every FP8-K/V prefill case fa2 executed FAILed, these 21.
FINDING_5_H100_FAILS = {
    0: {"pf-s33-q139-h24-bf16-e4m3fn-amax-causal-ties-d00bbbb4",
        "pf-s5-q67-ctx253-h48-bf16-e4m3fn-amax-causal-layer-302d1b1f",
        "pf-s35-q137-ctx149-empty2-h12-bf16-e4m3fn-unit-full-ties-aa1c4cd1",
        "pf-s33-q139-h64-bf16-e4m3fn-amax-causal-p1lin-shuffled-ties-a34b875b",
        "pf-s1-q17-h48-bf16-e4m3fn-unit-causal-p32lin-shuffled-ties-7b1bafb4",
        "pf-s1-q5-h64-bf16-e4m3fn-unit-causal-cap30-ties-b7d50c9d",
        "pf-s6-q68-empty2-h128-bf16-e4m3fn-amax-full-cap30-p1lin-shuffled-sentinel-layer-e4e1d276"},
    1: {"pf-s33-q139-h64-bf16-e4m3fn-amax-causal-p1lin-shuffled-ties-fa050fb4",
        "pf-s5-q67-ctx253-h48-bf16-e4m3fn-amax-causal-layer-19aedda7",
        "pf-s6-q68-empty2-h128-bf16-e4m3fn-amax-full-cap30-p1lin-shuffled-sentinel-layer-28e6c1e2",
        "pf-s35-q137-ctx149-empty2-h12-bf16-e4m3fn-unit-full-ties-e840d137",
        "pf-s1-q17-h48-bf16-e4m3fn-unit-causal-p32lin-shuffled-ties-19d5ad6d",
        "pf-s33-q139-h24-bf16-e4m3fn-amax-causal-ties-3576e0a2",
        "pf-s1-q5-h64-bf16-e4m3fn-unit-causal-cap30-ties-dbcef9d0"},
    2: {"pf-s33-q139-h64-bf16-e4m3fn-amax-causal-p1lin-shuffled-ties-b6a292ea",
        "pf-s6-q68-empty2-h128-bf16-e4m3fn-amax-full-cap30-p1lin-shuffled-sentinel-layer-f3530b79",
        "pf-s5-q67-ctx253-h48-bf16-e4m3fn-amax-causal-layer-a4d6843f",
        "pf-s1-q17-h48-bf16-e4m3fn-unit-causal-p32lin-shuffled-ties-55c07107",
        "pf-s33-q139-h24-bf16-e4m3fn-amax-causal-ties-764594ef",
        "pf-s1-q5-h64-bf16-e4m3fn-unit-causal-cap30-ties-5aabf7b6",
        "pf-s35-q137-ctx149-empty2-h12-bf16-e4m3fn-unit-full-ties-d9ce921c"},
}


@pytest.mark.parametrize("seed", sorted(FINDING_5_H100_FAILS))
def test_flashinfer_fp8_kv_prefill_rule_selects_exactly_the_h100_failures(seed: int) -> None:
    """Of the premerge prefill cases fa2 runs (16-bit q; K/V 16-bit or fp8_e4m3fn with one
    scale per tensor; paged: the linear layout), the rule matches exactly the FP8-K/V ones that
    failed on the H100, and no 16-bit K/V case (those passed there)."""
    cases = [mc.case for mc in load("premerge", seed=seed).cases
             if mc.case.op in (Op.PREFILL, Op.PAGED_PREFILL)
             and mc.case.quant.q in ("bf16", "fp16") and not mc.case.quant.per_token
             and mc.case.quant.kv in ("bf16", "fp16", "fp8_e4m3fn")
             and (mc.case.paging is None or mc.case.paging.layout == "linear")]
    matched = {c.id for c in cases if known.lookup("flashinfer", c)}
    assert matched == FINDING_5_H100_FAILS[seed]
    assert not any(known.lookup("flashinfer", c) for c in cases if c.quant.kv in ("bf16", "fp16"))
    assert not any(known.lookup("flashinfer-fa3", c) for c in cases)


def test_flashinfer_fp8_kv_prefill_rule_follows_the_head_width_and_the_keys_a_row_sees() -> None:
    """128-element K rows (and 256) are loaded whole; a row seeing a single key is right."""
    from mlacheck.spec import MLADims, PrefillCase, Quant, Segment
    fp8 = Quant("bf16", "fp8_e4m3fn", "unit")
    for segments, dims, quant, expected in (
            ((Segment(16),), MLADims(), fp8, True),
            ((Segment(1, 1),), MLADims(), fp8, True),  # q_len 1 over 2 keys
            ((Segment(1),) * 4, MLADims(), fp8, False),  # every row sees one key
            ((Segment(16),), MLADims(), Quant("bf16", "bf16"), False),
            ((Segment(16),), MLADims(qk_nope=64), fp8, False),  # qk 128
            ((Segment(16),), MLADims(qk_nope=192), fp8, False)):  # qk 256
        case = PrefillCase(segments=segments, dims=dims, quant=quant)
        assert known.flashinfer_fa2_one_byte_k_row_partly_unread(case) is expected, (segments, dims)


def test_finding_2_rule_plans_the_requests_the_adapter_hands_the_planner() -> None:
    """Since e86526d the AITER adapter leaves empty requests (q_len 0) out of the call, so
    AITER's planner sees only the others; the rule planned all of them and missed a nightly
    case whose kept requests the model's planner gets wrong: an unlabelled FAIL that turned the
    nightly red (torch + aiter-model + aiter-triton, 4x H200, 2026-11-27; replayed on the CPU).
    The rule and the adapter plan the same requests: with the empty ones dropped from the case,
    the decision is the same, for every nightly decode case that has empty requests."""
    from mlacheck.backends.aiter.adapter import folded_kv_offsets_wrong

    cases = [mc.case for mc in load("nightly").cases
             if mc.case.op == Op.DECODE and 0 in mc.case.q_lengths]
    assert cases
    for case in cases:
        kept = dataclasses.replace(case, requests=tuple(r for r in case.requests if r.q_len))
        for gfx in (None, "gfx942", "gfx950"):
            assert folded_kv_offsets_wrong(case, gfx) == folded_kv_offsets_wrong(kept, gfx), (
                case.id, gfx)


def test_finding_2_labels_the_nightly_case_with_empty_requests() -> None:
    """The nightly case that FAILed unlabelled: the model's planner gives request 2's split work
    another tail length; the verdict now carries finding 2's rule (a KNOWN failure)."""
    case = next(mc.case for mc in load("nightly").cases
                if mc.case.id.startswith("dec-b6-kv0-4161-empty2-h48-p64-bf16-shuffled-sentinel"))
    v = harness.run_case(case, resolve("aiter-model-gfx942"))
    assert v.status == "FAIL" and v.reason == "metadata", v.summary()
    assert v.known_rule == "aiter-v12-folded-last-page-lens-gfx942", v.summary()


# Finding 2's rule on the shipped matrices (how known.py asks it: per chip), pinned when the rule
# came to plan through the adapter's own planner arguments (case_planner_args): every case it
# answers True for (gfx942 only; the first three are the empty-request cases the rule missed
# while it planned every request) and False cases of every kind (folded heads with empty
# requests, page 1, FP8 on either chip, 128 heads, a16w8, MTP). The whole table (1208 answers
# over the 604 decode cases of premerge + nightly, 8 True) was compared before and after.
FINDING_2_TABLE = {
    ("dec-b6-kv0-4161-empty2-h48-p64-bf16-shuffled-sentinel-49ea00a9", "gfx942"): True,
    ("dec-b6-mtp3-kv0-4161-empty2-h48-p64vec-fp16-shuffled-sentinel-94df99d6", "gfx942"): True,
    ("dec-b7-kv0-3073-empty2-h64-p32vec-fp16-shuffled-ties-547d510f", "gfx942"): True,
    ("dec-b128-kv1000-32768-h128-p64-bf16-shuffled-7f65875f", "gfx942"): True,
    ("dec-b1-mtp3-kv4161-h24-p64-fp16-shuffled-ties-fae196a8", "gfx942"): True,
    ("dec-b1-mtp4-kv3073-h24-p32vec-e4m3fnuz-unit-shuffled-8f8d9941", "gfx942"): True,
    ("dec-b1-kv4161-h64-p32vec-bf16-shuffled-sentinel-1ab98b96", "gfx942"): True,
    ("dec-b1-mtp4-kv4161-h48-p32-bf16-shuffled-layer-ce6f77f3", "gfx942"): True,
    ("dec-b6-kv0-4161-empty2-h48-p64-bf16-shuffled-sentinel-49ea00a9", "gfx950"): False,
    ("dec-b7-kv0-3073-empty2-h64-p32vec-fp16-shuffled-ties-547d510f", "gfx950"): False,
    ("dec-b128-kv1000-32768-h128-p64-bf16-shuffled-7f65875f", "gfx950"): False,
    ("dec-b1-mtp4-kv3073-h24-p32vec-e4m3fnuz-unit-shuffled-8f8d9941", "gfx950"): False,
    ("dec-b5-mtp2-kv0-449-empty2-h48-p1024vec-bf16-shuffled-ties-a1b472e5", "gfx942"): False,
    ("dec-b35-kv0-1025-empty2-h48-p1-bf16-shuffled-sentinel-layer-60779b1e", "gfx950"): False,
    ("dec-b5-kv0-4161-empty2-h64-p1-e4m3fnuz-amax-shuffled-sentinel-ties-32e570bb", "gfx942"): False,
    ("dec-b4-mtp3-kv129-449-h24-p1-e4m3fn-amax-shuffled-ties-96e5115a", "gfx950"): False,
    ("dec-b33-mtp2-kv9-449-h128-p64vec-e4m3fnuz-unit-shuffled-sentinel-ties-a456da7b", "gfx950"): False,
    ("dec-b35-mtp4-kv0-511-empty2-h32-p256-bf16-e4m3fn-unit-shuffled-ties-4bbd46be", "gfx950"): False,
}


def test_finding_2_rule_answers_on_the_shipped_matrices_are_pinned() -> None:
    from mlacheck.backends.aiter.adapter import folded_kv_offsets_wrong

    cases = {mc.case.id: mc.case for m in ("premerge", "nightly") for mc in load(m).cases}
    got = {(cid, gfx): folded_kv_offsets_wrong(cases[cid], gfx) for cid, gfx in FINDING_2_TABLE}
    assert got == FINDING_2_TABLE


def test_finding_2_rule_plans_the_kept_requests_of_a_small_case() -> None:
    """An empty request between folded-head requests: AITER's planner (the model) is handed the
    three kept requests and gets request 1's split kv_offset wrong on gfx942. Planned over all
    four (what the rule did before c79006e), uni_seqlen_qo is -1 and the rule said no: the
    FAIL went unlabelled, as the nightly case did."""
    case = DecodeCase(requests=(Request(1, 17), Request(0, 0), Request(1, 300), Request(1, 17)),
                      num_heads=48, page_size=16)
    from mlacheck.backends.aiter.adapter import folded_kv_offsets_wrong

    assert folded_kv_offsets_wrong(case, "gfx942") and not folded_kv_offsets_wrong(case, "gfx950")
    v = harness.run_case(case, resolve("aiter-model-gfx942"))
    assert v.status == "FAIL" and v.reason == "metadata", v.summary()
    assert v.known_rule == "aiter-v12-folded-last-page-lens-gfx942", v.summary()
    assert harness.run_case(case, resolve("aiter-model-gfx950")).status == "PASS"
