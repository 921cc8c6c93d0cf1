"""Independent, deliberately naive FP64 versions of the sparse-pipeline references.

Written from the kernels' documented semantics (DeepGEMM's `ref_fp8_mqa_logits` /
`ref_paged_mqa_logits`, FlashMLA's `ref_sparse_attn_fwd`, vLLM's index conversion), sharing
no code with mlacheck: Python loops over rows, heads and positions, explicit conditions.
"""

from __future__ import annotations

import math

import torch


def naive_logit(q: torch.Tensor, qs: torch.Tensor, k: torch.Tensor, ks: float,
                w: torch.Tensor) -> tuple[float, float]:
    """One (row, position): q [H, D] stored, qs [H], k [D] stored, ks, w [H] ->
    (logit, magnitude)."""
    total, mag = 0.0, 0.0
    for h in range(q.shape[0]):
        qd = [float(x) * float(qs[h]) for x in q[h].double()]
        kd = [float(x) * ks for x in k.double()]
        dot = math.fsum(a * b for a, b in zip(qd, kd, strict=True))
        total += float(w[h]) * max(dot, 0.0)
        mag += abs(float(w[h])) * math.fsum(abs(a * b) for a, b in zip(qd, kd, strict=True))
    return total, mag


def naive_mqa_logits(q, qs, k, kscale, w, starts, ends, width):  # noqa: ANN001, ANN201
    rows = q.shape[0]
    out = torch.full((rows, width), float("-inf"), dtype=torch.float64)
    mag = torch.zeros((rows, width), dtype=torch.float64)
    for t in range(rows):
        for s in range(max(0, int(starts[t])), min(int(ends[t]), k.shape[0], width)):
            out[t, s], mag[t, s] = naive_logit(q[t], qs[t], k[s], float(kscale[s]), w[t])
    return out, mag


def naive_sparse_row(q: torch.Tensor, kv: torch.Tensor, idx: list[int], scale: float, dv: int
                     ) -> tuple[torch.Tensor, float, float]:
    """One (token, head) of sparse MLA: q [D], kv [N, D], idx the token's indices."""
    scores, rows = [], []
    for i in idx:
        if 0 <= i < kv.shape[0]:
            scores.append(float(torch.dot(q.double(), kv[i].double())) * scale)
            rows.append(i)
    if not scores:
        return torch.zeros(dv, dtype=torch.float64), float("-inf"), float("-inf")
    m = max(scores)
    e = [math.exp(s - m) for s in scores]
    z = math.fsum(e)
    out = torch.zeros(dv, dtype=torch.float64)
    for wgt, i in zip(e, rows, strict=True):
        out += (wgt / z) * kv[i, :dv].double()
    return out, m + math.log(z), m


def naive_global_slots(local, token_request, block_table, page_size, kv_lens):  # noqa: ANN001, ANN201
    out = torch.full(local.shape, -1, dtype=torch.int64)
    for t in range(local.shape[0]):
        b = int(token_request[t])
        for i in range(local.shape[1]):
            p = int(local[t, i])
            if 0 <= p < int(kv_lens[b]):
                out[t, i] = int(block_table[b, p // page_size]) * page_size + p % page_size
    return out
