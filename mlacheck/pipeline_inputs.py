"""Deterministic tensors for the DeepSeek-V3.2 sparse-pipeline cases (mlacheck.spec: the
indexer logits in both forms, top-k, index conversion, sparse prefill, the composed path).

The same conventions as mlacheck.inputs: bulk values from mlacheck.rng's counter streams
keyed by the case (the same bits on CPU and GPU), small structural draws (page placement,
index sets) from a CPU generator seeded by the case, every output buffer guarded, every
pool poisoned where no live data is (free pages, partial last pages). What each kernel
receives is what vLLM hands it: the indexer's q in FP8 with its per-(token, head) scale
folded into the weights, keys in FP8 with one FP32 scale per token (in the paged form, in
the kernels' page layout: mlacheck.indexer_cache), top-k rows request-local and -1 padded.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from mlacheck import fp8, indexer_cache, kvcache, rng
from mlacheck.indexer_cache import IndexerKeys
from mlacheck.inputs import (
    DecodeInputs,
    Quantised,
    _out_dtype,
    cu_seqlens,
    generator,
    quantise,
    sparse_indices,
)
from mlacheck.kvcache import Guarded, KVPool, PageTable
from mlacheck.ops import Op
from mlacheck.spec import (
    Case,
    IndexConversionCase,
    IndexerCase,
    PagedIndexerCase,
    Placement,
    Quant,
    Request,
    SparseDecodeCase,
    SparsePipelineCase,
    SparsePrefillCase,
    TopkCase,
)

# A "ties" top-k row: logits rounded to multiples of this (unit-variance draws), so the k-th
# largest value is shared by several positions in most rows.
TIE_GRID = 0.25


# --------------------------------------------------------------------------- indexer


@dataclass
class IndexerQuery:
    """The indexer's query side as the kernels receive it: q [R, H, D] in FP8 and the
    per-head weights [R, H] with q's per-(token, head) dequantisation scale, the softmax
    scale head_dim^-1/2 and heads^-1/2 folded in (vLLM's `weights * q_scale * softmax_scale
    * n_heads^-0.5`); the unfolded parts are kept for the references and the faults."""

    q: torch.Tensor  # [R, H, D] FP8
    q_scale: torch.Tensor  # [R, H] FP32
    weights: torch.Tensor  # [R, H] FP32, what the kernel receives
    raw_weights: torch.Tensor  # [R, H] FP32, before folding
    q_ideal: torch.Tensor  # [R, H, D] FP32, before quantisation


@dataclass
class IndexerKeyPool:
    """The paged FP8 indexer-key cache: pages [P, ps, 1, D + 4] uint8 in the kernels' layout
    (a page's values, then its scales: mlacheck.indexer_cache), reached through `table`.
    Free pages and partial pages' tails hold NaN values and NaN scales."""

    data: torch.Tensor
    fmt: str
    dim: int
    table: PageTable

    @property
    def page_size(self) -> int:
        return self.table.page_size

    @property
    def page_bytes(self) -> int:
        return indexer_cache.page_bytes(self.page_size, self.dim)

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [P, ps, D] in fmt, scales [P, ps] FP32): views of the pages, no copy."""
        ps, d = self.page_size, self.dim
        flat = self.data.view(self.num_pages, self.page_bytes)
        values = flat[:, : ps * d].view(fp8.fmt(self.fmt).dtype).view(self.num_pages, ps, d)
        scales = flat[:, ps * d:].view(torch.float32)
        return values, scales

    def byte_range(self, r: int) -> tuple[int, int]:
        pages = self.table.pages_of(r)
        if pages.numel() == 0:
            return 0, 0
        return int(pages.min()) * self.page_bytes, (int(pages.max()) + 1) * self.page_bytes


@dataclass
class IndexerInputs:
    """Prefill form (`mqa_logits`): rows [T] against the flat keys [S] of every segment."""

    case: IndexerCase
    query: IndexerQuery
    keys: IndexerKeys  # values [S, D] FP8, scales [S] FP32
    k_ideal: torch.Tensor  # [S, D] FP32
    k_start: torch.Tensor  # [T] int32: row t sees keys [k_start, k_end)
    k_end: torch.Tensor  # [T] int32
    cu_seqlens_q: torch.Tensor  # [segments + 1] int32
    out: Guarded  # [T, S] FP32

    @property
    def device(self) -> torch.device:
        return self.query.q.device

    @property
    def row_bounds(self) -> list[int]:
        return self.cu_seqlens_q.tolist()


@dataclass
class PagedIndexerInputs:
    """Decode form (`paged_mqa_logits`): rows [B * next_n] against each request's keys in the
    paged cache; logits request-local [R, max kv_len]."""

    case: PagedIndexerCase
    query: IndexerQuery
    pool: IndexerKeyPool
    keys: IndexerKeys  # every request's keys, concatenated in request order (the golden's copy)
    k_ideal: torch.Tensor  # [sum kv_len, D] FP32
    context_lens: torch.Tensor  # [B] int32 (kv_len: each request's keys, its next_n tokens included)
    block_table: torch.Tensor  # [B, max pages] int32 (vLLM's; 0 past a request's pages)
    row_request: torch.Tensor  # [R] int64
    row_visible: torch.Tensor  # [R] int64: positions 0 .. visible-1 of its request
    qo_indptr: torch.Tensor  # [B + 1] int32 (next_n rows per request)
    out: Guarded  # [R, max kv_len] FP32

    @property
    def device(self) -> torch.device:
        return self.query.q.device

    @property
    def width(self) -> int:
        return int(self.context_lens.max())

    @property
    def row_bounds(self) -> list[int]:
        return self.qo_indptr.tolist()


def _query(case: IndexerCase | PagedIndexerCase, rows: int, device: torch.device | str,
           stream: str = "index") -> IndexerQuery:
    h, d, fmt_name = case.num_heads, case.head_dim, case.quant.q
    q = rng.normal((rows, h, d), rng.stream_key(case.seed_material, f"{stream}_q"), device)
    raw = rng.normal((rows, h), rng.stream_key(case.seed_material, f"{stream}_w"), device)
    scale = fp8.pick_scale(q, fmt_name, "amax", per_token=True)  # [R, H, 1]
    stored = fp8.quantize(q, fmt_name, scale)
    weights = raw * scale[..., 0] * (d ** -0.5) * (h ** -0.5)
    return IndexerQuery(stored, scale[..., 0].contiguous(), weights, raw, q)


def _keys(case: IndexerCase | PagedIndexerCase, n: int, device: torch.device | str,
          stream: str = "index") -> tuple[IndexerKeys, torch.Tensor]:
    k = rng.normal((n, case.head_dim), rng.stream_key(case.seed_material, f"{stream}_k"), device)
    return indexer_cache.quantise_keys(k, case.quant.kv), k


def build_indexer(case: IndexerCase, device: torch.device | str = "cpu") -> IndexerInputs:
    keys, k_ideal = _keys(case, case.total_kv, device)
    starts, ends = [], []
    k0 = 0
    for s in case.segments:
        for j in range(s.q_len):
            starts.append(k0)
            ends.append(k0 + s.context_len + j + 1)
        k0 += s.kv_len
    return IndexerInputs(
        case=case, query=_query(case, case.total_q, device), keys=keys, k_ideal=k_ideal,
        k_start=torch.tensor(starts, dtype=torch.int32).to(device),
        k_end=torch.tensor(ends, dtype=torch.int32).to(device),
        cu_seqlens_q=cu_seqlens(list(case.q_lengths)).to(device),
        out=kvcache.guarded_empty((case.total_q, case.total_kv), torch.float32, device),
    )


def indexer_pool(keys: list[IndexerKeys], table: PageTable, pool_pages: int, fmt_name: str,
                 dim: int, device: torch.device | str) -> IndexerKeyPool:
    """The paged key cache holding `keys[r]` on request r's pages; every other byte poisoned
    (NaN values and NaN scales), allocated and poisoned in one fill per half."""
    ps = table.page_size
    data = torch.empty((pool_pages, ps, 1, dim + indexer_cache.SCALE_BYTES), dtype=torch.uint8,
                       device=device)
    pool = IndexerKeyPool(data, fmt_name, dim, table)
    values, scales = pool.halves()
    values.view(torch.uint8).fill_(fp8.fmt(fmt_name).nan_bits)
    scales.fill_(float("nan"))
    for r, k in enumerate(keys):
        n = k.values.shape[0]
        pages = table.pages_of(r).to(device)
        if pages.numel() == 0:
            continue
        v = torch.full((pages.numel() * ps, dim), fp8.fmt(fmt_name).nan_bits, dtype=torch.uint8,
                       device=device)
        v[:n] = k.values.view(torch.uint8)
        s = torch.full((pages.numel() * ps,), float("nan"), dtype=torch.float32, device=device)
        s[:n] = k.scales
        values.view(torch.uint8).index_copy_(0, pages, v.view(-1, ps, dim))
        scales.index_copy_(0, pages, s.view(-1, ps))
    return pool


def build_paged_indexer(case: PagedIndexerCase, device: torch.device | str = "cpu",
                        gen: torch.Generator | None = None,
                        table: tuple[PageTable, int] | None = None) -> PagedIndexerInputs:
    """`table`: (page table, pool pages) to place the keys on (the composed pipeline shares
    the latent pool's); default: drawn for the case's placement."""
    gen = generator(case) if gen is None else gen
    lens = list(case.kv_lengths)
    keys, k_ideal = _keys(case, case.total_kv, device)
    if table is None:
        table = kvcache.assign_pages(lens, case.page_size,
                                     indexer_cache.page_bytes(case.page_size, case.head_dim),
                                     case.placement, gen)
    cuts = cu_seqlens(lens).tolist()
    per_req = [IndexerKeys(keys.values[a:b], keys.scales[a:b], keys.fmt)
               for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    pool = indexer_pool(per_req, table[0], table[1], case.quant.kv, case.head_dim, device)
    block_table, _ = table[0].to_vllm(pad_value=0)
    nn = case.next_n
    b = len(case.requests)
    ctx = torch.tensor(lens, dtype=torch.int64)
    visible = (ctx[:, None] - nn + torch.arange(nn)[None, :] + 1).reshape(-1)
    return PagedIndexerInputs(
        case=case, query=_query(case, b * nn, device), pool=pool, keys=keys, k_ideal=k_ideal,
        context_lens=ctx.to(torch.int32).to(device),
        block_table=block_table.to(torch.int32).to(device),
        row_request=torch.arange(b).repeat_interleave(nn), row_visible=visible,
        qo_indptr=cu_seqlens([nn] * b).to(device),
        out=kvcache.guarded_empty((b * nn, max(lens)), torch.float32, device),
    )


# --------------------------------------------------------------------------- top-k


@dataclass
class TopkInputs:
    """FP32 logits rows as the case's form hands them to a top-k kernel, -inf outside each
    row's window: decode [T, max kv_len] request-local (row t's window [0, length)), prefill
    [T, sum kv_len] batch-wide (window [k_start, k_end), positions returned relative to
    k_start)."""

    case: TopkCase
    logits: torch.Tensor  # [T, W] FP32
    k_start: torch.Tensor  # [T] int32 (0 in the decode form)
    k_end: torch.Tensor  # [T] int32
    qo_indptr: torch.Tensor  # [B + 1] int32
    out: Guarded  # [T, topk] int32

    @property
    def device(self) -> torch.device:
        return self.logits.device

    @property
    def lengths(self) -> torch.Tensor:
        """[T] positions each row sees."""
        return self.k_end - self.k_start

    @property
    def row_bounds(self) -> list[int]:
        return self.qo_indptr.tolist()


def topk_rows(case: Case) -> tuple[int, list[tuple[int, int]]]:
    """The top-k rows' width and each query row's window [start, end) of finite logits (-inf
    outside): `decode` request-local rows as wide as the longest request, `prefill`
    batch-wide rows of every request's keys; a row sees its unit's causal prefix. A top-k
    stage of the composed path (SparsePipelineCase) has the decode form."""
    windows, k0 = [], 0
    prefill = getattr(case, "form", "decode") == "prefill"
    for r in case.requests:
        base = k0 if prefill else 0
        windows += [(base, base + r.kv_len - r.q_len + j + 1) for j in range(r.q_len)]
        k0 += r.kv_len
    return (case.total_kv if prefill else max(case.kv_lengths)), windows


def build_topk(case: TopkCase, device: torch.device | str = "cpu") -> TopkInputs:
    width, windows = topk_rows(case)
    starts = [s for s, _ in windows]
    ends = [e for _, e in windows]
    t = case.total_q
    x = rng.normal((t, width), rng.stream_key(case.seed_material, "topk_logits"), device)
    if case.logits == "ties":
        x = torch.round(x / TIE_GRID) * TIE_GRID
    s = torch.tensor(starts, dtype=torch.int64)
    e = torch.tensor(ends, dtype=torch.int64)
    col = torch.arange(width)[None, :]
    inside = ((col >= s[:, None]) & (col < e[:, None])).to(x.device)
    return TopkInputs(
        case=case, logits=x.masked_fill(~inside, float("-inf")),
        k_start=s.to(torch.int32).to(device), k_end=e.to(torch.int32).to(device),
        qo_indptr=cu_seqlens(list(case.q_lengths)).to(device),
        out=kvcache.guarded_empty((t, case.topk), torch.int32, device),
    )


# --------------------------------------------------------------------------- index conversion

# Bytes of one page of the latent pool the converted slots address (bf16 576-wide tokens): what
# a `high` placement counts in (the pool itself is not built: conversion reads only the table).
LATENT_TOKEN_BYTES = 576 * 2


@dataclass
class ConversionInputs:
    """Request-local positions [T, topk] (-1 padded), the requests' block table and lengths;
    out: row-major slots [T, topk], or (ragged) a flat buffer of capacity T * topk whose first
    entries the kernel fills, with its indptr in Output.extra["indptr"]."""

    case: IndexConversionCase
    local: torch.Tensor  # [T, topk] int32
    table: PageTable
    block_table: torch.Tensor  # [B, max pages] int32 (vLLM's; 0 past a request's pages)
    kv_lens: torch.Tensor  # [B] int32
    qo_indptr: torch.Tensor  # [B + 1] int32
    out: Guarded  # [T, topk] or [T * topk] int32

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def row_bounds(self) -> list[int]:
        return self.qo_indptr.tolist()


def build_conversion(case: IndexConversionCase, device: torch.device | str = "cpu"
                     ) -> ConversionInputs:
    gen = generator(case)
    lens = list(case.kv_lengths)
    table, _ = kvcache.assign_pages(lens, case.page_size, case.page_size * LATENT_TOKEN_BYTES,
                                    case.placement, gen)
    local = sparse_indices(case, gen)  # type: ignore[arg-type]  # reads requests/topk/valid_cap
    block_table, _ = table.to_vllm(pad_value=0)
    t = case.total_q
    shape = (t, case.topk) if case.index_layout == "row_major" else (t * case.topk,)
    return ConversionInputs(
        case=case, local=local.to(device), table=table,
        block_table=block_table.to(torch.int32).to(device),
        kv_lens=torch.tensor(lens, dtype=torch.int32).to(device),
        qo_indptr=cu_seqlens(list(case.q_lengths)).to(device),
        out=kvcache.guarded_empty(shape, torch.int32, device),
    )


# --------------------------------------------------------------------------- sparse prefill


@dataclass
class SparsePrefillInputs:
    """q [T, H, 576], the flat latent KV [N, 1, 576] (segments laid end to end), indices
    [T, 1, topk] of global rows (-1 padded), out [T, H, 512]."""

    case: SparsePrefillCase
    q: Quantised
    kv: Quantised
    indices: torch.Tensor  # [T, 1, topk] int32
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    cu_seqlens_k: torch.Tensor  # [S + 1] int32
    out: Guarded

    @property
    def device(self) -> torch.device:
        return self.q.stored.device

    @property
    def row_bounds(self) -> list[int]:
        return self.cu_seqlens_q.tolist()

    paged_pool = None  # one flat latent KV: no pages, no pool region to name

    @property
    def empty_rows(self) -> torch.Tensor:
        """[T] rows with no valid index (output 0, LSE -inf)."""
        return (self.indices[:, 0] < 0).all(dim=1)

    def as_sparse_decode(self) -> tuple[SparseDecodeCase, DecodeInputs]:
        """These tensors as one sparse-decode request holding every query token over the flat
        latent KV viewed as a page-size-1 pool (page p = row p, so the indices are at once its
        positions and its global slots): how vLLM's ROCm V3.2 backend runs prefill tokens
        through a sparse decode kernel (FlashInfer's adapter runs it the same way). Nothing is
        copied; the output buffer is this one. An index the contract calls invalid (-1, or >= N
        as FlashMLA documents and golden.sparse reads it) is -1 there: a decode's page list
        has no other "no key"."""
        case, kv = self.case, self.kv
        t, n = case.total_q, case.total_kv
        twin = SparseDecodeCase(
            requests=(Request(t, n),), topk=case.topk, num_heads=case.num_heads, page_size=1,
            quant=case.quant, placement=Placement("packed", spare_pages=0), dims=case.dims,
            seed=case.seed)
        table = PageTable(1, torch.tensor([0, n]), torch.arange(n), torch.tensor([n]))
        pool = KVPool(kv.stored.view(n, 1, 1, -1), kv.fmt, kv.scale, table)
        return twin, DecodeInputs(
            case=twin, q=self.q, kv=[kv], pool=pool,
            qo_indptr=torch.tensor([0, t], dtype=torch.int32, device=self.device),
            out=self.out, topk_indices=torch.where(
                (self.indices[:, 0] >= 0) & (self.indices[:, 0] < n), self.indices[:, 0], -1))


def lonely_rows(total: int, n: int) -> list[int]:
    """`n` of `total` rows, evenly spread (first and last included when n >= 2)."""
    if n <= 0:
        return []
    if n == 1:
        return [total // 2]
    return sorted({round(i * (total - 1) / (n - 1)) for i in range(n)})


def build_sparse_prefill(case: SparsePrefillCase, device: torch.device | str = "cpu"
                         ) -> SparsePrefillInputs:
    gen = generator(case)
    d, h = case.dims, case.num_heads
    q = rng.normal((case.total_q, h, d.latent), rng.stream_key(case.seed_material, "q"), device)
    kv = rng.normal((case.total_kv, 1, d.latent), rng.stream_key(case.seed_material, "kv"),
                    device)
    quant = Quant(case.quant.q, case.quant.kv)
    # per query token: its segment's first row in the flat kv, its window, its valid entries
    starts = itertools.accumulate(case.kv_lengths[:-1], initial=0)
    firsts = [k0 for s, k0 in zip(case.segments, starts, strict=True) for _ in range(s.q_len)]
    rows = []
    for k0, visible, n in zip(firsts, case.visible_lengths, case.attended_lengths, strict=True):
        row = torch.full((case.topk,), -1, dtype=torch.int64)
        row[:n] = k0 + torch.randperm(visible, generator=gen)[:n]
        rows.append(row)
    idx = torch.stack(rows)
    idx[lonely_rows(case.total_q, case.empty_rows)] = -1
    return SparsePrefillInputs(
        case=case, q=quantise(q, case.quant.q, quant, device),
        kv=quantise(kv, case.quant.kv, quant, device),
        indices=idx.to(torch.int32)[:, None, :].to(device),
        cu_seqlens_q=cu_seqlens(list(case.q_lengths)).to(device),
        cu_seqlens_k=cu_seqlens(list(case.kv_lengths)).to(device),
        out=kvcache.guarded_empty((case.total_q, h, d.kv_lora_rank), _out_dtype(quant), device),
    )


# --------------------------------------------------------------------------- composed pipeline


@dataclass
class PipelineInputs:
    """The sparse decode stage's inputs (its case `case.attention_case()`: q, the latent pool,
    the output) and the indexer stage's (`case.indexer_case()`) over the same page table."""

    case: SparsePipelineCase
    attention: DecodeInputs  # topk_indices None: the selection is the implementation's
    indexer: PagedIndexerInputs

    @property
    def out(self) -> Guarded:
        return self.attention.out

    @property
    def device(self) -> torch.device:
        return self.attention.device

    @property
    def row_bounds(self) -> list[int]:
        return self.attention.qo_indptr.tolist()

    def attention_with(self, local: torch.Tensor) -> DecodeInputs:
        """The sparse decode stage's inputs with a selection (request-local positions [T,
        topk], -1 padded), sharing every tensor (the output buffer included)."""
        import dataclasses

        return dataclasses.replace(self.attention, topk_indices=local.to(torch.int32)
                                   .to(self.device))


def build_pipeline(case: SparsePipelineCase, device: torch.device | str = "cpu"
                   ) -> PipelineInputs:
    from mlacheck.inputs import _build_decode

    attention = _build_decode(case.attention_case(), device)
    attention.topk_indices = None
    table = attention.pool.table
    indexer = build_paged_indexer(case.indexer_case(), device,
                                  table=(table, attention.pool.num_pages))
    return PipelineInputs(case, attention, indexer)


# --------------------------------------------------------------------------- dispatch

BUILDERS = {
    Op.MQA_LOGITS: build_indexer,
    Op.PAGED_MQA_LOGITS: build_paged_indexer,
    Op.TOPK: build_topk,
    Op.INDEX_CONVERSION: build_conversion,
    Op.SPARSE_PREFILL: build_sparse_prefill,
    Op.SPARSE_PIPELINE: build_pipeline,
}

PipelineOpInputs = (IndexerInputs | PagedIndexerInputs | TopkInputs | ConversionInputs
                    | SparsePrefillInputs | PipelineInputs)
