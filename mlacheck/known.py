"""Known failures: real kernel discrepancies that are documented findings, as rules.

A rule (PyTorch OpInfo's DecorateInfo idea) names a backend, an op, a predicate on the case
and the finding it documents. A FAIL/CRASH the rule matches is reported KNOWN (pytest xfail),
never hidden by a loosened tolerance. Rules are strict: a matching case that PASSes is XPASS
and fails the gate (unless the run allows it), so a fixed kernel bug gets its rule removed
instead of silently excusing a future regression. Findings are written up in
docs/gpu-results.md; each rule's `minimal_case` replays one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlacheck.spec import Case, DecodeCase, Op, Quant, Request


@dataclass(frozen=True)
class KnownFailure:
    name: str
    backends: tuple[str, ...]
    op: str
    applies: Callable[[Case], bool]
    finding: str
    minimal_case: Case  # reproduces it: `mlacheck replay '<its JSON>' --backend <backend>`
    strict: bool = True

    def matches(self, backend: str, case: Case) -> bool:
        """`applies` is asked only about cases of the rule's op."""
        return backend in self.backends and case.op == self.op and bool(self.applies(case))


def _nan_poisoned_partial_last_page(case: Case) -> bool:
    """A request whose last page is partial, in a pool whose tails hold NaN."""
    paging = case.paging
    return (paging is not None and case.placement.tail_poison == "nan"
            and any(n % paging.page_size for n in case.kv_lengths))


def _folded_kv_offset_wrong(gfx: str | None) -> Callable[[Case], bool]:
    """gfx None: the chip the environment selects (what the plain `aiter-model` runs as)."""
    def applies(case: Case) -> bool:
        from mlacheck.backends.aiter import folded_kv_offsets_wrong

        return folded_kv_offsets_wrong(case, gfx)  # asked about mla_decode cases only

    return applies


# Finding 2's minimal case on gfx942: 32 bf16 heads fold into two pseudo-batches.
_FOLDED_BF16 = DecodeCase(requests=(Request(1, 700), Request(1, 900)), num_heads=32, page_size=16)

RULES: tuple[KnownFailure, ...] = (
    KnownFailure(
        name="aiter-triton-partial-page-tail",
        backends=("aiter-triton",),
        op=Op.DECODE,
        applies=_nan_poisoned_partial_last_page,
        finding=("AITER Triton mla_decode_fwd reads the unused tail of a partial last page "
                 "without a mask and multiplies it by P=0: NaN in stale cache memory turns every "
                 "head of the request NaN (finite tails pass: see the -sentinel cases). "
                 "docs/gpu-results.md, finding 1"),
        # one request, kv 300, page 16: the last page holds 12 of 16 tokens
        minimal_case=DecodeCase(requests=(Request(1, 300),), num_heads=16, page_size=16),
    ),
    *(KnownFailure(
        name=f"aiter-v12-folded-last-page-lens-{gfx or 'env-chip'}",
        backends=backends,
        op=Op.DECODE,
        applies=_folded_kv_offset_wrong(gfx),
        finding=("AITER get_mla_metadata_v1 (v1.2 planner, csrc/kernels/mla/metadata/"
                 "v1_2_device.cuh at e4048607) indexes kv_last_page_lens by the pseudo-batch "
                 "index when heads are folded and page_size > 1: split works carry another "
                 "request's tail length (or a value read past the array) in kv_offset. The model "
                 "reproduces AITER's code; the output is unaffected at q_len 1. "
                 "docs/gpu-results.md, finding 2"),
        minimal_case=minimal,
    ) for gfx, backends, minimal in (
        (None, ("aiter-model",), _FOLDED_BF16),
        ("gfx942", ("aiter-model-gfx942",), _FOLDED_BF16),
        # gfx950 runs bf16 heads natively: the a16w8 path folds 24 heads
        ("gfx950", ("aiter-model-gfx950",),
         DecodeCase(requests=(Request(1, 700), Request(1, 900)), num_heads=24, page_size=16,
                    quant=Quant("bf16", "fp8_e4m3fn", "amax"))))),
)


def lookup(backend: str, case: Case) -> KnownFailure | None:
    """The rule documenting this (backend, case), if any."""
    for rule in RULES:
        if rule.matches(backend, case):
            return rule
    return None
