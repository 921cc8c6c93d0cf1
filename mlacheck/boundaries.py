"""Boundary classes: the case shapes where length- and index-dependent kernel bugs live.

A bug that only acts at a tile boundary, past a counter's range or on an empty segment
escapes any matrix without such a case: an audit of single-bug kernels found the judge
catching every bug a case let act, and the matrices letting through those no case reached.
Each class here names the shape, says why it matters, and has a predicate per case, so the
matrix loader can show what a matrix covers (`mlacheck list --coverage`), a test can require
smoke and premerge to cover every class that runs on a CPU, and the Hypothesis strategies
draw these shapes first. The catalogue a fault or a matrix group cites a class from is
mlacheck/bugclasses.py (numbered bug classes and these, by name). Importing this module
imports no torch (the catalogue is read by the torch-free fault catalogue).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mlacheck.spec import FORMAT_BYTES, PIPELINE_OPS, Case, Op

# Tile / split / partition sizes kernels use along kv (FlashAttention-style tiles 64-256,
# split-K partitions 512-2048, AITER's kv granularity, FlashMLA's 64-token pages).
TILE_SIZES: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
# Lengths past which narrow counters and clamps show: 2^13, 2^14, 2^16 tokens.
LONG_KV: tuple[int, ...] = (8192, 16384, 65536)
# Page ids past signed / unsigned 16-bit range.
WIDE_PAGE_ID_BITS: tuple[int, ...] = (15, 16)
# KV length from which a kernel that accumulates P.V (and the softmax sum) in bf16 fails the
# bf16 bound; measured with fault:narrow-accumulation on a 16-head decode (docs/detection.md).
NARROW_ACCUMULATION_KV = 4096


def kv_edges(lo: int, hi: int) -> tuple[int, ...]:
    """The kv lengths in [lo, hi] where the length classes below turn: a tile multiple and
    one either side (TILE_SIZES), the narrow-accumulation length, each long length and one
    past it (LONG_KV). The Hypothesis strategies draw these before any other length, so a
    search bounded past one of them meets it."""
    edges = {n for m in TILE_SIZES for n in (m - 1, m, m + 1)}
    edges |= {NARROW_ACCUMULATION_KV, *LONG_KV, *(n + 1 for n in LONG_KV)}
    return tuple(sorted(n for n in edges if lo <= n <= hi))

DECODE, PREFILL, SPARSE, PAGED = Op.DECODE, Op.PREFILL, Op.SPARSE_DECODE, Op.PAGED_PREFILL


@dataclass(frozen=True)
class BoundaryClass:
    name: str
    why: str
    ops: tuple[str, ...]  # the ops a matrix must cover it for
    applies: Callable[[Case], bool]
    # Runs on a CPU within a pre-merge budget. The others need multi-GB pools (byte offsets
    # past 2^31 / 2^32): the large_kv cases of premerge/nightly, deselected on CPU gates.
    # `applies` is asked only about cases of the class's ops (classes_of).
    cpu: bool = True


def _multiple_of(m: int) -> Callable[[Case], bool]:
    return lambda case: any(n > 0 and n % m == 0 for n in case.kv_lengths)


def _off_by_one(case: Case) -> bool:
    """A kv length one either side of a tile of 256 or more."""
    return any(n % m in (1, m - 1) and n >= m - 1 for n in case.kv_lengths
               for m in TILE_SIZES if m >= 256)


def _longer_than(n: int) -> Callable[[Case], bool]:
    return lambda case: max(case.kv_lengths) > n


def _page_geometry(case: Case) -> tuple[list[int], int, int] | None:
    """(kv lengths, page size, page bytes) of a paged case; None when not paged."""
    if case.paging is None:
        return None
    ps = case.paging.page_size
    return list(case.kv_lengths), ps, ps * case.page_token_values * FORMAT_BYTES[case.quant.kv]


# Share of a request's live pages that must sit past a page-id boundary: a wrapped id that
# lands on another live page changes one key, which a long softmax can average away (a
# uint16 page-id fault on kv 65537 with 9 pages past 2^16 passed; on kv 98305 it fails).
WIDE_PAGE_SHARE = 0.25


def live_pages_past(case: Case, page_id: int) -> float:
    """How many live pages sit at or past `page_id` (exact for packed placement; the
    expectation for shuffled / high, where live pages are drawn from first..first+live+spare)."""
    geo = _page_geometry(case)
    if geo is None:
        return 0.0
    lens, ps, page_bytes = geo
    live = sum(-(-n // ps) for n in lens)
    total = case.placement.pool_pages(lens, ps, page_bytes)
    first = total - live - case.placement.spare_pages
    window = live if case.placement.kind == "packed" else live + case.placement.spare_pages
    past = max(0, first + window - max(page_id, first))
    return live * past / window if window else 0.0


def _wide_ids(bits: int) -> Callable[[Case], bool]:
    def applies(case: Case) -> bool:
        geo = _page_geometry(case)
        if geo is None:
            return False
        live = sum(-(-n // geo[1]) for n in geo[0])
        return live_pages_past(case, 1 << bits) >= max(1.0, WIDE_PAGE_SHARE * live)
    return applies


def _partial_last_page(case: Case) -> bool:
    geo = _page_geometry(case)
    return geo is not None and any(n % geo[1] for n in geo[0])


# The kv tile of MLA decode kernels (AITER, FlashMLA: 64 tokens).
MTP_TILE = 64


def _mtp_short_last_tile(case: Case) -> bool:
    return any(u.q_len > 1 and u.kv_len > MTP_TILE and 0 < u.kv_len % MTP_TILE < u.q_len
               for u in case.units)


def _single_token_segment(case: Case) -> bool:
    return len(case.units) > 1 and any(u.q_len == 1 and u.kv_len > 1 for u in case.units)


def _live_bytes_past(bound: int) -> Callable[[Case], bool]:
    def applies(case: Case) -> bool:
        geo = _page_geometry(case)
        if geo is None:
            return False
        lens, ps, page_bytes = geo
        return case.placement.pool_pages(lens, ps, page_bytes) * page_bytes > bound
    return applies


# --------------------------------------------------------------------------- sparse pipeline
# The DeepSeek-V3.2 sparse path (mlacheck.spec): rows that select fewer than k positions
# (-1 padding inside the row), exactly k, none; MTP indexer rows; partial last pages of the
# paged key cache; exact ties at the k-th logit; windows that start past column 0.
TOPK, CONVERSION, SPARSE_PREFILL, PIPELINE = (Op.TOPK, Op.INDEX_CONVERSION, Op.SPARSE_PREFILL,
                                              Op.SPARSE_PIPELINE)
INDEXER, PAGED_INDEXER = Op.MQA_LOGITS, Op.PAGED_MQA_LOGITS


def _row_selections(case: Case) -> list[int]:
    """Per query row of a sparse-pipeline case, how many positions it selects."""
    if case.topk is None or case.op not in PIPELINE_OPS:
        return []
    counts = list(case.attended_lengths)
    for r in _lonely_rows(case):
        counts[r] = 0
    return counts


def _lonely_rows(case: Case) -> list[int]:
    n = getattr(case, "empty_rows", 0)
    if not n:
        return []
    from mlacheck.pipeline_inputs import lonely_rows

    return lonely_rows(case.total_q, n)  # type: ignore[union-attr]


def _row_below_k(case: Case) -> bool:
    return any(0 < n < case.topk for n in _row_selections(case))  # type: ignore[operator]


def _row_at_k(case: Case) -> bool:
    return case.op in PIPELINE_OPS and any(v == case.topk for v in case.visible_lengths)


def _empty_row(case: Case) -> bool:
    return any(n == 0 for n in _row_selections(case))


def _indexer_mtp(case: Case) -> bool:
    return getattr(case, "next_n", 1) > 1


def _pipeline_partial_page(case: Case) -> bool:
    ps = case.paging.page_size if case.paging is not None else 0
    return case.op in PIPELINE_OPS and ps > 1 and any(n % ps for n in case.kv_lengths)


def _exact_ties(case: Case) -> bool:
    return getattr(case, "logits", "") == "ties"


def _window_past_zero(case: Case) -> bool:
    if case.op == INDEXER or (case.op == TOPK and getattr(case, "form", "") == "prefill"):
        return any(q > 0 for q in case.q_lengths[1:])
    return False


CLASSES: tuple[BoundaryClass, ...] = (
    *(BoundaryClass(f"kv-multiple-of-{m}",
                    f"a kv length exactly a multiple of {m}: loop bounds and tile counts that are "
                    "right only for a partial last tile", (DECODE, PREFILL), _multiple_of(m))
      for m in TILE_SIZES),
    BoundaryClass("kv-tile-off-by-one",
                  "a kv length one either side of a tile of 256+: < vs <= in tile loops",
                  (DECODE, PREFILL), _off_by_one),
    *(BoundaryClass(f"kv-longer-than-{n}",
                    f"a decode kv longer than {n} tokens: clamps, 16-bit counters and narrow "
                    "accumulators", (DECODE,), _longer_than(n))
      for n in LONG_KV),
    BoundaryClass("kv-narrow-accumulation",
                  f"a decode kv of {NARROW_ACCUMULATION_KV}+ tokens: past it a bf16-accumulating "
                  "kernel exceeds the bf16 bound (shorter kv hides it)",
                  (DECODE,), _longer_than(NARROW_ACCUMULATION_KV - 1)),
    *(BoundaryClass(f"page-id-past-2^{b}",
                    f"a quarter or more of the live pages have ids of 2^{b} or more: page ids "
                    f"held in {b + 1}-bit integers wrap", (DECODE, SPARSE), _wide_ids(b))
      for b in WIDE_PAGE_ID_BITS),
    BoundaryClass("mtp-short-last-tile",
                  f"an MTP request whose kv is 1..q_len-1 past a multiple of {MTP_TILE}: its "
                  "last kv tile (and last split, for splits that are multiples of it) holds "
                  "fewer keys than it has query rows, so its first rows see no key there",
                  (DECODE,), _mtp_short_last_tile),
    BoundaryClass("partial-last-page",
                  "a last page only partly filled: tails must be masked, lengths right",
                  (DECODE, PAGED), _partial_last_page),
    BoundaryClass("empty-request", "a decode request with no query token (padded batch slot)",
                  (DECODE, SPARSE), lambda c: c.has_empty),
    BoundaryClass("empty-segment", "a prefill segment with no query token (repeated cu_seqlens)",
                  (PREFILL, PAGED), lambda c: c.has_empty),
    BoundaryClass("single-token-segment",
                  "a one-token segment with context in a multi-segment prefill (decode-like "
                  "rows inside a prefill batch)", (PREFILL,), _single_token_segment),
    BoundaryClass("soft-cap", "scores soft-capped (cap * tanh(s / cap)); on a paged pool, "
                  "next to poisoned partial-page tails", (PREFILL, PAGED),
                  lambda c: c.soft_cap > 0),
    BoundaryClass("per-token-scale", "FP8 scales per token instead of per tensor", (PREFILL,),
                  lambda c: c.quant.per_token and c.quant.is_fp8),
    BoundaryClass("sparse-row-below-k",
                  "a query row that selects fewer than k positions (it sees fewer, or a valid "
                  "cap): -1 padding inside the row, which nothing may read as a position",
                  (TOPK, CONVERSION, SPARSE_PREFILL, PIPELINE), _row_below_k),
    BoundaryClass("sparse-row-at-k",
                  "a query row that sees exactly k positions: the edge between padded and full "
                  "rows", (TOPK, CONVERSION, PIPELINE), _row_at_k),
    BoundaryClass("sparse-empty-row", "a query row with no valid index: output 0, LSE -inf",
                  (SPARSE_PREFILL,), _empty_row),
    BoundaryClass("indexer-mtp",
                  "MTP indexer rows (next_n >= 2): each row of a request sees one position more "
                  "than the one before it", (PAGED_INDEXER, PIPELINE), _indexer_mtp),
    BoundaryClass("indexer-partial-last-page",
                  "a request whose last page of the paged key cache / latent pool is partial: "
                  "its tail is poison, never a position", (PAGED_INDEXER, CONVERSION, PIPELINE),
                  _pipeline_partial_page),
    BoundaryClass("topk-exact-ties",
                  "logits with exact ties at the k-th value: any choice among the tied "
                  "positions is right, none outside them", (TOPK,), _exact_ties),
    BoundaryClass("window-start-past-zero",
                  "rows whose key window starts past column 0 (a later segment / request laid "
                  "end to end): positions relative to the window start", (INDEXER, TOPK),
                  _window_past_zero),
    BoundaryClass("pool-past-2^31", "live pages past 2^31 bytes: signed 32-bit offsets wrap",
                  (DECODE,), _live_bytes_past(1 << 31), cpu=False),
    BoundaryClass("pool-past-2^32", "live pages past 2^32 bytes: unsigned 32-bit offsets wrap",
                  (DECODE,), _live_bytes_past(1 << 32), cpu=False),
)

BY_NAME: dict[str, BoundaryClass] = {c.name: c for c in CLASSES}


def classes_of(case: Case) -> list[str]:
    """The boundary classes this case exercises (for its op)."""
    return [c.name for c in CLASSES if case.op in c.ops and c.applies(case)]


def coverage(cases: Iterable[Case]) -> dict[str, dict[str, int]]:
    """class name -> op -> how many of `cases` exercise it (0 where none does)."""
    table = {c.name: dict.fromkeys(c.ops, 0) for c in CLASSES}
    for case in cases:
        for name in classes_of(case):
            table[name][case.op] += 1
    return table


def missing(cases: Iterable[Case], cpu_only: bool = True) -> list[tuple[str, str]]:
    """(class, op) pairs no case covers (CPU-runnable classes only, by default)."""
    table = coverage(cases)
    return [(name, op) for name, ops in table.items() for op, n in ops.items()
            if n == 0 and (BY_NAME[name].cpu or not cpu_only)]
