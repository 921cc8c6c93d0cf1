"""An independent, deliberately naive FP64 attention used to check the golden layer.

Written from the MLA conventions (softmax scale, absorbed latent attention, v = the first
512 latent channels), sharing no code with mlacheck.golden: one Python loop per query token and head, scores as explicit dot products, the mask as an explicit
per-position condition and the softmax / natural-log LSE by hand (max-shifted sums).
"""

from __future__ import annotations

import math

import torch


def naive_row(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, soft_cap: float,
    visible: list[bool],
) -> tuple[torch.Tensor, float]:
    """One (token, head): q [D], keys [S, D], values [S, Dv], visible[j] says if j is seen."""
    q = q.double()
    scores: list[float] = []
    seen: list[int] = []
    for j, ok in enumerate(visible):
        if not ok:
            continue
        s = float(torch.dot(q, keys[j].double())) * scale
        if soft_cap > 0:
            s = soft_cap * math.tanh(s / soft_cap)
        scores.append(s)
        seen.append(j)
    dv = values.shape[-1]
    if not scores:
        return torch.zeros(dv, dtype=torch.float64), float("-inf")
    m = max(scores)
    weights = [math.exp(s - m) for s in scores]
    total = math.fsum(weights)
    out = torch.zeros(dv, dtype=torch.float64)
    for w, j in zip(weights, seen, strict=True):
        out += (w / total) * values[j].double()
    return out, m + math.log(total)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
    soft_cap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Sq, H, D]; k [Sk, Hk, D]; v [Sk, Hk, Dv] (Hk = H or 1). Bottom-right causal mask:
    query i sees j <= Sk - Sq + i. Returns out [Sq, H, Dv] and natural-log lse [Sq, H]."""
    sq, h, _ = q.shape
    sk, hk = k.shape[0], k.shape[1]
    out = torch.zeros((sq, h, v.shape[-1]), dtype=torch.float64)
    lse = torch.zeros((sq, h), dtype=torch.float64)
    for i in range(sq):
        visible = [(not causal) or j <= sk - sq + i for j in range(sk)]
        for hh in range(h):
            kh = 0 if hk == 1 else hh
            out[i, hh], lse[i, hh] = naive_row(
                q[i, hh], k[:, kh], v[:, kh], scale, soft_cap, visible
            )
    return out, lse


def naive_sparse(
    q: torch.Tensor, kv: torch.Tensor, rank: int, positions: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sparse-decode token: q [H, 576] over the kv rows `positions` (-1 = padding) of
    its request's latent kv [S, 1, 576]; V = the first `rank` columns."""
    h = q.shape[0]
    rows = [p for p in positions if p >= 0]
    keys = kv[rows, 0] if rows else kv[:0, 0]
    out = torch.zeros((h, rank), dtype=torch.float64)
    lse = torch.zeros(h, dtype=torch.float64)
    for hh in range(h):
        out[hh], lse[hh] = naive_row(
            q[hh], keys, keys[:, :rank], scale, 0.0, [True] * len(rows)
        )
    return out, lse
