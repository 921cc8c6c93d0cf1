"""Paged-KV faults: bug classes (mlacheck/bugclasses.py) 6 and 11.

offset-wrap-int32 (class 6): a page's byte offset `page * page_bytes` computed in signed
    32 bits. Past 2^31 it wraps negative, and the kernel reads memory before the pool (not
    its own: poison here). Computed from the pool's real page ids and page_bytes, so only
    requests with pages above 2^31 are hit.
offset-wrap-uint32 (class 6): the same offset in unsigned 32 bits: pages past 2^32 are read
    from `offset mod 2^32`, i.e. from the bottom of the pool (free, poisoned pages). Right for
    a pool that ends below 4 GiB, however far past 2^31 it goes.
    Both wrap at the case's modelled width (Placement.offset_bits): 32, or a scale model's
    (24: wraps at 2^23 / 2^24, the same mechanism on megabyte pools).
read-past-page-end (class 6): the buffer range of the last page covers the whole page, and the
    kernel uses all of it: kv_last_page_lens = page_size, so a partial last page's tail
    (poisoned) is attended to. Right for full last pages (always at page size 1).
last-page-lens-one (class 11): a path only ever run with page size 1 passes
    kv_last_page_lens = 1 (always right there); at page size > 1 the last page loses all
    but its first token.
"""

from __future__ import annotations

from typing import Any

import torch

from mlacheck import fp8
from mlacheck.backends.base import Backend, Output
from mlacheck.backends.faults._base import (
    AdapterFault,
    Wrapper,
    adapter,
    replace_inputs,
    resolve_inner,
    with_table,
)
from mlacheck.backends.faults.generic import call_page_size
from mlacheck.inputs import DecodeInputs, Inputs
from mlacheck.kvcache import KVPool, PageTable
from mlacheck.spec import Case, Op

DECODE_OPS = (Op.DECODE, Op.SPARSE_DECODE)
LAST_PAGE_OPS = (Op.DECODE, Op.PAGED_PREFILL)
PAGE_TABLE_CALLS = ("mla.mla_decode_fwd", "get_mla_metadata_v1", "mha_batch_prefill_func")


def wrap_offset(offset: int, bits: int, signed: bool) -> int:
    """`offset` as a `bits`-bit integer would hold it (two's complement when signed)."""
    span = 1 << bits
    wrapped = offset % span
    return wrapped - span if signed and wrapped >= span // 2 else wrapped


def pool_as_read(pool: KVPool, bits: int, signed: bool) -> tuple[KVPool, list[int]]:
    """The live pages as a kernel with `bits`-bit page offsets reads them: a compact pool
    (page i = the i-th entry of the page table) and the page ids whose offset wrapped.

    A wrapped offset inside the pool reads the bytes there (whatever page that is, even
    misaligned); one outside the pool (negative, or past its end) reads memory that is not
    the pool's: poisoned here, as mlacheck poisons everything a kernel does not own."""
    pb = pool.page_bytes
    flat = pool.data.contiguous().view(torch.uint8).reshape(-1)
    pages = pool.table.indices.tolist()
    data = torch.empty((len(pages), *pool.data.shape[1:]), dtype=pool.data.dtype,
                       device=pool.data.device)
    raw = data.view(torch.uint8).reshape(len(pages), -1)
    nan_bits, nan_code = fp8.nan_fill_value(pool.fmt)
    hit = []
    for i, page in enumerate(pages):
        off = page * pb
        at = wrap_offset(off, bits, signed)
        if at == off:
            raw[i] = flat[off : off + pb]
            continue
        hit.append(page)
        if at >= 0 and at + pb <= flat.numel():
            raw[i] = flat[at : at + pb]
        else:
            data[i].view(nan_bits).fill_(nan_code)
    table = PageTable(pool.table.page_size, pool.table.indptr, torch.arange(len(pages)),
                      pool.table.kv_lens)
    return with_table(pool, table, data), hit


class OffsetWrap(Wrapper):
    """Class 6: page byte offsets held in 32 bits (signed or unsigned), or in the narrower
    width a scale-model case says (Placement.offset_bits)."""

    ops = DECODE_OPS

    def __init__(self, inner: Backend, name: str, signed: bool) -> None:
        super().__init__(inner, name)
        self.signed = signed

    def run(self, case: Case, inputs: Inputs) -> Output:
        assert isinstance(inputs, DecodeInputs)
        bits = case.placement.offset_bits
        pool, hit = pool_as_read(inputs.pool, bits, self.signed)
        res = self.inner.run(case, replace_inputs(inputs, pool=pool))
        res.metadata["fault"] = f"{len(hit)} live pages read through a wrapped {bits}-bit offset"
        return res


class LastPageLens(AdapterFault):
    """kv_last_page_lens replaced in every AITER call that takes it (see subclasses)."""

    fault_ops = LAST_PAGE_OPS

    def last_page_lens(self, last: torch.Tensor, page_size: int) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover

    def rewrite(self, qualname: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        last = kwargs.get("kv_last_page_lens")
        if qualname in PAGE_TABLE_CALLS and last is not None:
            kwargs["kv_last_page_lens"] = self.last_page_lens(last, call_page_size(qualname,
                                                                                   kwargs))
        return kwargs


class ReadPastPageEnd(LastPageLens):
    """Class 6: the last page is read whole (kv_last_page_lens = page_size)."""

    def last_page_lens(self, last: torch.Tensor, page_size: int) -> torch.Tensor:
        return torch.full_like(last, page_size)


class LastPageLensOne(LastPageLens):
    """Class 11: kv_last_page_lens of all 1s (what page size 1 always has)."""

    def last_page_lens(self, last: torch.Tensor, page_size: int) -> torch.Tensor:
        return torch.ones_like(last)


def offset_wrap_int32(inner: str = "aiter-model") -> OffsetWrap:
    return OffsetWrap(resolve_inner(inner), "fault:offset-wrap-int32", signed=True)


def offset_wrap_uint32(inner: str = "aiter-model") -> OffsetWrap:
    return OffsetWrap(resolve_inner(inner), "fault:offset-wrap-uint32", signed=False)


def read_past_page_end(inner: str = "aiter-model") -> AdapterFault:
    return adapter(ReadPastPageEnd, "fault:read-past-page-end", inner)  # type: ignore[return-value]


def last_page_lens_one(inner: str = "aiter-model") -> AdapterFault:
    return adapter(LastPageLensOne, "fault:last-page-lens-one", inner)  # type: ignore[return-value]
