"""Sparse (top-k) MLA attention in FP32/FP64: each query token attends to its own index set.

One function serves sparse decode (indices are request-local positions, gathered per
request) and sparse prefill (FlashMLA's `flash_mla_sparse_fwd` form: a flat latent KV
[N, 1, 576] and per-token global slots). An index is valid when 0 <= index < N; -1 (the
padding every kernel uses) and anything >= N are ignored, as FlashMLA documents
("Invalid indices should be set to -1 or numbers >= s_kv").

Returned per row (token x head): the output (0 where no index is valid), the natural-log
LSE (-inf there) and the max scaled score ("max_logits", -inf there). Which library writes
+inf instead of -inf for such a row is an adapter's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import fp8
from mlacheck.golden.core import Operand, exact_matmuls, score_block_elements, softmax_v


@dataclass
class SparseResult:
    out: torch.Tensor  # [T, H, Dv]
    lse: torch.Tensor  # [T, H] natural log; -inf where no index is valid
    max_logits: torch.Tensor  # [T, H] max of the scaled scores; -inf where no index is valid


def sparse_attention(
    q: torch.Tensor | Operand,
    kv: torch.Tensor | Operand,
    indices: torch.Tensor,
    scale: float,
    dv: int,
    dtype: torch.dtype = torch.float32,
    budget: int | None = None,
) -> SparseResult:
    """q [T, H, D]; kv [N, D] or [N, 1, D] (V = K's first `dv` channels, MLA's latent);
    indices [T, K] or [T, 1, K] rows into kv. Tokens are processed in blocks whose score
    block [tokens, H, K] stays under `budget` elements; the softmax within a row is exact."""
    qo = q if isinstance(q, Operand) else Operand(q)
    ko = kv if isinstance(kv, Operand) else Operand(kv)
    if ko.data.dim() == 3:
        if ko.data.shape[1] != 1:
            raise ValueError(f"sparse MLA reads one latent KV head, not {ko.data.shape[1]}")
        ko = ko.view(lambda x: x[:, 0])
    idx = indices[:, 0] if indices.dim() == 3 else indices
    t_total, h, _ = qo.data.shape
    if idx.shape[0] != t_total:
        raise ValueError(f"{idx.shape[0]} index rows for {t_total} query tokens")
    n = ko.data.shape[0]
    topk = idx.shape[1]
    dev = qo.data.device
    idx = idx.to(dev).long()
    valid = (idx >= 0) & (idx < n)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    out = torch.zeros((t_total, h, dv), dtype=dtype, device=dev)
    lse = torch.full((t_total, h), float("-inf"), dtype=dtype, device=dev)
    mx = torch.full((t_total, h), float("-inf"), dtype=dtype, device=dev)
    if t_total == 0 or topk == 0 or n == 0:
        return SparseResult(out, lse, mx)
    tb = max(1, (budget or score_block_elements(dtype)) // max(1, h * topk))
    with exact_matmuls():
        for t0 in range(0, t_total, tb):
            t1 = min(t_total, t0 + tb)
            rows = safe[t0:t1]
            # only the gathered rows are converted (fp64 included): [tb, K, D]
            gathered = ko.view(lambda x, r=rows: fp8.select_rows(x, r.reshape(-1))).get(dtype)
            gathered = gathered.reshape(t1 - t0, topk, -1)
            qb = qo.view(lambda x, a=t0, b=t1: x[a:b]).get(dtype)
            s = torch.einsum("thd,tkd->thk", qb, gathered).mul_(scale)
            seen = valid[t0:t1, None, :]
            s.masked_fill_(~seen, float("-inf"))  # padded slots (read as row 0) must not leak
            mx[t0:t1] = s.amax(dim=-1)
            out[t0:t1], lse[t0:t1] = softmax_v(s, gathered[..., :dv], seen, 0, careful=True)
    return SparseResult(out, lse, mx)

