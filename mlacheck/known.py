"""Known failures: real kernel discrepancies that are documented findings, as rules.

A rule (PyTorch OpInfo's DecorateInfo idea) names a backend, an op, a predicate on the case
and the finding it documents. A FAIL/CRASH the rule matches is reported KNOWN (pytest xfail),
never hidden by a loosened tolerance. Rules are strict: a matching case that PASSes is XPASS
and fails the gate (unless the run allows it), so a fixed kernel bug gets its rule removed
instead of silently excusing a future regression. Findings are written up in
docs/gpu-results.md; each rule's `minimal_case` replays one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlacheck.formats import FORMAT_BYTES
from mlacheck.spec import (
    Case,
    DecodeCase,
    Op,
    PagedIndexerCase,
    Paging,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
    TopkCase,
)
from mlacheck.verdict import CRASH, FAIL


@dataclass(frozen=True)
class KnownFailure:
    name: str
    backends: tuple[str, ...]
    op: str
    applies: Callable[[Case], bool]
    finding: str
    minimal_case: Case  # reproduces it: `mlacheck replay '<its JSON>' --backend <backend>`
    # strict: a matching case that passes is XPASS (the finding may be fixed). Not strict only
    # where the bug's size depends on the inputs drawn (a dropped key's weight), so a
    # matching case can pass with the bug present; such a pass is a plain PASS.
    strict: bool = True
    # The bug can end the worker's process (an illegal memory access poisons its device
    # context; xdist replaces the worker, ~12 s of start-up): such cases run first, so the
    # replacement starts while the run is young (mlacheck.pytest_plugin's order).
    can_end_the_worker: bool = False
    # How the finding shows: a verdict of another status on a matching case is another bug,
    # not this one, and stays a FAIL / CRASH (on the H100 a 128-token decode view that ran out
    # of shared memory at compile, a CRASH, was labelled with finding 1's NaN-tail FAIL rule,
    # nightly seed 0, 2026-11-27).
    fails_as: tuple[str, ...] = (FAIL,)

    def matches(self, backend: str, case: Case) -> bool:
        """`applies` is asked only about cases of the rule's op."""
        return backend in self.backends and case.op == self.op and bool(self.applies(case))


def _nan_poisoned_partial_last_tile(case: Case) -> bool:
    """A request whose last KV tile is partial, in a pool whose tails hold NaN. The tile is
    mla_decode_fwd's: the page, or the smaller tile a page of whole tiles runs as (a view,
    aiter_triton.decode_tile): a page of 256 holding 128 tokens has no tail in its tiles."""
    from mlacheck.backends.aiter_triton import decode_tile, native_pages

    paging = case.paging
    if paging is None or case.placement.tail_poison != "nan":
        return False
    tile = decode_tile(paging.page_size, native_pages()) or paging.page_size
    return any(n % tile for n in case.kv_lengths)

def _topk_masked_chunk_reaches_stage2(case: Case) -> bool:
    from mlacheck.backends.aiter_triton import topk_masked_chunk_reaches_stage2

    return topk_masked_chunk_reaches_stage2(case)


def _folded_kv_offset_wrong(gfx: str | None) -> Callable[[Case], bool]:
    """gfx None: the chip the environment selects (what the plain `aiter-model` runs as)."""
    def applies(case: Case) -> bool:
        from mlacheck.backends.aiter import folded_kv_offsets_wrong

        return folded_kv_offsets_wrong(case, gfx)  # asked about mla_decode cases only

    return applies


# FlashInfer's MLA planner (include/flashinfer/attention/scheduler.cuh, MLAPlan): q rows are
# packed token-major (row = token * num_heads + head) and tiled by clusters of 64-row CTAs,
# two CTAs per cluster when the batch's mean packed q length exceeds 64; keys are loaded in
# 64-key tiles.
FLASHINFER_MLA_CTA_TILE_Q = 64
FLASHINFER_MLA_CTA_TILE_KV = 64


def flashinfer_mtp_last_key_dropped(case: Case) -> bool:
    """A request whose last causal key FlashInfer's MLA kernel never loads for some heads.

    mla.cuh / mla_hopper.cuh bound the last KV tile a cluster loads by `kv_len - q_len +
    (packed_qo_start + cluster_tile_q) / num_heads` (floor), where the cluster's last token t
    needs kv_len - q_len + t + 1 keys: one short whenever the cluster's row tile ends inside a
    token (num_heads not dividing the tile end). The lost key is a whole 64-key tile only when
    the needed count is 1 past a tile boundary, and those heads then attend without it."""
    reqs = case.requests
    heads = case.num_heads
    mean_packed = sum(r.q_len * heads for r in reqs) // len(reqs)
    tile = FLASHINFER_MLA_CTA_TILE_Q * (2 if mean_packed > FLASHINFER_MLA_CTA_TILE_Q else 1)
    for r in reqs:
        if r.q_len < 2 or r.kv_len == 0:
            continue
        for start in range(0, r.q_len * heads, tile):
            last_token = min((start + tile - 1) // heads, r.q_len - 1)
            needed = r.kv_len - r.q_len + last_token + 1
            loaded = r.kv_len - r.q_len + (start + tile) // heads
            if loaded < needed and needed % FLASHINFER_MLA_CTA_TILE_KV == 1:
                return True
    return False


# FlashInfer's fa2 prefill loads a K/V row into shared memory in 16-byte columns, 8 lanes per
# row, NUM_MMA_D / (8 / sizeof(DTypeKV)) times (include/flashinfer/attention/prefill.cuh:565,
# :637, :729 in 0.7.2.post1; the same loop at main fb28d7242): for a 1-byte K that is whole
# multiples of 128 elements, while q.k reads head_dim_qk / 16 columns. FlashInfer's own test
# says so: "the FA2 1-byte KV producers require head_dim to be a multiple of 128 elements"
# (tests/attention/test_batch_prefill_kernels.py, main fb28d7242); plan() does not check it.
FLASHINFER_FA2_ONE_BYTE_KV_ROW_ELEMENTS = 128


def flashinfer_fa2_one_byte_k_row_partly_unread(case: Case) -> bool:
    """A prefill of 16-bit q over 1-byte K/V (fa2 has no FP8-q path) whose q/k head width is not
    a multiple of 128 (MLA's 192 is wrong on the H100, 128 and 256 are right) with a query row
    that attends to two keys or more (a row that sees one key gets that key's V whatever its
    score, so it is right)."""
    assert isinstance(case, PrefillCase)
    return (FORMAT_BYTES[case.quant.q] == 2 and FORMAT_BYTES[case.quant.kv] == 1
            and case.dims.qk_head % FLASHINFER_FA2_ONE_BYTE_KV_ROW_ELEMENTS != 0
            and any(s.q_len >= 1 and s.kv_len >= 2 for s in case.segments))


def aiter_triton_block_offset_past_int32(case: Case) -> bool:
    """A paged indexer cache with live pages at byte offsets >= 2^31 (the `high` placements
    at real, 32-bit scale put half the live pages at or above their offset)."""
    assert isinstance(case, PagedIndexerCase)
    placement: Placement = case.placement
    return (placement.kind == "high" and placement.offset_bits == 32
            and placement.offset_bytes >= 2**31)


# Finding 2's minimal case on gfx942: 32 bf16 heads fold into two pseudo-batches.
_FOLDED_BF16 = DecodeCase(requests=(Request(1, 700), Request(1, 900)), num_heads=32, page_size=16)

RULES: tuple[KnownFailure, ...] = (
    KnownFailure(
        name="aiter-triton-partial-page-tail",
        backends=("aiter-triton",),
        op=Op.DECODE,
        applies=_nan_poisoned_partial_last_tile,
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
    KnownFailure(
        name="flashinfer-mla-mtp-cluster-tile-last-key",
        backends=("flashinfer", "flashinfer-fa3"),
        op=Op.DECODE,
        applies=flashinfer_mtp_last_key_dropped,
        finding=("FlashInfer MLA decode with q_len > 1: the last KV tile a cluster loads is "
                 "bounded by (packed_qo_start + cluster_tile_q) / num_heads, a floor where the "
                 "cluster's last token needs one more key (include/flashinfer/attention/mla.cuh "
                 "and mla_hopper.cuh, 0.2.14.post1 and main fb28d7242); with 96 heads and "
                 "kv_len = 1 mod 64 heads 0-31 of token 1 never see the last key. Replayed on "
                 "the H100: kv 65 / 129 with 96 heads fail, kv 66, 64 and 128 heads pass. "
                 "docs/gpu-results.md, finding 3"),
        # how large the missed key's weight is depends on the draw: a matching case may pass
        minimal_case=DecodeCase(requests=(Request(2, 65),), num_heads=96, page_size=64),
        strict=False,
    ),
    *(KnownFailure(
        name=f"flashinfer-fa2-fp8-kv-prefill-k-width-192-{op.value}",
        backends=("flashinfer",),
        op=op,
        applies=flashinfer_fa2_one_byte_k_row_partly_unread,
        finding=("FlashInfer fa2 prefill, 16-bit q over fp8_e4m3fn K/V (0.7.2.post1), with "
                 "MLA's head_dim_qk 192: wrong outputs. Replayed on the H100 by a direct "
                 "wrapper call against an FP32 reference over the same values: rel L2 0.58 "
                 "at 192/128 (ragged and paged), 0.0018 at 128/128 and 256/128 (= the bf16 "
                 "control's), an illegal address at 192/192. Source: the K tile producer "
                 "loads NUM_MMA_D / (8 / sizeof(DTypeKV)) 128-element column groups per row "
                 "(include/flashinfer/attention/prefill.cuh:565 ragged, :637 / :729 paged): "
                 "192 / 128 = 1, so K elements 128-191 (the rope part) are never loaded; no "
                 "host-side check. With q's elements 128-191 zeroed the error stays 0.32: the "
                 "loaded part is misplaced too (the k128B swizzle on a 12-column row, "
                 "permuted_smem.cuh:50, is the likely cause; not pinned down). Wrong whatever "
                 "k_scale / v_scale. docs/gpu-results.md, finding 5"),
        minimal_case=PrefillCase(segments=(Segment(16),), num_heads=16, paging=paging,
                                 quant=Quant("bf16", "fp8_e4m3fn", "unit")),
    ) for op, paging in ((Op.PREFILL, None), (Op.PAGED_PREFILL, Paging(16)))),
    KnownFailure(
        name="aiter-triton-paged-mqa-logits-int32-block-offset",
        backends=("aiter-triton",),
        op=Op.PAGED_MQA_LOGITS,
        applies=aiter_triton_block_offset_past_int32,
        finding=("AITER Triton deepgemm_fp8_paged_mqa_logits, non-gluon path "
                 "(_deepgemm_fp8_paged_mqa_logits, what runs outside gfx942 / gfx950 / gfx1250 "
                 "or on Triton < 3.5 without the AOT gluon kernel): the key address "
                 "physical_block_idx * stride_k_block is a 32-bit product (int32 block ids, "
                 "int32 stride), so pages at byte offsets >= 2^31 read other memory "
                 "(aiter/ops/triton/_triton_kernels/attention/pa_mqa_logits.py at e4048607a). "
                 "Replayed on the H100 with a direct call: pages below 2^31 right, pages past "
                 "it wrong. docs/gpu-results.md, finding 4"),
        minimal_case=PagedIndexerCase(requests=(Request(1, 700),), page_size=64,
                                      placement=Placement("high", offset_bytes=2**31)),
        # the nightly's two cases with 700-2100-token requests read outside any allocation:
        # "CUDA error: an illegal memory access" (H100 and 4x H200, 2026-11-26 / -27); on 4
        # GPUs they ran 27.5-28.2 s into a 49.6 s run and their replacements ended it
        can_end_the_worker=True,
        fails_as=(FAIL, CRASH),  # wrong keys where the memory is mapped (the replay)
    ),
    KnownFailure(
        name="aiter-triton-topk-minus-inf-in-stage-2",
        backends=("aiter-triton",),
        op=Op.TOPK,
        applies=_topk_masked_chunk_reaches_stage2,
        finding=("AITER Triton topk.topk, two-stage path (rows of > 1024 columns or k > 1024): "
                 "a stage-1 chunk that is all -inf (a row shorter than the batch's longest, "
                 "as the V3.2 indexer pads rows) sends its first pick, -inf, to stage 2, whose "
                 "bitonic compare-and-swap selects each pair's left / right element as "
                 "tl.sum(y * (1 - mask), 1) / tl.sum(y * mask, 1) (aiter/ops/triton/"
                 "_triton_kernels/topk.py:164-168, from FlagGems): -inf * 0 = NaN, so that "
                 "pair's values are not swapped while its indices are, and values and indices "
                 "go out of step. Replayed on the H100 with a direct call: a row with a whole "
                 "-inf chunk gets a pick outside the top-2048 and values != x[index]; the same "
                 "row with -1e30, or with no whole -inf chunk, is right. "
                 "docs/gpu-results.md, finding 6"),
        minimal_case=TopkCase(requests=(Request(1, 2048), Request(1, 4096)), topk=2048),
        # whether a row's selection goes wrong depends on where the NaN pair sits in the
        # network for the values drawn: a matching case can pass with the bug present
        strict=False,
    ),
)


def can_end_a_worker(case: Case, backends: Iterable[str]) -> bool:
    """Whether one of `backends` has a known failure on `case` that can end its process."""
    return any(rule.matches(b, case) for rule in RULES if rule.can_end_the_worker
               for b in backends)


def lookup(backend: str, case: Case) -> KnownFailure | None:
    """The rule documenting this (backend, case), if any."""
    for rule in RULES:
        if rule.matches(backend, case):
            return rule
    return None
