"""Boundary-class faults (mlacheck/boundaries.py): bugs that act only at one case shape.

Each is the correct torch backend with one planted mechanism that a matrix without the shape
cannot see, so `mlacheck selftest` and tests/unit/faults show that premerge (on a CPU) has
the shape:

tile-multiple-drops-last[-64, -128] (kv-multiple-of-256 [-64, -128]): a tile loop bound
    `<` instead of `<=` on an exact multiple: when kv_len % T == 0 the last T-key tile is
    never visited (T = 256, 64, 128).
tile-ceil-off-by-one (kv-tile-off-by-one): the first T-key tile peeled, the remaining tile
    count rounded up with T - 2 instead of T - 1 (T = 256): when a kv longer than T has
    kv_len % T == 1 the one-key last tile is never visited.
kv-clamp-8k / -16k / -64k (kv-longer-than-8192 / -16384 / -65536): kv_len clamped to 8192,
    16384 or 65536 (a 13/14/16-bit length field, a buffer sized for it): longer requests
    attend to their first 8192 / 16384 / 65536 keys only.
page-id-int16 (page-id-past-2^15): page ids stored as int16: ids >= 2^15 turn negative and
    the kernel reads memory before the pool (poison here).
page-id-uint16 (page-id-past-2^16): page ids stored as uint16: ids >= 2^16 wrap and read
    another (live or free) page.
empty-request-shift (empty-request): empty decode requests dropped from qo_indptr but not
    from the page table: every request after an empty one reads its predecessor's pages
    (sparse decode: its tokens resolve their top-k positions through the predecessor's
    page-table row; positions past that row's pages read memory it does not own, poison).
empty-segment-shift (empty-segment): the same for prefill: cu_seqlens_q compacted,
    cu_seqlens_k (or the paged K/V page table) not: segments after an empty one attend to
    another segment's K/V.
single-token-no-context (single-token-segment): a one-token segment inside a prefill batch
    takes a decode-like fast path that forgets its context: it attends to itself only.
soft-cap-ignored (soft-cap): the soft cap is not applied.
per-token-scale-ignored (per-token-scale): per-token q scales read as one per-tensor scale
    (the first row's).
narrow-accumulation (kv-narrow-accumulation): the running output (the P.V accumulator)
    kept in bf16 between 64-key tiles: within the bf16 bound for short kv, beyond it for
    long kv (the threshold is measured in docs/detection.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mlacheck import fp8
from mlacheck.backends.base import Output
from mlacheck.backends.faults._base import Wrapper, replace_inputs, resolve_inner, torch_only
from mlacheck.backends.numerics import Numerics, flash_attend
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs, Quantised, cu_seqlens
from mlacheck.kvcache import KVPool, PageTable
from mlacheck.spec import Case, Op, Segment, SparseDecodeCase

DECODE, PREFILL = (Op.DECODE,), (Op.PREFILL,)
SPARSE, PAGED = (Op.SPARSE_DECODE,), (Op.PAGED_PREFILL,)
TILE = 256  # the default tile of the tile faults (boundaries.TILE_SIZES has the others)


def truncated_table(table: PageTable, keep: list[int]) -> PageTable:
    """The same page ids, each request cut to its first keep[r] tokens."""
    lens = torch.tensor(keep, dtype=torch.int64)
    counts = (lens + table.page_size - 1) // table.page_size
    indptr = torch.zeros(len(keep) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(counts, 0)
    ids = [table.pages_of(r)[: int(counts[r])] for r in range(len(keep))]
    indices = torch.cat(ids) if ids else table.indices[:0]
    return PageTable(table.page_size, indptr, indices, lens)


def _pool_with_table(pool: KVPool, table: PageTable) -> KVPool:
    return KVPool(pool.data, pool.fmt, pool.scale, table, pool.layout, pool.kind)


def _keep_rows(t: Quantised, rows: torch.Tensor) -> Quantised:
    scale = t.scale[rows] if t.scale.dim() and t.scale.shape[0] == t.stored.shape[0] else t.scale
    return Quantised(t.stored[rows], scale, t.fmt, t.ideal[rows])


class _KvShortened(Wrapper):
    """Attends to the first keep(kv_len) keys of each request / segment."""

    ops = DECODE + PREFILL

    def keep(self, kv_len: int) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def run(self, case: Case, inputs: Inputs) -> Output:
        if isinstance(inputs, DecodeInputs):
            keep = [self.keep(int(n)) for n in inputs.table.kv_lens.tolist()]
            pool = _pool_with_table(inputs.pool, truncated_table(inputs.table, keep))
            return self.inner.run(case, replace_inputs(inputs, pool=pool))
        assert isinstance(inputs, PrefillInputs)
        cuts = inputs.cu_seqlens_k.tolist()
        keep = [self.keep(n) for n in case.kv_lengths]
        rows = torch.cat([torch.arange(cuts[i], cuts[i] + keep[i]) for i in range(len(keep))])
        segments = tuple(Segment(q, max(0, k - q)) for q, k in zip(case.q_lengths, keep,
                                                                      strict=True))
        short = case.with_units(segments)
        view = replace_inputs(inputs, case=short, k=_keep_rows(inputs.k, rows),
                              v=_keep_rows(inputs.v, rows), cu_seqlens_k=cu_seqlens(keep))
        return self.inner.run(short, view)


class TileMultipleDropsLast(_KvShortened):
    def __init__(self, inner: Any, name: str, tile: int = TILE) -> None:
        super().__init__(inner, name)
        self.tile = tile

    def keep(self, kv_len: int) -> int:
        return kv_len - self.tile if kv_len > 0 and kv_len % self.tile == 0 else kv_len


class TileCeilOffByOne(_KvShortened):
    """The first tile peeled (it initialises the running max and sum), the rest counted as
    ceil((kv_len - T) / T) written (kv_len - T + T - 2) // T: one tile short exactly when a
    kv longer than T leaves one key in its last tile (kv_len % T == 1)."""

    def __init__(self, inner: Any, name: str, tile: int = TILE) -> None:
        super().__init__(inner, name)
        self.tile = tile

    def keep(self, kv_len: int) -> int:
        if kv_len <= self.tile:
            return kv_len
        return min(kv_len, self.tile + (kv_len - 2) // self.tile * self.tile)


class KvClamp(_KvShortened):
    ops = DECODE

    def __init__(self, inner: Any, name: str, limit: int) -> None:
        super().__init__(inner, name)
        self.limit = limit

    def keep(self, kv_len: int) -> int:
        return min(kv_len, self.limit)


class PageIdNarrow(Wrapper):
    """Page ids as a `bits`-bit integer holds them; reads outside the pool meet poison."""

    ops = DECODE

    def __init__(self, inner: Any, name: str, bits: int, signed: bool) -> None:
        super().__init__(inner, name)
        self.bits, self.signed = bits, signed

    def run(self, case: Case, inputs: Inputs) -> Output:
        assert isinstance(inputs, DecodeInputs)
        pool = inputs.pool
        span = 1 << self.bits
        ids = pool.table.indices % span
        if self.signed:
            ids = torch.where(ids >= span // 2, ids - span, ids)
        read = _read_through(pool, ids, pool.table.indptr, pool.table.kv_lens)
        return self.inner.run(case, replace_inputs(inputs, pool=read))


def _read_through(pool: KVPool, ids: torch.Tensor, indptr: torch.Tensor,
                  kv_lens: torch.Tensor) -> KVPool:
    """The pages a kernel reads through page ids `ids` (CSR by `indptr`), copied into a pool
    of their own; an id outside the pool (< 0 or past its end) reads poison, as mlacheck
    poisons all memory a kernel does not own."""
    outside = (ids < 0) | (ids >= pool.num_pages)
    bits_dtype, nan_code = fp8.nan_fill_value(pool.fmt)  # fp8 has no index kernels: bits
    data = torch.empty((ids.numel(), *pool.data.shape[1:]), dtype=pool.data.dtype,
                       device=pool.data.device)
    raw, src = data.view(bits_dtype), pool.data.view(bits_dtype)
    dev = pool.data.device
    inside = torch.nonzero(~outside).flatten()
    raw[inside.to(dev)] = src[ids[inside].to(dev)]
    raw[torch.nonzero(outside).flatten().to(dev)] = nan_code
    table = PageTable(pool.table.page_size, indptr, torch.arange(ids.numel()), kv_lens)
    return dataclasses.replace(pool, data=data, table=table)


class EmptyShift(Wrapper):
    """Empty requests / segments dropped from the query offsets only."""

    ops = DECODE + SPARSE + PREFILL + PAGED

    def run(self, case: Case, inputs: Inputs) -> Output:
        if case.sparse:  # its tokens read the pages through the (shifted) table rows
            assert isinstance(inputs, DecodeInputs)
            return self._sparse(case, inputs)  # type: ignore[arg-type]
        kept = tuple(u for u in case.units if u.q_len)
        compact = case.with_units(kept)
        view = inputs.with_row_bounds(compact, cu_seqlens([u.q_len for u in kept]))
        return self.inner.run(compact, view)

    def _sparse(self, case: SparseDecodeCase, inputs: DecodeInputs) -> Output:
        """Kept request j's tokens resolve their positions through page-table row j (the
        request j of the full batch): its pages, then poison for the pages row j lacks."""
        kept = tuple(r for r in case.requests if r.q_len)
        table, ps = inputs.table, inputs.table.page_size
        rows = []
        for j, req in enumerate(kept):
            pages = table.pages_of(j)[: -(-req.kv_len // ps)]
            missing = -(-req.kv_len // ps) - pages.numel()
            rows.append(torch.cat([pages, torch.full((missing,), -1, dtype=pages.dtype)]))
        counts = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        pool = _read_through(inputs.pool, torch.cat(rows), indptr,
                             torch.tensor([r.kv_len for r in kept], dtype=torch.int64))
        compact = dataclasses.replace(case, requests=kept)
        view = replace_inputs(inputs, case=compact, pool=pool,
                              qo_indptr=cu_seqlens([r.q_len for r in kept]))
        return self.inner.run(compact, view)


class SingleTokenNoContext(Wrapper):
    """One-token segments with context attend to their own token only."""

    ops = PREFILL

    def run(self, case: Case, inputs: Inputs) -> Output:
        res = self.inner.run(case, inputs)
        assert isinstance(inputs, PrefillInputs)
        qc, kc = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
        q, k, v = inputs.q.dequant(), inputs.k.dequant(), inputs.v.dequant()
        for i, (q_len, kv_len) in enumerate(zip(case.q_lengths, case.kv_lengths, strict=True)):
            if q_len != 1 or kv_len == q_len or len(case.units) < 2:  # one token, no context
                continue
            last = slice(kc[i + 1] - 1, kc[i + 1])
            o, lse = flash_attend(q[qc[i] : qc[i] + 1], k[last], v[last], case.softmax_scale,
                                  case.causal, case.quant.kv)
            res.out[qc[i]] = o[0].to(res.out.dtype)
            if res.lse is not None:
                res.lse[qc[i]] = lse[0]
        return res


class SoftCapIgnored(Wrapper):
    ops = PREFILL

    def run(self, case: Case, inputs: Inputs) -> Output:
        uncapped = dataclasses.replace(case, soft_cap=0.0)  # ops: the prefill (its field)
        return self.inner.run(uncapped, replace_inputs(inputs, case=uncapped))


class PerTokenScaleIgnored(Wrapper):
    ops = PREFILL

    def run(self, case: Case, inputs: Inputs) -> Output:
        assert isinstance(inputs, PrefillInputs)
        q = inputs.q
        first = q.scale.reshape(-1)[:1].reshape([1] * q.scale.dim()).expand_as(q.scale)
        return self.inner.run(case, replace_inputs(
            inputs, q=Quantised(q.stored, first.contiguous(), q.fmt, q.ideal)))


def tile_multiple_drops_last(inner: str = "torch") -> TileMultipleDropsLast:
    return TileMultipleDropsLast(resolve_inner(inner), "fault:tile-multiple-drops-last")


def tile_multiple_drops_last_64(inner: str = "torch") -> TileMultipleDropsLast:
    return TileMultipleDropsLast(resolve_inner(inner), "fault:tile-multiple-drops-last-64", 64)


def tile_multiple_drops_last_128(inner: str = "torch") -> TileMultipleDropsLast:
    return TileMultipleDropsLast(resolve_inner(inner), "fault:tile-multiple-drops-last-128", 128)


def tile_ceil_off_by_one(inner: str = "torch") -> TileCeilOffByOne:
    return TileCeilOffByOne(resolve_inner(inner), "fault:tile-ceil-off-by-one")


def kv_clamp_8k(inner: str = "torch") -> KvClamp:
    return KvClamp(resolve_inner(inner), "fault:kv-clamp-8k", 8192)


def kv_clamp_16k(inner: str = "torch") -> KvClamp:
    return KvClamp(resolve_inner(inner), "fault:kv-clamp-16k", 16384)


def kv_clamp_64k(inner: str = "torch") -> KvClamp:
    return KvClamp(resolve_inner(inner), "fault:kv-clamp-64k", 65536)


def page_id_int16(inner: str = "torch") -> PageIdNarrow:
    return PageIdNarrow(resolve_inner(inner), "fault:page-id-int16", 16, signed=True)


def page_id_uint16(inner: str = "torch") -> PageIdNarrow:
    return PageIdNarrow(resolve_inner(inner), "fault:page-id-uint16", 16, signed=False)


def empty_request_shift(inner: str = "torch") -> EmptyShift:
    return EmptyShift(resolve_inner(inner), "fault:empty-request-shift", DECODE + SPARSE)


def empty_segment_shift(inner: str = "torch") -> EmptyShift:
    return EmptyShift(resolve_inner(inner), "fault:empty-segment-shift", PREFILL + PAGED)


def single_token_no_context(inner: str = "torch") -> SingleTokenNoContext:
    return SingleTokenNoContext(resolve_inner(inner), "fault:single-token-no-context")


def soft_cap_ignored(inner: str = "torch") -> SoftCapIgnored:
    return SoftCapIgnored(resolve_inner(inner), "fault:soft-cap-ignored")


def per_token_scale_ignored(inner: str = "torch") -> PerTokenScaleIgnored:
    return PerTokenScaleIgnored(resolve_inner(inner), "fault:per-token-scale-ignored")


def narrow_accumulation(inner: str = "torch") -> TorchBackend:
    torch_only(inner, "narrow-accumulation")
    from mlacheck.backends.faults.precision import _Precision  # its spec's ops: ALL_OPS

    return _Precision(Numerics(acc_format="bf16"), "fault:narrow-accumulation")
