"""Paged KV pools: page tables (three conventions), placement, poison and guards (the page
layouts themselves are in `mlacheck.layouts`).

A pool is allocated on the target device and poisoned in one fill (free pages: the format's
NaN, FP8 NaN encodings included); only live pages are then written, so build cost scales
with live data. Partial last-page tails are poisoned too (NaN or a large finite sentinel).
Every request's pages can be mapped back to byte offsets of the pool, to assert that a
>2 GB / >4 GB case really places live pages past 2^31 / 2^32 and to say where a failure is.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlacheck import fp8, layouts
from mlacheck.spec import OFFSET_BITS, Placement, offset_wraps

# Output buffers carry this many guard rows before and after the real rows.
GUARD_ROWS = 2
# Value written into guard rows: exactly representable in fp32/bf16/fp16 and not a value a
# kernel plausibly writes by chance; compared bit for bit.
GUARD_VALUE = -31.75



# --------------------------------------------------------------------------- page tables


@dataclass(frozen=True)
class PageTable:
    """Canonical page table: CSR over requests of physical page ids, plus kv lengths.

    indptr [B+1] and indices [total_pages] are page-level (AITER/FlashInfer style);
    kv_lens [B] are token counts. All int64 on CPU; conventions convert from here.
    """

    page_size: int
    indptr: torch.Tensor
    indices: torch.Tensor
    kv_lens: torch.Tensor

    def __post_init__(self) -> None:
        b = self.kv_lens.numel()
        if self.indptr.numel() != b + 1:
            raise ValueError(f"indptr has {self.indptr.numel()} entries for {b} requests")
        need = pages_needed(self.kv_lens, self.page_size)
        have = self.indptr[1:] - self.indptr[:-1]
        if not torch.equal(need, have):
            raise ValueError(f"page counts {have.tolist()} do not fit kv_lens {self.kv_lens.tolist()}")

    @property
    def batch(self) -> int:
        return self.kv_lens.numel()

    def pages_of(self, r: int) -> torch.Tensor:
        return self.indices[self.indptr[r] : self.indptr[r + 1]]

    def slots_of(self, r: int) -> torch.Tensor:
        """Global slot ids (page * page_size + offset) of request r's tokens, in order."""
        n = int(self.kv_lens[r])
        pos = torch.arange(n)
        return self.pages_of(r)[pos // self.page_size] * self.page_size + pos % self.page_size

    def in_pages_of(self, tile: int) -> PageTable:
        """The same slots as `tile`-token pages: page p of `page_size` tokens is pages
        p*r .. p*r + r - 1 (r = page_size / tile) of a view of the pool with `tile`-token pages
        (slot p*page_size + o is (p*r + o // tile, o % tile) there). Each request keeps the
        pages its tokens need."""
        if tile < 1 or self.page_size % tile:
            raise ValueError(f"a {self.page_size}-token page is no whole number of {tile}-token pages")
        r = self.page_size // tile
        split = self.indices[:, None] * r + torch.arange(r)[None, :]  # [pages, r]
        need = pages_needed(self.kv_lens, tile)
        indptr = torch.zeros_like(self.indptr)
        indptr[1:] = torch.cumsum(need, 0)
        indices = torch.cat([split[int(self.indptr[b]):int(self.indptr[b + 1])].flatten()[:int(n)]
                             for b, n in enumerate(need)]) if self.batch else self.indices
        return PageTable(tile, indptr, indices, self.kv_lens)

    def of_requests(self, rows: Sequence[int]) -> PageTable:
        """The table of requests `rows` only, in that order, over the same physical pages:
        what a kernel is handed when the other requests are left out of its call (itself when
        that is every request, in order)."""
        rows = list(rows)
        if rows == list(range(self.batch)):
            return self
        idx = torch.tensor(rows, dtype=torch.long)
        counts = (self.indptr[1:] - self.indptr[:-1])[idx]
        indptr = torch.zeros(idx.numel() + 1, dtype=self.indptr.dtype)
        indptr[1:] = torch.cumsum(counts, 0)
        indices = (torch.cat([self.pages_of(int(r)) for r in idx]) if idx.numel()
                   else self.indices[:0])
        return PageTable(self.page_size, indptr, indices, self.kv_lens[idx])

    @property
    def last_page_lens(self) -> torch.Tensor:
        return self.kv_lens - (self.indptr[1:] - self.indptr[:-1] - 1) * self.page_size

    # --- AITER: qo_indptr-style page-level kv_indptr, kv_indices, kv_last_page_lens
    def to_aiter(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i32 = torch.int32
        return self.indptr.to(i32), self.indices.to(i32), self.last_page_lens.to(i32)

    @classmethod
    def from_aiter(
        cls, page_size: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
        kv_last_page_lens: torch.Tensor,
    ) -> PageTable:
        indptr = kv_indptr.long().cpu()
        n_pages = indptr[1:] - indptr[:-1]
        kv_lens = (n_pages - 1) * page_size + kv_last_page_lens.long().cpu()
        return cls(page_size, indptr, kv_indices.long().cpu()[: int(indptr[-1])], kv_lens)

    # --- vLLM: block_table [B, max_pages] (padding = pad_value) + seq_lens
    def to_vllm(self, pad_value: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        counts = self.indptr[1:] - self.indptr[:-1]
        width = int(counts.max()) if self.batch else 0
        table = torch.full((self.batch, width), pad_value, dtype=torch.int32)
        for r in range(self.batch):
            table[r, : int(counts[r])] = self.pages_of(r).to(torch.int32)
        return table, self.kv_lens.to(torch.int32)

    @classmethod
    def from_vllm(cls, page_size: int, block_table: torch.Tensor, seq_lens: torch.Tensor) -> PageTable:
        kv_lens = seq_lens.long().cpu()
        counts = pages_needed(kv_lens, page_size)
        indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(counts, 0)
        bt = block_table.long().cpu()
        indices = torch.cat([bt[r, : int(counts[r])] for r in range(len(kv_lens))]) if len(kv_lens) else bt.new_zeros(0)
        return cls(page_size, indptr, indices, kv_lens)

    # --- FlashInfer: kv_indptr, kv_indices, kv_len_arr
    def to_flashinfer(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i32 = torch.int32
        return self.indptr.to(i32), self.indices.to(i32), self.kv_lens.to(i32)

    @classmethod
    def from_flashinfer(
        cls, page_size: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len_arr: torch.Tensor
    ) -> PageTable:
        indptr = kv_indptr.long().cpu()
        return cls(page_size, indptr, kv_indices.long().cpu()[: int(indptr[-1])], kv_len_arr.long().cpu())

    def same_as(self, other: PageTable) -> bool:
        return (
            self.page_size == other.page_size
            and torch.equal(self.indptr, other.indptr)
            and torch.equal(self.indices, other.indices)
            and torch.equal(self.kv_lens, other.kv_lens)
        )


def pages_needed(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return (kv_lens + page_size - 1) // page_size


def page_indptr(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page-level indptr (int64) of requests laid out one after another."""
    indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(pages_needed(kv_lens, page_size), 0)
    return indptr


def assign_pages(
    kv_lens: Sequence[int], page_size: int, page_bytes: int, placement: Placement,
    gen: torch.Generator,
) -> tuple[PageTable, int]:
    """Physical page ids per request for a placement; returns (table, pool page count)."""
    lens = torch.tensor(list(kv_lens), dtype=torch.int64)
    indptr = page_indptr(lens, page_size)
    live = int(indptr[-1])
    first = placement.first_live_page(live, page_bytes)
    pool_pages = first + live + placement.spare_pages
    if placement.kind == "packed":
        ids = torch.arange(live)
    else:  # shuffled (first = 0), or high: straddling offset_bytes, half below, half above
        ids = first + torch.randperm(live + placement.spare_pages, generator=gen)[:live]
    return PageTable(page_size, indptr, ids.to(torch.int64), lens), pool_pages


# --------------------------------------------------------------------------- pools


def _fill_bits(t: torch.Tensor, fmt_name: str, value: str | float) -> None:
    """Fill t (any format) with NaN ("nan") or a finite value, in one device fill."""
    if value == "nan":
        bits_dtype, bits = fp8.nan_fill_value(fmt_name)
        t.view(bits_dtype).fill_(bits)
    elif t.dtype.itemsize == 1:  # fp8: fill the byte code of the value
        code = torch.tensor([float(value)]).to(t.dtype).view(torch.uint8).item()
        t.view(torch.uint8).fill_(code)
    else:
        t.fill_(float(value))


@dataclass
class KVPool:
    """One paged pool tensor (K, V or the 576-wide latent) and its page table.

    `data` holds stored elements in `fmt` with `scale` as dequantisation factor; its
    layout is linear [P, ps, H, D] or CK vectorized (K or V flavour, see `kind`).
    """

    data: torch.Tensor
    fmt: str
    scale: torch.Tensor
    table: PageTable
    layout: str = layouts.LINEAR.name
    kind: str = "latent"  # latent | k | v (which vectorized flavour applies)

    @property
    def page_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def linear(self) -> torch.Tensor:
        """The pool in linear layout [P, ps, H, D] (a view or a copy)."""
        return layouts.get(self.layout).load(self.data, self.kind)

    @functools.cached_property
    def _indices_on_device(self) -> torch.Tensor:
        # copied once: a host-to-device copy per gather would wait for the device each time
        return self.table.indices.to(self.data.device)

    def gather(self, r: int, dequant: bool = True, whole_pages: bool = False) -> torch.Tensor:
        """Request r's tokens [kv_len, H, D] read through the page table (fp32 if dequant);
        whole_pages: up to its last page's end, the (poisoned) tail included, as a kernel
        that reads past kv_len sees them."""
        lo, hi = int(self.table.indptr[r]), int(self.table.indptr[r + 1])
        pages = self._indices_on_device[lo:hi]
        blk = layouts.get(self.layout).load(_select_pages(self.data, pages), self.kind)
        n = (hi - lo) * self.table.page_size if whole_pages else int(self.table.kv_lens[r])
        tokens = blk.reshape(-1, *blk.shape[2:])[:n]
        return fp8.dequantize(tokens, self.scale) if dequant else tokens

    def byte_range(self, r: int) -> tuple[int, int]:
        """[lo, hi) byte offsets in the pool spanned by request r's pages."""
        pages = self.table.pages_of(r)
        if pages.numel() == 0:  # an empty request owns no page
            return 0, 0
        return int(pages.min()) * self.page_bytes, (int(pages.max()) + 1) * self.page_bytes

    def page_byte_range(self, page: int) -> tuple[int, int]:
        return page * self.page_bytes, (page + 1) * self.page_bytes


def byte_region(lo: int, hi: int, bits: int = OFFSET_BITS) -> str:
    """Human name of a byte range relative to the 2^31 / 2^32 boundaries (those of a
    `bits`-wide offset model: a case's `placement.offset_bits`)."""
    signed, unsigned = offset_wraps(bits)

    def side(x: int) -> str:
        if x < signed:
            return f"below 2^{bits - 1}"
        return f"2^{bits - 1}..2^{bits}" if x < unsigned else f"above 2^{bits}"
    a, z = side(lo), side(max(lo, hi - 1))
    return a if a == z else f"{a} .. {z}"


def build_pool(
    values: Sequence[torch.Tensor],
    table: PageTable,
    pool_pages: int,
    fmt_name: str,
    scale: torch.Tensor,
    device: torch.device | str,
    layout: str = layouts.LINEAR.name,
    kind: str = "latent",
    tail_poison: str = "nan",
) -> KVPool:
    """Allocate + poison the pool on `device` in one fill, then write only live pages.

    values[r]: request r's tokens [kv_len, H, D], already in the stored format.
    """
    f = fp8.fmt(fmt_name)
    ps = table.page_size
    h, d = values[0].shape[1:]
    lin_shape = (ps, h, d)
    stored = layouts.get(layout)
    page_shape = stored.page_shape(ps, h, d, fmt_name, kind)
    data = torch.empty((pool_pages, *page_shape), dtype=f.dtype, device=device)
    _fill_bits(data, fmt_name, "nan")
    tail = "nan" if tail_poison == "nan" else fp8.sentinel_value(fmt_name)
    for r, v in enumerate(values):
        n_pages = int(table.indptr[r + 1] - table.indptr[r])
        blk = torch.empty((n_pages * ps, h, d), dtype=f.dtype, device=device)
        _fill_bits(blk[v.shape[0] :], fmt_name, tail)
        blk[: v.shape[0]] = v.to(device)
        blk = stored.store(blk.view(n_pages, *lin_shape), fmt_name, kind)
        bits = fp8.int_dtype(f.dtype)  # index_copy_ has no fp8 kernels: copy the bit patterns
        data.view(bits).index_copy_(0, table.pages_of(r).to(device), blk.contiguous().view(bits))
    return KVPool(data, fmt_name, scale.to(device), table, layout, kind)


def repaged(pool: KVPool, page_size: int, tail_poison: str, gen: torch.Generator) -> KVPool:
    """The same stored tokens in a fresh shuffled pool of `page_size` pages, poisoned alike.

    For kernels that take one page size only (FlashMLA: 64): they still read every case's
    lengths, batch and poisoned tails, through a page table of their own page size.
    """
    values = [pool.gather(r, dequant=False) for r in range(pool.table.batch)]
    h, d = pool.linear().shape[2:]
    page_bytes = page_size * h * d * pool.data.element_size()
    table, pool_pages = assign_pages(pool.table.kv_lens.tolist(), page_size, page_bytes,
                                     Placement("shuffled", tail_poison=tail_poison), gen)
    return build_pool(values, table, pool_pages, pool.fmt, pool.scale, pool.data.device,
                      tail_poison=tail_poison)


def free_pages(pool: KVPool) -> torch.Tensor:
    """Pool page ids that belong to no request (poisoned)."""
    used = torch.zeros(pool.num_pages, dtype=torch.bool)
    used[pool.table.indices] = True
    return torch.nonzero(~used).flatten()


# --------------------------------------------------------------------------- guards


@dataclass
class Guarded:
    """An output buffer with GUARD_ROWS poisoned rows before and after the real rows."""

    full: torch.Tensor

    @property
    def out(self) -> torch.Tensor:
        """The view a kernel writes into."""
        return self.full[GUARD_ROWS : self.full.shape[0] - GUARD_ROWS]

    def violations(self) -> list[str]:
        """Which guard rows were written (bit-level comparison), as messages."""
        expect = torch.full_like(self.full[:1], GUARD_VALUE)
        bad = []
        n = self.out.shape[0]
        for i in range(GUARD_ROWS):
            for name, row in (("before", i), ("after", self.full.shape[0] - GUARD_ROWS + i)):
                got = self.full[row : row + 1]
                same = got.view(fp8.int_dtype(got.dtype)) == expect.view(fp8.int_dtype(got.dtype))
                if not bool(same.all()):
                    where = f"row {row - GUARD_ROWS}" if name == "before" else f"row {n + i}"
                    bad.append(
                        f"guard {where} ({name} the {n} output rows) was written: "
                        f"{int((~same).sum())} elements changed"
                    )
        return bad


def _select_pages(data: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    return fp8.select_rows(data, pages)




def guarded_empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> Guarded:
    full = torch.full((shape[0] + 2 * GUARD_ROWS, *shape[1:]), GUARD_VALUE, dtype=dtype, device=device)
    return Guarded(full)
