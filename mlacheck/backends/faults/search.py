"""Hypothesis strategies the selftest's minimal-case search draws from, one per fault family.

Each is a narrowed `mlacheck.strategies` strategy: the same generators (so a shrunk case is
the simplest by the same ordering: bf16, 16 heads, page size 16, one request, ...), bounded to
CPU-cheap sizes and to the features the fault needs to show (a 2^31 placement for the offset
wrap, outlier channels for the unit-scale cast, ...). FaultSpec.search names one of these.
"""

from __future__ import annotations

from hypothesis import strategies as st

from mlacheck import strategies as S
from mlacheck.boundaries import LONG_KV, NARROW_ACCUMULATION_KV, TILE_SIZES, kv_edges
from mlacheck.spec import Case, DecodeCase, Placement, Quant, Request

BF16 = (Quant("bf16", "bf16"),)
AMAX_FP8 = (Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "amax"),
            Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax"))
FNUZ_AMAX = (Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "amax"),)
SHUFFLED = (Placement(),)
MAX_KV = 160


def decode_any() -> st.SearchStrategy[Case]:
    return S.decode_cases(max_batch=3, max_q_len=1, max_kv=MAX_KV, head_counts=(16,),
                          quants=BF16, page_sizes=(16, 1), placements=SHUFFLED)


def decode_bf16() -> st.SearchStrategy[Case]:
    return decode_any()


def decode_fp16() -> st.SearchStrategy[Case]:
    """fp16 first (a small systematic error shows at its roundoff), then bf16; kv lengths up
    to the narrow-accumulation length, the catalogue's edges first (boundaries.kv_edges: the
    partial-precision faults narrow every other 64-key tile; a narrow accumulator's loss grows
    with kv: an fp16 one passes a 16-head fp16 decode at 160 keys and fails it from 512)."""
    return S.decode_cases(max_batch=2, max_q_len=1, max_kv=NARROW_ACCUMULATION_KV,
                          head_counts=(16,), quants=(Quant("fp16", "fp16"), *BF16),
                          page_sizes=(16,), placements=SHUFFLED)


def decode_paged() -> st.SearchStrategy[Case]:
    """Page size 1 first: the search has to move to a page size > 1 to fail."""
    return S.decode_cases(max_batch=3, max_q_len=1, max_kv=MAX_KV, head_counts=(16,),
                          quants=BF16, page_sizes=(1, 16, 64), placements=SHUFFLED)


@st.composite
def _page_boundary(draw: st.DrawFn) -> Case:
    """q_len-1 decode whose kv lengths sit at page boundaries first (one page, one token
    past, one short, two pages: as sparse_cases does around topk), else anywhere."""
    ps = draw(st.sampled_from((16, 1, 64)))
    near = st.sampled_from(tuple(n for n in (ps, ps + 1, ps - 1, 2 * ps) if n >= 1))
    n = draw(st.integers(1, 3))
    lens = [draw(st.one_of(near, st.integers(1, MAX_KV))) for _ in range(n)]
    return DecodeCase(requests=tuple(Request(1, k) for k in lens), num_heads=16, page_size=ps)


def decode_page_boundary() -> st.SearchStrategy[Case]:
    return _page_boundary()


def decode_heads() -> st.SearchStrategy[Case]:
    return S.decode_cases(max_batch=2, max_q_len=1, max_kv=MAX_KV, head_counts=(16, 8, 12),
                          quants=BF16, page_sizes=(16,), placements=SHUFFLED)


def decode_mtp() -> st.SearchStrategy[Case]:
    return S.decode_cases(max_batch=3, max_q_len=4, max_kv=MAX_KV, head_counts=(16,),
                          quants=BF16, page_sizes=(16,), placements=SHUFFLED)


def decode_large_kv31() -> st.SearchStrategy[Case]:
    """Live pages straddling 2^31 (fp8 KV keeps the pool at ~2 GiB: ~1 s per example)."""
    return S.decode_cases(max_batch=2, max_q_len=1, max_kv=64, head_counts=(16,),
                          quants=FNUZ_AMAX, page_sizes=(16,),
                          placements=(Placement("high", offset_bytes=1 << 31),))


def decode_large_kv32() -> st.SearchStrategy[Case]:
    """Live pages straddling 2^32 (~4 GiB pools: seconds per example)."""
    return S.decode_cases(max_batch=2, max_q_len=1, max_kv=64, head_counts=(16,),
                          quants=FNUZ_AMAX, page_sizes=(16,),
                          placements=(Placement("high", offset_bytes=1 << 32),))


def decode_fp8_outliers() -> st.SearchStrategy[Case]:
    """Outlier channels (the stress profile) under amax scales, both chip formats."""
    return S.decode_cases(max_batch=2, max_q_len=1, max_kv=MAX_KV, head_counts=(16,),
                          quants=AMAX_FP8, profiles=("stress",), page_sizes=(16,),
                          placements=SHUFFLED)


def sparse_short() -> st.SearchStrategy[Case]:
    return S.sparse_cases(max_batch=2, max_q_len=2, topks=(64,), extra_kv=16, head_counts=(16,),
                          quants=BF16, page_sizes=(16,), placements=SHUFFLED)


def prefill_multiseg() -> st.SearchStrategy[Case]:
    return S.prefill_cases(max_tokens=48, max_segments=3, head_counts=(16,), quants=BF16)


def prefill_context() -> st.SearchStrategy[Case]:
    return S.prefill_cases(max_tokens=48, max_segments=2, head_counts=(16,), quants=BF16)


@st.composite
def _tile_boundary(draw: st.DrawFn) -> Case:
    """q_len-1 decode whose kv lengths sit at tile multiples first, else anywhere."""
    near = st.sampled_from(tuple(n for m in TILE_SIZES for n in (m, m - 1, m + 1) if m <= 1024))
    n = draw(st.integers(1, 2))
    lens = [draw(st.one_of(near, st.integers(1, 1100))) for _ in range(n)]
    return DecodeCase(requests=tuple(Request(1, k) for k in lens), num_heads=16, page_size=16)


def decode_tile_boundary() -> st.SearchStrategy[Case]:
    return _tile_boundary()


@st.composite
def _tile_off_by_one(draw: st.DrawFn) -> Case:
    """q_len-1 decode whose kv lengths sit one either side of a tile of 256+ first (the
    kv-tile-off-by-one shape, rare among decode_tile_boundary's draws), else anywhere."""
    near = st.sampled_from(tuple(n for m in TILE_SIZES if 256 <= m <= 1024
                                 for n in (m + 1, m - 1)))
    n = draw(st.integers(1, 2))
    lens = [draw(st.one_of(near, st.integers(1, 1100))) for _ in range(n)]
    return DecodeCase(requests=tuple(Request(1, k) for k in lens), num_heads=16, page_size=16)


def decode_tile_off_by_one() -> st.SearchStrategy[Case]:
    return _tile_off_by_one()


@st.composite
def _long_kv(draw: st.DrawFn) -> Case:
    """One long request on a page-size-1 pool: past 16k tokens with a third of its page ids
    past 2^16 first (the search budget for these is a few runs), then shorter ones."""
    kv = draw(st.sampled_from((98305, 40000, 16385)))
    return DecodeCase(requests=(Request(1, kv),), num_heads=16, page_size=1,
                      placement=Placement("packed"))


def decode_long_kv() -> st.SearchStrategy[Case]:
    return _long_kv()


# Long-kv lengths past the first long edge, up to the second's (8193, 16384, 16385): where a
# key at the 8192 edge (and at 16384) is in view.
PAST_8K = kv_edges(LONG_KV[0] + 1, LONG_KV[1] + 1)
# (query row, head) pairs a case puts past the edge, at least: one masked key moves a row only
# where that key carries weight for its head, about 1 pair in 100 on the gaussian inputs
# (mask-edge-8192 on one kv-8193 row failed 2 of 12 seeds at 16 heads, 9 of 12 at 128; 11 of
# 12 with two rows at 128 heads).
EDGE_PAIRS = 128


@st.composite
def _8k_edge(draw: st.DrawFn) -> Case:
    """A request past the 8192 edge beside a short one (page size 64): its kv from the
    catalogue's long lengths (PAST_8K, 8193 first), every one of its 1-2 query rows past the
    edge, and heads enough for EDGE_PAIRS (row, head) pairs there (128, DeepSeek-V3's count,
    for one row; 64 or 128 for two)."""
    kv = draw(st.sampled_from(PAST_8K))
    q_len = draw(st.integers(1, 2))
    heads = draw(st.sampled_from(sorted(h for h in S.HEAD_COUNTS if h * q_len >= EDGE_PAIRS)))
    return DecodeCase(requests=(Request(1, 300), Request(q_len, kv + q_len - 1)),
                      num_heads=heads, page_size=64)


def decode_8k_edge() -> st.SearchStrategy[Case]:
    return _8k_edge()


def decode_empty() -> st.SearchStrategy[Case]:
    """Ragged batches that may hold empty requests (q_len 0)."""
    return S.decode_cases(max_batch=3, max_q_len=2, max_kv=MAX_KV, head_counts=(16,),
                          quants=BF16, page_sizes=(16,), placements=SHUFFLED)


def prefill_empty() -> st.SearchStrategy[Case]:
    return S.prefill_cases(max_tokens=48, max_segments=3, head_counts=(16,), quants=BF16)


def prefill_soft_cap() -> st.SearchStrategy[Case]:
    return S.prefill_cases(max_tokens=48, max_segments=2, head_counts=(16,), quants=BF16,
                           soft_caps=(30.0,))


def prefill_per_token() -> st.SearchStrategy[Case]:
    return S.prefill_cases(max_tokens=48, max_segments=2, head_counts=(16,),
                           quants=(Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax", per_token=True),))


# --------------------------------------------------------------------------- sparse pipeline


def indexer_any() -> st.SearchStrategy[Case]:
    """Either indexer form, small: prefill segments then the paged cache."""
    return st.one_of(S.indexer_cases(max_tokens=48, max_segments=2, head_counts=(16,),
                                     head_dims=(128,), formats=("fp8_e4m3fn",)),
                     indexer_paged())


def indexer_paged() -> st.SearchStrategy[Case]:
    return S.paged_indexer_cases(max_batch=3, next_ns=(1, 2), max_kv=MAX_KV, head_counts=(16,),
                                 page_sizes=(16,), placements=SHUFFLED,
                                 formats=("fp8_e4m3fn",))


def topk_any() -> st.SearchStrategy[Case]:
    return S.topk_cases(max_batch=3, max_q_len=2, topks=(16,), extra_kv=16)


def topk_prefill() -> st.SearchStrategy[Case]:
    return S.topk_cases(max_batch=3, max_q_len=2, topks=(16,), extra_kv=16, forms=("prefill",))


def conversion_any() -> st.SearchStrategy[Case]:
    return S.conversion_cases(max_batch=3, max_q_len=2, topks=(16,), extra_kv=16,
                              page_sizes=(16,), index_layouts=("row_major",),
                              placements=(Placement("packed"), *SHUFFLED))


def conversion_ragged() -> st.SearchStrategy[Case]:
    return S.conversion_cases(max_batch=3, max_q_len=2, topks=(16,), extra_kv=16,
                              page_sizes=(16,), index_layouts=("ragged",), placements=SHUFFLED)


def sparse_prefill_any() -> st.SearchStrategy[Case]:
    return S.sparse_prefill_cases(max_tokens=48, max_segments=2, topks=(16,), head_counts=(16,),
                                  quants=BF16)


def pipeline_any() -> st.SearchStrategy[Case]:
    return S.pipeline_cases(max_batch=3, next_ns=(1,), topks=(16,), extra_kv=16,
                            page_sizes=(16,), placements=(Placement("packed"), *SHUFFLED))


# Strategies whose examples allocate multi-GiB pools (or long kv): the selftest gives them a
# small budget.
EXPENSIVE = frozenset({"decode_large_kv31", "decode_large_kv32", "decode_long_kv",
                       "decode_8k_edge"})


def strategy(name: str) -> st.SearchStrategy[Case]:
    fn = globals().get(name)
    if fn is None or not callable(fn):
        raise KeyError(f"no search strategy {name!r} in {__name__}")
    return fn()
