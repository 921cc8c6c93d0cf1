"""Hypothesis strategies over MLA cases.

The matrices (mlacheck/matrices) pin the cases a gate runs; these strategies explore the
space between them. Every strategy yields valid cases only (the spec's rules are respected
by construction, not filtered), bounded to CPU-cheap sizes by default; the keyword
arguments widen them. Choice lists are ordered simplest first (bf16, 16 heads, page size 16,
one request, q_len 1, no context, causal), because Hypothesis shrinks `sampled_from` toward
the first element and integers toward their lower bound: a failure shrinks to the simplest
case that still fails, which is what a kernel engineer wants to debug. The boundary classes
of mlacheck/boundaries.py (tile-boundary lengths, empty requests / segments, per-token
scales; long kv and wide page ids on request) are the first branch of each choice, so a
search meets them early and a failure that needs one keeps it.

The search for a backend's smallest failing case over these strategies is mlacheck.search
(it runs the harness, a layer above the cases).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from mlacheck import layouts as kv_layouts
from mlacheck.boundaries import LONG_KV, kv_edges
from mlacheck.spec import (
    DEEPSEEK_V3,
    NO_YARN,
    Case,
    DecodeCase,
    IndexConversionCase,
    IndexerCase,
    Op,
    PagedIndexerCase,
    Paging,
    Placement,
    PrefillCase,
    Quant,
    Request,
    Segment,
    SparseDecodeCase,
    SparsePipelineCase,
    SparsePrefillCase,
    TopkCase,
)

# 16 first: the head count every MLA kernel handles natively (no padding); then by size.
HEAD_COUNTS: tuple[int, ...] = (16, 8, 12, 24, 32, 64, 128)

# Input formats, simplest first. Unit scales only ever meet the realistic profile (see
# `_quants_for`): unit scale + stress is expected to fail the quantisation-loss check.
QUANTS: tuple[Quant, ...] = (
    Quant("bf16", "bf16"),
    Quant("fp16", "fp16"),
    Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax"),
    Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "amax"),
    Quant("fp8_e4m3fn", "fp8_e4m3fn", "unit"),
    Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "unit"),
    Quant("bf16", "fp8_e4m3fn", "amax"),  # fp8 KV cache under bf16 queries
)
# Per-token FP8 scales (the per-token-scale boundary class). The spec takes them on unpaged
# prefill only (paged pools, hence decode, sparse and paged prefill, take per-tensor KV
# scales), so they are in prefill_cases' defaults only.
PER_TOKEN_QUANTS: tuple[Quant, ...] = (
    Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax", per_token=True),
    Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "amax", per_token=True),
)
PREFILL_QUANTS: tuple[Quant, ...] = QUANTS + PER_TOKEN_QUANTS

# 16 first: the page size most paths are tested with; 1 and 1024 are the rare ends.
PAGE_SIZES: tuple[int, ...] = (16, 1, 64, 1024)
LAYOUTS: tuple[str, ...] = kv_layouts.NAMES
PLACEMENTS: tuple[Placement, ...] = (
    Placement(),
    Placement("packed"),
    Placement(tail_poison="sentinel"),
)
# >2 GB / >4 GB pools: opt in (`placements=PLACEMENTS + LARGE_KV_PLACEMENTS`); each case
# then allocates and poisons gigabytes, seconds per example on a CPU.
LARGE_KV_PLACEMENTS: tuple[Placement, ...] = (
    Placement("high", offset_bytes=1 << 31),
    Placement("high", offset_bytes=1 << 32),
)
# Realistic only by default: with the current tolerances the stress profile fails the
# quantisation-loss check even on the reference backend, so a search over it would only
# rediscover that. Pass profiles=("realistic", "stress") to include it.
PROFILES: tuple[str, ...] = ("realistic",)
SOFT_CAPS: tuple[float, ...] = (0.0, 30.0)  # 0 = off; 30 is the usual soft-cap value
# Production topk (DeepSeek-V3.2) is 2048, but a 2048-wide case costs seconds on a CPU;
# the small values exercise the same boundary logic. Widen with topks=(64, 2048).
TOPKS: tuple[int, ...] = (64, 128)

# CPU-cheap default bounds (each example runs in well under a second on 2 cores).
DEFAULT_MAX_TOKENS = 128  # prefill: sum of q + context tokens over segments
DEFAULT_MAX_SEGMENTS = 4
DEFAULT_MAX_BATCH = 4  # decode / sparse requests
DEFAULT_MAX_KV = 512  # decode kv_len
DEFAULT_MAX_Q_LEN = 4  # MTP decode: q_len 1..4
DEFAULT_SPARSE_EXTRA_KV = 64  # sparse kv_len reaches topk + this

# Opt-in long decode kv (`decode_cases(long_kv=True)`): one past each boundaries.LONG_KV
# length (clamps, 16-bit counters, narrow accumulation), drawn first. Seconds per example.
LONG_KV_LENGTHS: tuple[int, ...] = tuple(n + 1 for n in LONG_KV)
# Opt-in wide page ids (`wide_page_ids=True`): page size 1 and kv 3 * 2^15 + 1 first, whose
# page ids put a third of the request past 2^16 and two thirds past 2^15 (the classes ask a
# quarter, boundaries.WIDE_PAGE_SHARE: kv 65537 has only 9 pages past 2^16).
WIDE_PAGE_KV = 3 * (1 << 15) + 1


def _quants_for(profile: str, quants: Sequence[Quant]) -> list[Quant]:
    if profile == "stress":
        return [q for q in quants if not (q.is_fp8 and q.scale == "unit")]
    return list(quants)


@st.composite
def _quant_and_profile(
    draw: st.DrawFn, quants: Sequence[Quant], profiles: Sequence[str]
) -> tuple[Quant, str]:
    profile = draw(st.sampled_from(profiles))
    allowed = _quants_for(profile, quants)
    if not allowed:
        raise ValueError(f"no quant in {quants} may be combined with the {profile} profile")
    return draw(st.sampled_from(allowed)), profile


def _length(lo: int, hi: int, long: Sequence[int] = ()) -> st.SearchStrategy[int]:
    """A length in [lo, hi], or one of `long` (the opt-in long-kv lengths): the boundary
    branches first (Hypothesis shrinks toward the first branch), then anywhere; each branch
    is drawn equally often. The boundary branch (mlacheck.boundaries.kv_edges: tile edges,
    the narrow-accumulation and long lengths) starts at `lo`, so a failure that
    needs no boundary still shrinks to the shortest length (not to a long one), and one that
    needs a boundary keeps the smallest that fails."""
    near = st.sampled_from((lo, *kv_edges(lo + 1, hi)))
    return st.one_of(near, *([st.sampled_from(tuple(long))] if long else []),
                     st.integers(lo, hi))


def _q_len(lo: int, hi: int, allow_empty: bool) -> st.SearchStrategy[int]:
    """0 (an empty request / segment: a boundary class) first when allowed, else lo..hi. A
    failing case keeps an empty where it still fails with one; a batch of one never has
    one (at least one query token), so single-request failures shrink as before."""
    some = st.integers(lo, hi)
    return st.one_of(st.just(0), some) if allow_empty else some


@st.composite
def _segments(draw: st.DrawFn, max_tokens: int, max_segments: int,
              allow_empty: bool = True) -> tuple[Segment, ...]:
    """1..max_segments segments whose q + context tokens sum to at most max_tokens; kv
    lengths (q + context) at tile boundaries first; empty segments (q_len 0) first when
    allowed."""
    n = draw(st.integers(1, min(max_segments, max_tokens)))
    budget = max_tokens
    out = []
    for i in range(n):
        cap = budget - (n - i - 1)  # leave one token for each later segment
        empty_ok = allow_empty and (i < n - 1 or any(s.q_len for s in out))
        q_len = draw(_q_len(1, cap, empty_ok))
        context = draw(_length(q_len, cap)) - q_len
        budget -= q_len + context
        out.append(Segment(q_len, context))
    return tuple(out)


@st.composite
def _prefill(
    draw: st.DrawFn, *, paged: bool, max_tokens: int, max_segments: int,
    head_counts: Sequence[int], quants: Sequence[Quant], profiles: Sequence[str],
    page_sizes: Sequence[int], layouts: Sequence[str], placements: Sequence[Placement],
    soft_caps: Sequence[float] = SOFT_CAPS,
) -> PrefillCase:
    if max_tokens < 1 or max_segments < 1:
        raise ValueError("max_tokens and max_segments must be >= 1")
    quant, profile = draw(_quant_and_profile(quants, profiles))
    paging = None
    placement = Placement()
    if paged:
        options = [Paging(ps, lay) for lay in layouts for ps in page_sizes
                   if kv_layouts.get(lay).page_size_problem(ps, quant.kv) is None]
        # order: by page size preference first, then layout (linear before vectorized)
        options.sort(key=lambda p: (list(page_sizes).index(p.page_size),
                                    list(layouts).index(p.layout)))
        if not options:
            raise ValueError(f"no page size in {page_sizes} fits layouts {layouts} for {quant}")
        paging = draw(st.sampled_from(options))
        placement = draw(st.sampled_from(placements))
    return PrefillCase(
        segments=draw(_segments(max_tokens, max_segments)),
        num_heads=draw(st.sampled_from(head_counts)),
        causal=draw(st.sampled_from((True, False))),
        quant=quant,
        soft_cap=draw(st.sampled_from(soft_caps)),
        return_lse=draw(st.sampled_from((True, False))),
        paging=paging,
        placement=placement,
        profile=profile,  # type: ignore[arg-type]
        dims=draw(st.sampled_from((DEEPSEEK_V3, NO_YARN))),
    )


def prefill_cases(
    max_tokens: int = DEFAULT_MAX_TOKENS,
    max_segments: int = DEFAULT_MAX_SEGMENTS,
    head_counts: Sequence[int] = HEAD_COUNTS,
    quants: Sequence[Quant] = PREFILL_QUANTS,
    profiles: Sequence[str] = PROFILES,
    soft_caps: Sequence[float] = SOFT_CAPS,
) -> st.SearchStrategy[PrefillCase]:
    """Unpaged MHA-view prefill: multi-segment (empty segments first), chunked context at
    tile boundaries first, causal on/off, soft cap, per-token FP8 scales."""
    return _prefill(paged=False, max_tokens=max_tokens, max_segments=max_segments,
                    head_counts=head_counts, quants=quants, profiles=profiles,
                    page_sizes=PAGE_SIZES, layouts=LAYOUTS, placements=PLACEMENTS,
                    soft_caps=soft_caps)


def paged_prefill_cases(
    max_tokens: int = DEFAULT_MAX_TOKENS,
    max_segments: int = DEFAULT_MAX_SEGMENTS,
    head_counts: Sequence[int] = HEAD_COUNTS,
    quants: Sequence[Quant] = QUANTS,
    profiles: Sequence[str] = PROFILES,
    page_sizes: Sequence[int] = PAGE_SIZES,
    layouts: Sequence[str] = LAYOUTS,
    placements: Sequence[Placement] = PLACEMENTS,
) -> st.SearchStrategy[PrefillCase]:
    """CK batch prefill: paged K/V, linear or vectorized (only page sizes the layout allows)."""
    return _prefill(paged=True, max_tokens=max_tokens, max_segments=max_segments,
                    head_counts=head_counts, quants=quants, profiles=profiles,
                    page_sizes=page_sizes, layouts=layouts, placements=placements)


@st.composite
def _requests(draw: st.DrawFn, max_batch: int, max_q_len: int, max_kv: int,
              allow_empty: bool = True, long: Sequence[int] = ()) -> tuple[Request, ...]:
    """1..max_batch requests; kv lengths at tile boundaries (and `long` lengths) first;
    empty requests (q_len 0) first when allowed (at least one has a query token)."""
    n = draw(st.integers(1, max_batch))
    out = []
    for i in range(n):
        empty_ok = allow_empty and (i < n - 1 or any(r.q_len for r in out))
        q_len = draw(_q_len(1, min(max_q_len, max_kv), empty_ok))
        out.append(Request(q_len, draw(_length(q_len, max_kv, long))))
    return tuple(out)


@st.composite
def _decode(
    draw: st.DrawFn, *, max_batch: int, max_q_len: int, max_kv: int,
    head_counts: Sequence[int], quants: Sequence[Quant], profiles: Sequence[str],
    page_sizes: Sequence[int], placements: Sequence[Placement], long: Sequence[int] = (),
) -> DecodeCase:
    if max_batch < 1 or max_q_len < 1 or max_kv < 1:
        raise ValueError("max_batch, max_q_len and max_kv must be >= 1")
    quant, profile = draw(_quant_and_profile(quants, profiles))
    return DecodeCase(
        requests=draw(_requests(max_batch, max_q_len, max_kv, long=long)),
        num_heads=draw(st.sampled_from(head_counts)),
        page_size=draw(st.sampled_from(page_sizes)),
        quant=quant,
        placement=draw(st.sampled_from(placements)),
        profile=profile,  # type: ignore[arg-type]
    )


def decode_cases(
    max_batch: int = DEFAULT_MAX_BATCH,
    max_q_len: int = DEFAULT_MAX_Q_LEN,
    max_kv: int = DEFAULT_MAX_KV,
    head_counts: Sequence[int] = HEAD_COUNTS,
    quants: Sequence[Quant] = QUANTS,
    profiles: Sequence[str] = PROFILES,
    page_sizes: Sequence[int] = PAGE_SIZES,
    placements: Sequence[Placement] = PLACEMENTS,
    long_kv: bool = False,
    wide_page_ids: bool = False,
) -> st.SearchStrategy[DecodeCase]:
    """Absorbed-MQA paged decode: ragged batches, MTP q_len up to max_q_len, every page size.

    long_kv: kv lengths past 8192 / 16384 / 65536 (LONG_KV_LENGTHS) drawn first;
    wide_page_ids: page size 1 only, kv WIDE_PAGE_KV drawn first (page ids past 2^15, 2^16).
    Both opt in: such an example costs seconds on a CPU (~100 MB pools at page size 1)."""
    long = (*((WIDE_PAGE_KV,) if wide_page_ids else ()), *(LONG_KV_LENGTHS if long_kv else ()))
    if wide_page_ids:  # ids past 2^16 at page size 16 would need a million tokens
        page_sizes = (1,)
    return _decode(max_batch=max_batch, max_q_len=max_q_len, max_kv=max_kv,
                   head_counts=head_counts, quants=quants, profiles=profiles,
                   page_sizes=page_sizes, placements=placements, long=long)


@st.composite
def _sparse(
    draw: st.DrawFn, *, max_batch: int, max_q_len: int, topks: Sequence[int], extra_kv: int,
    head_counts: Sequence[int], quants: Sequence[Quant], profiles: Sequence[str],
    page_sizes: Sequence[int], placements: Sequence[Placement],
) -> SparseDecodeCase:
    if min(topks) <= max_q_len:
        raise ValueError("every topk must exceed max_q_len (kv_len near topk must be >= q_len)")
    quant, profile = draw(_quant_and_profile(quants, profiles))
    topk = draw(st.sampled_from(topks))
    n = draw(st.integers(1, max_batch))
    requests: list[Request] = []
    for i in range(n):
        empty_ok = i < n - 1 or any(r.q_len for r in requests)
        q_len = draw(_q_len(1, max_q_len, empty_ok))
        # at the topk boundary first (at, just below, just above), else anywhere
        near = st.sampled_from((topk, topk - 1, topk + 1))
        kv_len = draw(st.one_of(near, st.integers(q_len, topk + extra_kv)))
        requests.append(Request(q_len, kv_len))
    valid_cap = draw(st.one_of(st.none(), st.integers(0, topk - 1)))
    return SparseDecodeCase(
        requests=tuple(requests),
        topk=topk,
        valid_cap=valid_cap,
        num_heads=draw(st.sampled_from(head_counts)),
        page_size=draw(st.sampled_from(page_sizes)),
        quant=quant,
        placement=draw(st.sampled_from(placements)),
        profile=profile,  # type: ignore[arg-type]
    )


def sparse_cases(
    max_batch: int = 2,
    max_q_len: int = 2,
    topks: Sequence[int] = TOPKS,
    extra_kv: int = DEFAULT_SPARSE_EXTRA_KV,
    head_counts: Sequence[int] = HEAD_COUNTS,
    quants: Sequence[Quant] = QUANTS,
    profiles: Sequence[str] = PROFILES,
    page_sizes: Sequence[int] = PAGE_SIZES,
    placements: Sequence[Placement] = PLACEMENTS,
) -> st.SearchStrategy[SparseDecodeCase]:
    """Sparse top-k decode with kv_len around topk (below, at, above), valid_cap < topk and
    empty requests (q_len 0) first."""
    return _sparse(max_batch=max_batch, max_q_len=max_q_len, topks=topks, extra_kv=extra_kv,
                   head_counts=head_counts, quants=quants, profiles=profiles,
                   page_sizes=page_sizes, placements=placements)


# --------------------------------------------------------------------------- sparse pipeline
# The DeepSeek-V3.2 sparse-pipeline cases. Indexer heads 16 first (V3.2 has 64: the same
# code at a quarter of the cost), both FP8 formats; kv lengths around topk (rows that see
# fewer positions than k, exactly k, more) first, as sparse_cases does.

INDEX_HEAD_COUNTS: tuple[int, ...] = (16, 64, 32)
INDEX_HEAD_DIMS: tuple[int, ...] = (128, 64)
INDEX_FORMATS: tuple[str, ...] = ("fp8_e4m3fn", "fp8_e4m3fnuz")
PIPELINE_TOPKS: tuple[int, ...] = (16, 64)


def _index_quant(fmt: str) -> Quant:
    return Quant(fmt, fmt, "amax", per_token=True)


@st.composite
def _near_topk_requests(draw: st.DrawFn, max_batch: int, q_lens: st.SearchStrategy[int],
                        topk: int, extra_kv: int, allow_empty: bool) -> tuple[Request, ...]:
    n = draw(st.integers(1, max_batch))
    out: list[Request] = []
    for i in range(n):
        empty_ok = allow_empty and (i < n - 1 or any(r.q_len for r in out))
        q_len = draw(st.one_of(st.just(0), q_lens) if empty_ok else q_lens)
        near = st.sampled_from(tuple(k for k in (topk, topk - 1, topk + 1) if k >= max(q_len, 1)))
        out.append(Request(q_len, draw(st.one_of(near, st.integers(max(q_len, 1),
                                                                   topk + extra_kv)))))
    return tuple(out)


@st.composite
def _indexer(draw: st.DrawFn, max_tokens: int, max_segments: int, head_counts: Sequence[int],
             head_dims: Sequence[int], formats: Sequence[str]) -> IndexerCase:
    return IndexerCase(segments=draw(_segments(max_tokens, max_segments)),
                       num_heads=draw(st.sampled_from(head_counts)),
                       head_dim=draw(st.sampled_from(head_dims)),
                       quant=_index_quant(draw(st.sampled_from(formats))))


def indexer_cases(max_tokens: int = 96, max_segments: int = 3,
                  head_counts: Sequence[int] = INDEX_HEAD_COUNTS,
                  head_dims: Sequence[int] = INDEX_HEAD_DIMS,
                  formats: Sequence[str] = INDEX_FORMATS) -> st.SearchStrategy[IndexerCase]:
    """Prefill-form indexer logits: multi-segment with context (tile-boundary lengths first),
    empty segments first."""
    return _indexer(max_tokens, max_segments, head_counts, head_dims, formats)


@st.composite
def _paged_indexer(draw: st.DrawFn, max_batch: int, next_ns: Sequence[int], max_kv: int,
                   head_counts: Sequence[int], page_sizes: Sequence[int],
                   placements: Sequence[Placement], formats: Sequence[str]) -> PagedIndexerCase:
    nn = draw(st.sampled_from(next_ns))
    n = draw(st.integers(1, max_batch))
    reqs = tuple(Request(nn, draw(_length(nn, max_kv))) for _ in range(n))
    return PagedIndexerCase(requests=reqs, num_heads=draw(st.sampled_from(head_counts)),
                            page_size=draw(st.sampled_from(page_sizes)),
                            quant=_index_quant(draw(st.sampled_from(formats))),
                            placement=draw(st.sampled_from(placements)))


def paged_indexer_cases(max_batch: int = 3, next_ns: Sequence[int] = (1, 2), max_kv: int = 300,
                        head_counts: Sequence[int] = INDEX_HEAD_COUNTS,
                        page_sizes: Sequence[int] = (16, 64, 1),
                        placements: Sequence[Placement] = PLACEMENTS,
                        formats: Sequence[str] = INDEX_FORMATS
                        ) -> st.SearchStrategy[PagedIndexerCase]:
    """Decode-form indexer logits over the paged key cache: next_n 1 then 2 (MTP), partial
    last pages, tile-boundary kv lengths first."""
    return _paged_indexer(max_batch, next_ns, max_kv, head_counts, page_sizes, placements,
                          formats)


@st.composite
def _topk(draw: st.DrawFn, max_batch: int, max_q_len: int, topks: Sequence[int],
          extra_kv: int, forms: Sequence[str], profiles: Sequence[str]) -> TopkCase:
    topk = draw(st.sampled_from(topks))
    reqs = draw(_near_topk_requests(max_batch, st.integers(1, max_q_len), topk, extra_kv, True))
    return TopkCase(requests=reqs, topk=topk, form=draw(st.sampled_from(forms)),  # type: ignore[arg-type]
                    logits=draw(st.sampled_from(profiles)))  # type: ignore[arg-type]


def topk_cases(max_batch: int = 3, max_q_len: int = 3, topks: Sequence[int] = PIPELINE_TOPKS,
               extra_kv: int = 32, forms: Sequence[str] = ("decode", "prefill"),
               profiles: Sequence[str] = ("distinct", "ties")) -> st.SearchStrategy[TopkCase]:
    """Top-k over FP32 logits rows, kv lengths around topk first, both forms, exact ties."""
    return _topk(max_batch, max_q_len, topks, extra_kv, forms, profiles)


@st.composite
def _conversion(draw: st.DrawFn, max_batch: int, max_q_len: int, topks: Sequence[int],
                extra_kv: int, page_sizes: Sequence[int], index_layouts: Sequence[str],
                placements: Sequence[Placement]) -> IndexConversionCase:
    topk = draw(st.sampled_from(topks))
    reqs = draw(_near_topk_requests(max_batch, st.integers(1, max_q_len), topk, extra_kv, True))
    return IndexConversionCase(
        requests=reqs, topk=topk, valid_cap=draw(st.one_of(st.none(), st.integers(0, topk - 1))),
        page_size=draw(st.sampled_from(page_sizes)),
        index_layout=draw(st.sampled_from(index_layouts)),  # type: ignore[arg-type]
        placement=draw(st.sampled_from(placements)))


def conversion_cases(max_batch: int = 3, max_q_len: int = 2,
                     topks: Sequence[int] = PIPELINE_TOPKS, extra_kv: int = 32,
                     page_sizes: Sequence[int] = (16, 1, 64),
                     index_layouts: Sequence[str] = ("row_major", "ragged"),
                     placements: Sequence[Placement] = PLACEMENTS
                     ) -> st.SearchStrategy[IndexConversionCase]:
    """Request-local top-k -> global slots: kv around topk (padded rows) first, valid_cap,
    both buffer layouts, shuffled and packed pools."""
    return _conversion(max_batch, max_q_len, topks, extra_kv, page_sizes, index_layouts,
                       placements)


@st.composite
def _sparse_prefill(draw: st.DrawFn, max_tokens: int, max_segments: int, topks: Sequence[int],
                    head_counts: Sequence[int], quants: Sequence[Quant]) -> SparsePrefillCase:
    segments = draw(_segments(max_tokens, max_segments))
    topk = draw(st.sampled_from(topks))
    total_q = sum(s.q_len for s in segments)
    return SparsePrefillCase(
        segments=segments, topk=topk,
        valid_cap=draw(st.one_of(st.none(), st.integers(0, topk - 1))),
        empty_rows=draw(st.integers(0, min(2, total_q))),
        num_heads=draw(st.sampled_from(head_counts)), quant=draw(st.sampled_from(quants)))


def sparse_prefill_cases(max_tokens: int = 96, max_segments: int = 3,
                         topks: Sequence[int] = PIPELINE_TOPKS,
                         head_counts: Sequence[int] = (16, 64, 128),
                         quants: Sequence[Quant] = (Quant("bf16", "bf16"), Quant("fp16", "fp16"))
                         ) -> st.SearchStrategy[SparsePrefillCase]:
    """Sparse MLA prefill: segments with context, padded rows (valid_cap), rows with no
    valid index."""
    return _sparse_prefill(max_tokens, max_segments, topks, head_counts, quants)


@st.composite
def _pipeline(draw: st.DrawFn, max_batch: int, next_ns: Sequence[int], topks: Sequence[int],
              extra_kv: int, head_counts: Sequence[int], index_heads: Sequence[int],
              page_sizes: Sequence[int], placements: Sequence[Placement],
              quants: Sequence[Quant]) -> SparsePipelineCase:
    topk = draw(st.sampled_from(topks))
    nn = draw(st.sampled_from(next_ns))
    reqs = draw(_near_topk_requests(max_batch, st.just(nn), topk, extra_kv, False))
    return SparsePipelineCase(
        requests=reqs, topk=topk, num_heads=draw(st.sampled_from(head_counts)),
        index_heads=draw(st.sampled_from(index_heads)),
        page_size=draw(st.sampled_from(page_sizes)), quant=draw(st.sampled_from(quants)),
        placement=draw(st.sampled_from(placements)))


def pipeline_cases(max_batch: int = 3, next_ns: Sequence[int] = (1, 2),
                   topks: Sequence[int] = PIPELINE_TOPKS, extra_kv: int = 32,
                   head_counts: Sequence[int] = (16,), index_heads: Sequence[int] = (16,),
                   page_sizes: Sequence[int] = (16, 64),
                   placements: Sequence[Placement] = (Placement(), Placement("packed")),
                   quants: Sequence[Quant] = (Quant("bf16", "bf16"),)
                   ) -> st.SearchStrategy[SparsePipelineCase]:
    """The composed decode path: kv around topk first, MTP, shuffled and packed pools."""
    return _pipeline(max_batch, next_ns, topks, extra_kv, head_counts, index_heads, page_sizes,
                     placements, quants)


def cases(op: str = "any") -> st.SearchStrategy[Case]:
    """The default strategy for one op name (spec.OPS), or for all of them ("any")."""
    by_op: dict[str, st.SearchStrategy[Case]] = {
        Op.PREFILL: prefill_cases(),
        Op.PAGED_PREFILL: paged_prefill_cases(),
        Op.DECODE: decode_cases(),
        Op.SPARSE_DECODE: sparse_cases(),
        Op.MQA_LOGITS: indexer_cases(),
        Op.PAGED_MQA_LOGITS: paged_indexer_cases(),
        Op.TOPK: topk_cases(),
        Op.INDEX_CONVERSION: conversion_cases(),
        Op.SPARSE_PREFILL: sparse_prefill_cases(),
        Op.SPARSE_PIPELINE: pipeline_cases(),
    }
    if op == "any":
        return st.one_of(*by_op.values())
    if op not in by_op:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(by_op)}, any")
    return by_op[op]


__all__ = [
    "HEAD_COUNTS",
    "LARGE_KV_PLACEMENTS",
    "LONG_KV_LENGTHS",
    "PAGE_SIZES",
    "PER_TOKEN_QUANTS",
    "PLACEMENTS",
    "PREFILL_QUANTS",
    "QUANTS",
    "WIDE_PAGE_KV",
    "cases",
    "conversion_cases",
    "decode_cases",
    "indexer_cases",
    "paged_indexer_cases",
    "paged_prefill_cases",
    "pipeline_cases",
    "prefill_cases",
    "sparse_cases",
    "sparse_prefill_cases",
    "topk_cases",
]
