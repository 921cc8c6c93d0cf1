"""The sparse-pipeline ops computed as their kernels compute them, at their precision: the
`torch` backend's implementation of them (and the judge's baseline), and the pieces the
planted faults and the real-kernel adapters reuse (a top-k between a vendor's logits and a
vendor's sparse attention, the index conversion).

Indexer logits as DeepGEMM / AITER form them: the FP8 q . k products summed in fp32 over the
head dim, then times the key's scale, ReLU, times the head's weight, summed over heads in
fp32 (the golden dequantises first: another rounding order). Top-k with torch.topk on the
row's window, -1 padded. Sparse attention: the online softmax of mlacheck.backends.numerics
per query token over its own selection, P rounded to the kv format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import fp8, sparse_index
from mlacheck.backends.numerics import Numerics, flash_attend, p_format_for
from mlacheck.golden.core import exact_matmuls
from mlacheck.pipeline_inputs import (
    ConversionInputs,
    IndexerInputs,
    PagedIndexerInputs,
    PipelineInputs,
    SparsePrefillInputs,
    TopkInputs,
)

# Score elements [rows, heads, keys] computed at once (fp32; ~32 MB).
BLOCK_ELEMENTS = 1 << 23
# Gathered kv elements [tokens, topk, D] a sparse attention holds at once (fp32; ~64 MB).
GATHER_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class IndexerMath:
    """How the logits are formed: `relu` (False is a planted bug)."""

    relu: bool = True


def logits_rows(q: torch.Tensor, weights: torch.Tensor, k_values: torch.Tensor,
                k_scales: torch.Tensor, start: torch.Tensor, end: torch.Tensor, width: int,
                math: IndexerMath = IndexerMath()) -> torch.Tensor:
    """[R, width] logits of q rows [R, H, D] (FP8) with weights [R, H] against keys
    [N, D] (FP8) scaled per key [N]: row r sees key columns [start[r], end[r]) (clamped to
    [0, min(N, width))), -inf elsewhere. Rows in blocks of BLOCK_ELEMENTS scores."""
    rows, h, _ = q.shape
    n = min(k_values.shape[0], width)
    dev = q.device
    out = torch.full((rows, width), float("-inf"), dtype=torch.float32, device=dev)
    s_lo = start.long().clamp(0, n).cpu()
    s_hi = torch.maximum(end.long().clamp(0, n).cpu(), s_lo)
    w = weights.float()
    r0 = 0
    with exact_matmuls():
        while r0 < rows:
            r1 = r0 + 1
            while r1 < rows and (r1 + 1 - r0) * h * max(1, int(s_hi[r0:r1 + 1].max())
                                                       - int(s_lo[r0:r1 + 1].min())) <= BLOCK_ELEMENTS:
                r1 += 1
            c0, c1 = int(s_lo[r0:r1].min()), int(s_hi[r0:r1].max())
            if c1 > c0:
                qb = q[r0:r1].float()
                kb = k_values[c0:c1].float()
                s = torch.einsum("rhd,cd->rhc", qb, kb) * k_scales[c0:c1].float()
                if math.relu:
                    s = s.clamp(min=0)
                lg = torch.einsum("rhc,rh->rc", s, w[r0:r1])
                col = torch.arange(c0, c1, device=dev)[None, :]
                inside = (col >= s_lo[r0:r1, None].to(dev)) & (col < s_hi[r0:r1, None].to(dev))
                out[r0:r1, c0:c1] = lg.masked_fill(~inside, float("-inf"))
            r0 = r1
    return out


def mqa_logits(inputs: IndexerInputs, math: IndexerMath = IndexerMath()) -> torch.Tensor:
    q = inputs.query
    return logits_rows(q.q, q.weights, inputs.keys.values, inputs.keys.scales, inputs.k_start,
                       inputs.k_end, inputs.keys.values.shape[0], math)


def paged_mqa_logits(inputs: PagedIndexerInputs, visible: torch.Tensor | None = None,
                     math: IndexerMath = IndexerMath(),
                     halves: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[R, max kv_len] request-local logits read through the block table: row r sees its
    request's positions 0 .. visible[r]-1 (default: the case's); the pages are read as far
    as that reaches (past kv_len: a page's tail or a page the request does not own)."""
    vis = inputs.row_visible if visible is None else visible.long()
    values, scales = inputs.pool.halves() if halves is None else halves
    ps, width = inputs.pool.page_size, inputs.width
    table = inputs.block_table.long().cpu()
    out = torch.full((vis.numel(), width), float("-inf"), dtype=torch.float32,
                     device=inputs.device)
    q = inputs.query
    for b in torch.unique(inputs.row_request).tolist():
        rows = torch.nonzero(inputs.row_request == b).flatten()
        reach = min(int(vis[rows].max()), table.shape[1] * ps)
        if reach <= 0:
            continue
        pages = table[b, : -(-reach // ps)].to(values.device)
        kv = fp8.select_rows(values, pages).reshape(-1, values.shape[-1])
        sc = scales.index_select(0, pages).reshape(-1)
        r = rows.to(inputs.device)
        out[r] = logits_rows(fp8.select_rows(q.q, r), q.weights[r], kv, sc,
                             torch.zeros_like(rows), vis[rows], width, math)
    return out


def topk_local(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k] int32 positions of the k largest request-local logits [R, W] among each row's
    first lengths[r] columns, largest first, -1 padded where a row has fewer."""
    rows, width = logits.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    take = min(k, width)
    if take == 0:
        return out
    col = torch.arange(width, device=logits.device)[None, :]
    masked = logits.masked_fill(col >= lengths.to(logits.device).long()[:, None], float("-inf"))
    vals, idx = torch.topk(masked, take, dim=1)
    n = lengths.to(logits.device).long().clamp(max=take)
    keep = torch.arange(take, device=logits.device)[None, :] < n[:, None]
    out[:, :take] = torch.where(keep & torch.isfinite(vals), idx, torch.full_like(idx, -1)).int()
    return out


def topk(inputs: TopkInputs) -> torch.Tensor:
    """The case's form: decode rows are request-local; prefill rows are batch-wide and the
    positions come back relative to each row's k_start."""
    lengths = inputs.lengths
    if inputs.case.form == "decode":
        return topk_local(inputs.logits, lengths, inputs.case.topk)
    width = max(inputs.case.kv_lengths)
    col = inputs.k_start.long()[:, None] + torch.arange(width, device=inputs.device)[None, :]
    s_total = inputs.logits.shape[1]
    local = inputs.logits.gather(1, col.clamp(max=s_total - 1))
    local = local.masked_fill(col >= s_total, float("-inf"))
    return topk_local(local, lengths, inputs.case.topk)


def convert(inputs: ConversionInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Global slots: row-major [T, topk], or ragged (flat valid slots, indptr [T + 1])."""
    req = sparse_index.token_requests(inputs.qo_indptr.cpu())
    slots = sparse_index.to_global_slots(inputs.local.cpu(), req, inputs.block_table.cpu(),
                                         inputs.case.page_size, inputs.kv_lens.cpu())
    if inputs.case.index_layout == "row_major":
        return slots.to(torch.int32), None
    ragged = sparse_index.to_ragged(slots)
    return ragged.flat.to(torch.int32), ragged.indptr.to(torch.int32)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, kv_scale: torch.Tensor,
                     indices: torch.Tensor, scale: float, dv: int, p_format: str,
                     numerics: Numerics) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query token t, attention of q [T, H, D] (fp32 values of the stored format) over
    rows indices[t] of kv [N, 1, D] (as stored, dequantised by `kv_scale` row by row as they
    are gathered; -1 or >= N ignored): (out [T, H, dv], LSE [T, H], max scaled score [T, H];
    0 / -inf / -inf for a row with no valid index)."""
    t_total, h, d = q.shape
    n = kv.shape[0]
    out = torch.zeros((t_total, h, dv), dtype=torch.float32, device=q.device)
    lse = torch.full((t_total, h), float("-inf"), dtype=torch.float32, device=q.device)
    mx = torch.full((t_total, h), float("-inf"), dtype=torch.float32, device=q.device)
    idx = indices.long().to(q.device)
    # each row's valid indices first (in their order): a -1 is never read, and the tiles of
    # the online softmax hold real keys first, as a kernel reading a compacted list does
    order = torch.argsort(((idx < 0) | (idx >= n)).to(torch.int8), dim=1, stable=True)
    idx = idx.gather(1, order)
    valid = (idx >= 0) & (idx < n)
    k = idx.shape[1]
    block = max(1, GATHER_ELEMENTS // max(1, k * d))
    for t0 in range(0, t_total, block):
        t1 = min(t_total, t0 + block)
        v_b = valid[t0:t1]
        width = int(v_b.sum(1).max()) if v_b.numel() else 0
        if width == 0:
            continue
        rows = idx[t0:t1, :width].clamp(0, n - 1)
        sel = fp8.dequantize(fp8.select_rows(kv, rows.reshape(-1).to(kv.device)),
                             kv_scale).reshape(t1 - t0, width, d)
        sel = torch.where(v_b[:, :width, None], sel, torch.zeros_like(sel))
        # independent problems batched along the head axis: token t's heads are the queries,
        # its own selection the keys (numerics.flash_attend with a mask per "head")
        kk = sel.permute(1, 0, 2)  # [width, tokens, D]
        o, l = flash_attend(q[t0:t1].permute(1, 0, 2), kk, kk[..., :dv], scale, False,
                            p_format, numerics, kv_valid=v_b[:, :width])
        out[t0:t1], lse[t0:t1] = o.permute(1, 0, 2), l.permute(1, 0)
        with exact_matmuls():
            s = torch.einsum("thd,tkd->thk", q[t0:t1], sel) * scale
        mx[t0:t1] = s.masked_fill(~v_b[:, None, :width], float("-inf")).amax(-1)
    return out, lse, mx


def sparse_prefill(inputs: SparsePrefillInputs, numerics: Numerics, scale: float | None = None,
                   indices: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    case = inputs.case
    idx = inputs.indices[:, 0] if indices is None else indices
    return sparse_attention(inputs.q.dequant(), inputs.kv.stored, inputs.kv.scale, idx,
                            case.softmax_scale if scale is None else scale,
                            case.dims.kv_lora_rank, p_format_for(case.quant.kv, numerics),
                            numerics)


def pool_rows(inputs: PipelineInputs) -> torch.Tensor:
    """The latent pool as rows of global slots [pages * page_size, 1, 576], as stored (a
    view of the linear pool)."""
    lin = inputs.attention.pool.linear()
    return lin.reshape(-1, *lin.shape[2:])


def slots_attention(inputs: PipelineInputs, slots: torch.Tensor, numerics: Numerics
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode over global slots [T, topk] of the latent pool (-1 ignored)."""
    case = inputs.case
    out, lse, _ = sparse_attention(inputs.attention.q.dequant(), pool_rows(inputs),
                                   inputs.attention.pool.scale, slots, case.softmax_scale,
                                   case.dims.kv_lora_rank,
                                   p_format_for(case.quant.kv, numerics), numerics)
    return out, lse


def pipeline_selection(inputs: PipelineInputs, math: IndexerMath = IndexerMath()
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(request-local top-k [T, topk], their global slots [T, topk]) from the paged logits."""
    idx = inputs.indexer
    logits = paged_mqa_logits(idx, math=math)
    local = topk_local(logits, idx.row_visible, inputs.case.topk)
    return local, global_slots(inputs, local)


def global_slots(inputs: PipelineInputs, local: torch.Tensor) -> torch.Tensor:
    """Request-local positions [T, topk] -> global slots of the shared page table (int32)."""
    idx = inputs.indexer
    req = sparse_index.token_requests(idx.qo_indptr.cpu())
    return sparse_index.to_global_slots(local.cpu(), req, idx.block_table.cpu(),
                                        inputs.case.page_size, idx.context_lens.cpu()
                                        ).to(torch.int32).to(inputs.device)
