"""Hypothesis strategies yield valid, round-tripping cases over the whole feature space, and
`find_failing_case` stays quiet on a correct backend but finds, and shrinks to the simplest
form, the failure of a deliberately wrong one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlacheck import strategies as S
from mlacheck.backends.base import Capability, Output
from mlacheck.backends.numerics import flash_attend, p_format_for
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.inputs import DecodeInputs, Inputs
from mlacheck.search import find_failing_case
from mlacheck.spec import (
    Case,
    DecodeCase,
    PrefillCase,
    Request,
    Segment,
    SparseDecodeCase,
    case_from_json,
    vector_width,
)

EXAMPLES = 60  # per strategy: cheap (no kernels run), enough to hit every sampled choice
CASE_SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow])


def round_trips(case: Case) -> None:
    again = case_from_json(case.to_json())
    assert again == case and again.id == case.id


@CASE_SETTINGS
@given(S.prefill_cases())
def test_prefill_cases_valid(case: PrefillCase) -> None:
    round_trips(case)
    assert case.paging is None
    assert sum(s.kv_len for s in case.segments) <= S.DEFAULT_MAX_TOKENS
    assert not (case.quant.is_fp8 and case.quant.scale == "unit" and case.profile == "stress")


@CASE_SETTINGS
@given(S.paged_prefill_cases())
def test_paged_prefill_cases_valid(case: PrefillCase) -> None:
    round_trips(case)
    assert case.paging is not None
    if case.paging.layout == "vectorized":
        assert case.paging.page_size % vector_width(case.quant.kv) == 0


@CASE_SETTINGS
@given(S.decode_cases())
def test_decode_cases_valid(case: DecodeCase) -> None:
    round_trips(case)
    assert 1 <= len(case.requests) <= S.DEFAULT_MAX_BATCH
    assert all(0 <= r.q_len <= min(S.DEFAULT_MAX_Q_LEN, r.kv_len) for r in case.requests)
    assert case.total_q >= 1


@CASE_SETTINGS
@given(S.sparse_cases())
def test_sparse_cases_valid(case: SparseDecodeCase) -> None:
    round_trips(case)
    assert case.topk in S.TOPKS
    assert case.valid_cap is None or case.valid_cap < case.topk


@pytest.mark.parametrize(
    ("strategy", "features"),
    [
        (S.prefill_cases(), {
            "multiseg": lambda c: len(c.segments) > 1,
            "context": lambda c: any(s.context_len for s in c.segments),
            "non-causal": lambda c: not c.causal,
            "soft cap": lambda c: c.soft_cap > 0,
            "fp8 unit": lambda c: c.quant.is_fp8 and c.quant.scale == "unit",
            "fnuz": lambda c: c.quant.q == "fp8_e4m3fnuz",
            "12 heads": lambda c: c.num_heads == 12,
            "128 heads": lambda c: c.num_heads == 128,
            "per-token fp8": lambda c: c.quant.per_token and c.quant.is_fp8,
        }),
        (S.paged_prefill_cases(), {
            "page 1": lambda c: c.paging.page_size == 1,
            "page 1024": lambda c: c.paging.page_size == 1024,
            "vectorized": lambda c: c.paging.layout == "vectorized",
            "sentinel": lambda c: c.placement.tail_poison == "sentinel",
        }),
        (S.decode_cases(), {
            "batch": lambda c: len(c.requests) > 1,
            "mtp": lambda c: c.max_q_len > 1,
            "q_len 4": lambda c: c.max_q_len == 4,
            "page 1": lambda c: c.page_size == 1,
            "fp16": lambda c: c.quant.q == "fp16",
            "fp8 kv only": lambda c: c.quant.q == "bf16" and c.quant.kv.startswith("fp8"),
        }),
        (S.sparse_cases(), {
            "below topk": lambda c: any(r.kv_len < c.topk for r in c.requests),
            "at topk": lambda c: any(r.kv_len == c.topk for r in c.requests),
            "above topk": lambda c: any(r.kv_len > c.topk for r in c.requests),
            "valid cap": lambda c: c.valid_cap is not None,
            "mtp": lambda c: c.max_q_len > 1,
            "empty request": lambda c: c.has_empty,
        }),
    ],
    ids=["prefill", "paged", "decode", "sparse"],
)
def test_strategies_reach_every_feature(
    strategy: st.SearchStrategy[Case], features: dict[str, Callable[[Case], bool]]
) -> None:
    seen: set[str] = set()

    @settings(max_examples=200, derandomize=True, database=None, deadline=None)
    @given(strategy)
    def collect(case: Case) -> None:
        seen.update(name for name, has in features.items() if has(case))

    collect()
    assert seen == set(features)


def test_cases_dispatches_on_op_name() -> None:
    with pytest.raises(ValueError, match="unknown op 'decode'"):
        S.cases("decode")

    @settings(max_examples=20, derandomize=True, database=None, deadline=None)
    @given(S.cases("mla_decode"), S.cases("paged_prefill"))
    def check(decode: Case, paged: Case) -> None:
        assert decode.op == "mla_decode" and paged.op == "paged_prefill"

    check()


# --------------------------------------------------------------------------- search

PERTURBED_FROM_HEAD = 16  # heads 16.. of the output are off: only num_heads > 16 can fail
PERTURBATION = 1.05  # 5%: far beyond the bf16 row budget (1.6e-2)
DROPS_LAST_KV_ABOVE = 33  # a kernel that loses the last kv token of requests longer than this


class _Wrapped:
    """A deliberately wrong backend around the torch one. Not a TorchBackend subclass: the
    harness would take a TorchBackend with default numerics as its own baseline."""

    name = "wrong"

    def __init__(self) -> None:
        self.inner = TorchBackend()

    def capabilities(self) -> dict[str, Capability]:
        return self.inner.capabilities()

    def unavailable(self) -> str | None:
        return None

    def run(self, case: Case, inputs: Inputs) -> Output:
        return self.inner.run(case, inputs)


class PerturbsHighHeads(_Wrapped):
    name = "perturbs-high-heads"

    def run(self, case: Case, inputs: Inputs) -> Output:
        out = self.inner.run(case, inputs)
        out.out[:, PERTURBED_FROM_HEAD:] *= PERTURBATION
        return out


class DropsLastKVToken(_Wrapped):
    name = "drops-last-kv-token"

    def run(self, case: Case, inputs: Inputs) -> Output:
        assert isinstance(inputs, DecodeInputs) and isinstance(case, DecodeCase)
        rank = case.dims.kv_lora_rank
        q = inputs.q.dequant()
        qo = inputs.qo_indptr.tolist()
        outs, lses = [], []
        for r, req in enumerate(case.requests):
            kv = inputs.pool.gather(r)
            if req.kv_len > DROPS_LAST_KV_ABOVE:
                kv = kv[:-1]
            o, lse = flash_attend(q[qo[r] : qo[r + 1]], kv, kv[..., :rank], case.softmax_scale,
                                  True, p_format_for(case.quant.kv, self.inner.numerics))
            outs.append(o)
            lses.append(lse)
        inputs.out.out.copy_(torch.cat(outs).to(inputs.out.out.dtype))
        return Output(inputs.out.out, torch.cat(lses), wrote_into_guarded=True)


def test_no_failure_on_the_reference_backend() -> None:
    assert find_failing_case(TorchBackend(), S.cases("any"), max_examples=20) is None


def test_finds_and_shrinks_a_head_bug_to_the_first_head_count_above_16() -> None:
    found = find_failing_case(PerturbsHighHeads(), S.prefill_cases())
    assert found is not None
    case, verdict = found
    assert verdict.status == "FAIL" and "row_error" in verdict.reason
    assert {h for w in verdict.where for h in w.heads} == set(range(16, case.num_heads))
    # the first head count in HEAD_COUNTS order above 16, everything else the simplest
    first_above = next(h for h in S.HEAD_COUNTS if h > PERTURBED_FROM_HEAD)
    assert case == PrefillCase(segments=(Segment(1),), num_heads=first_above)


def test_finds_and_shrinks_a_dropped_kv_token_to_the_threshold() -> None:
    found = find_failing_case(DropsLastKVToken(), S.decode_cases())
    assert found is not None
    case, verdict = found
    assert verdict.status == "FAIL" and "lse" in verdict.reason
    # the boundary branch is drawn first, so the failure keeps the first tile boundary past
    # the threshold (63 = 64 - 1) rather than the threshold itself (34)
    assert case.requests == (Request(1, 63),)
    assert case == DecodeCase(requests=case.requests)


def test_search_is_deterministic() -> None:
    first = find_failing_case(DropsLastKVToken(), S.decode_cases(), max_examples=50)
    second = find_failing_case(DropsLastKVToken(), S.decode_cases(), max_examples=50)
    assert first is not None and second is not None
    assert first[0] == second[0] and first[1].metrics == second[1].metrics


def _classes_drawn(strategy: st.SearchStrategy[Case], examples: int) -> set[tuple[str, str]]:
    """(boundary class, op) pairs of the cases `strategy` draws (cases only: nothing runs)."""
    from mlacheck.boundaries import classes_of

    seen: set[tuple[str, str]] = set()

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None)
    @given(strategy)
    def draw(case: Case) -> None:
        seen.update((name, case.op) for name in classes_of(case))

    draw()
    return seen


def test_strategies_reach_every_cpu_boundary_class_of_their_range() -> None:
    """The boundary classes (mlacheck/boundaries.py) are drawn first: within the default
    bounds (decode kv <= 512, 128 prefill tokens) every (class, op) those bounds allow shows
    up, empty sparse requests and per-token scales included. Out of range: tile multiples
    past 512 (decode) / 128 (prefill), a kv one off a 256+ tile in prefill, long kv and wide
    page ids (opt in, next test), multi-GB pools."""
    D, SP, P, PP = "mla_decode", "mla_sparse_decode", "mla_prefill", "paged_prefill"
    reachable = {
        *((f"kv-multiple-of-{m}", D) for m in (64, 128, 256, 512)),
        *((f"kv-multiple-of-{m}", P) for m in (64, 128)),
        ("kv-tile-off-by-one", D), ("partial-last-page", D), ("partial-last-page", PP),
        ("empty-request", D), ("empty-request", SP), ("empty-segment", P),
        ("empty-segment", PP), ("single-token-segment", P), ("soft-cap", P),
        ("per-token-scale", P),
    }
    seen = _classes_drawn(S.cases(), 1000)  # rarer pairs (a prefill kv multiple of 128) need more draws
    assert reachable <= seen, reachable - seen


def test_long_kv_and_wide_page_ids_are_an_opt_in_drawn_first() -> None:
    """decode_cases(long_kv=True, wide_page_ids=True) reaches every long-kv and page-id class
    within a few examples; the defaults never draw a kv past max_kv."""
    from mlacheck import boundaries

    wanted = {(f"kv-longer-than-{n}", "mla_decode") for n in boundaries.LONG_KV} | {
        ("kv-narrow-accumulation", "mla_decode"), ("page-id-past-2^15", "mla_decode"),
        ("page-id-past-2^16", "mla_decode")}
    seen = _classes_drawn(S.decode_cases(max_batch=1, long_kv=True, wide_page_ids=True), 30)
    assert wanted <= seen, wanted - seen
    assert not wanted & _classes_drawn(S.decode_cases(), 100)
