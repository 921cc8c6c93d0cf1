"""The DeepSeek-V3.2 lightning indexer's logits in FP32/FP64: what top-k selects from.

    logits[t, s] = sum_h  w[t, h] * ReLU( (q[t, h] * qs[t, h]) . (k[s] * ks[s]) )

q [T, H, D] FP8 with a dequantisation scale per (token, head) (vLLM folds it, with the
softmax scale and H^-1/2, into the weights the kernel receives: the kernel APIs take no q
scale); k [S, D] FP8 with a per-token FP32 scale; w [T, H] FP32. Row t sees the key window
[ks[t], ke[t]) (DeepGEMM's `cu_seq_len_k_start` / `_end`: causal prefill, several requests
laid end to end); every other position is -inf.

The paged form (decode, `fp8_paged_mqa_logits`) reads the keys of row r's request through a
block table from a paged pool and sees its first `visible[r]` positions (MTP with next_n
tokens per request: token j of a request with context L sees L - next_n + j + 1).

Beside the logits the reference returns their *magnitude*, the same sum with every term
replaced by its absolute value (sum_h |w| qs * (|q| . |k|) * ks): the scale of the rounding
error any implementation may make on that logit, from which the judge derives the logit
bound (and top-k derives what counts as a tie).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import fp8
from mlacheck.golden.core import Operand, exact_matmuls, score_block_elements


@dataclass
class IndexerLogits:
    logits: torch.Tensor  # [R, W]; -inf outside each row's window
    magnitude: torch.Tensor  # [R, W] sum of |terms|; 0 outside each row's window


def mqa_logits(
    q: Operand,
    k: Operand,
    weights: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    width: int | None = None,
    budget: int | None = None,
) -> IndexerLogits:
    """q [T, H, D] (scale per (token, head) as [T, H, 1], or per tensor); k [S, D] (scale
    [S, 1] per token); weights [T, H]; k_start / k_end [T]: row t sees [k_start, k_end)
    (clamped to [0, S]). Returns [T, width] (default S) logits and magnitudes.

    Rows are processed in blocks whose score block [rows, H, columns] stays under `budget`
    elements; each block reads only the key columns its rows' windows span."""
    t_total, h, _ = q.data.shape
    s_total = k.data.shape[0]
    width = s_total if width is None else width
    dev = q.data.device
    starts = k_start.long().clamp(0, s_total).cpu()
    ends = torch.maximum(k_end.long().clamp(0, s_total).cpu(), starts)
    logits = torch.full((t_total, width), float("-inf"), dtype=dtype, device=dev)
    magnitude = torch.zeros((t_total, width), dtype=dtype, device=dev)
    budget = budget or score_block_elements(dtype)
    w = weights.to(dev, dtype)
    t0 = 0
    with exact_matmuls():
        while t0 < t_total:
            t1 = _row_block_end(starts, ends, t0, h, budget)
            c0, c1 = int(starts[t0:t1].min()), int(ends[t0:t1].max())
            if c1 > c0:
                lo, mag = _block(q.view(lambda x, a=t0, b=t1: x[a:b]),
                                 k.view(lambda x, a=c0, b=c1: x[a:b]), w[t0:t1], dtype)
                col = torch.arange(c0, c1)[None, :]
                inside = ((col >= starts[t0:t1, None]) & (col < ends[t0:t1, None])).to(dev)
                c1w = min(c1, width)
                logits[t0:t1, c0:c1w] = lo.masked_fill(~inside, float("-inf"))[:, :c1w - c0]
                magnitude[t0:t1, c0:c1w] = mag.masked_fill(~inside, 0.0)[:, :c1w - c0]
            t0 = t1
    return IndexerLogits(logits, magnitude)


def _row_block_end(starts: torch.Tensor, ends: torch.Tensor, t0: int, heads: int,
                   budget: int) -> int:
    """The end of the row block starting at t0: as many rows as keep rows x heads x (the
    columns their windows span) within the budget, at least one."""
    t1 = t0 + 1
    lo, hi = int(starts[t0]), int(ends[t0])
    while t1 < starts.numel():
        nlo, nhi = min(lo, int(starts[t1])), max(hi, int(ends[t1]))
        if (t1 + 1 - t0) * heads * max(1, nhi - nlo) > budget:
            break
        lo, hi, t1 = nlo, nhi, t1 + 1
    return t1


def _block(q: Operand, k: Operand, w: torch.Tensor, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] logits and magnitudes of q rows [rows, H, D] against keys [cols, D]."""
    qd = q.get(dtype)
    kd = k.get(dtype)
    scores = torch.einsum("thd,sd->ths", qd, kd)
    logits = torch.einsum("ths,th->ts", scores.clamp_(min=0), w)
    abs_dots = torch.einsum("thd,sd->ths", qd.abs(), kd.abs())
    return logits, torch.einsum("ths,th->ts", abs_dots, w.abs())


def paged_mqa_logits(
    q: Operand,
    k_values: torch.Tensor,
    k_scales: torch.Tensor,
    weights: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    row_request: torch.Tensor,
    row_visible: torch.Tensor,
    width: int,
    dtype: torch.dtype = torch.float32,
    budget: int | None = None,
) -> IndexerLogits:
    """q [R, H, D] (R = requests x next_n rows); a paged key pool: k_values [P, ps, D] FP8
    and k_scales [P, ps] FP32 (the two halves of each page of the kernels' packed layout,
    mlacheck.indexer_cache); block_table [B, W] page ids; kv_lens [B]; row r belongs to
    request row_request[r] and sees its first row_visible[r] positions (<= kv_len).

    Only each request's first kv_len positions are read (never a page's tail or a page past
    the request): a kernel that reads further shows up against this. Returns [R, width]."""
    r_total, _, _ = q.data.shape
    dev = q.data.device
    page_size, dim = k_values.shape[1], k_values.shape[2]
    logits = torch.full((r_total, width), float("-inf"), dtype=dtype, device=dev)
    magnitude = torch.zeros((r_total, width), dtype=dtype, device=dev)
    req = row_request.long().cpu()
    vis = row_visible.long().cpu()
    lens = kv_lens.long().cpu()
    if bool((vis > lens[req]).any()):
        raise ValueError("a row sees more positions than its request's kv_len")
    table = block_table.long().cpu()
    for b in torch.unique(req).tolist():
        rows = torch.nonzero(req == b).flatten()
        n = int(lens[b])
        pages = table[b, : -(-n // page_size)].to(dev)
        values = fp8.select_rows(k_values, pages).reshape(-1, dim)[:n]
        scales = k_scales.index_select(0, pages).reshape(-1, 1)[:n]
        part = mqa_logits(q.view(lambda x, r=rows: fp8.select_rows(x, r)), Operand(values, scales),
                          weights[rows.to(weights.device)], torch.zeros_like(rows), vis[rows],
                          dtype, width=width, budget=budget)
        logits[rows.to(dev)] = part.logits
        magnitude[rows.to(dev)] = part.magnitude
    return IndexerLogits(logits, magnitude)


def mtp_visible(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """[B * next_n] positions each row sees: token j of a request with context L (the kv
    including all its next_n tokens) sees L - next_n + j + 1 (bottom-right causal), as
    AITER's `_deepgemm_fp8_paged_mqa_logits` masks and DeepGEMM's 2-D context_lens say."""
    j = torch.arange(next_n)
    return (context_lens.long()[:, None] - next_n + j[None, :] + 1).clamp(min=0).reshape(-1)
