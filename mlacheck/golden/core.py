"""Blocked exact-softmax attention in FP32/FP64: the one piece of math every reference uses.

Queries and heads are processed in blocks whose score matrix stays under a fixed element
budget, and with causal masking each query block only touches the kv prefix it can see;
within a block the softmax is exact (no online rescaling), so the reference has no
accumulation-order error beyond the matmuls themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# Largest score block materialised at once (elements): 2^27 fp32 = 512 MiB. A 16k-token x
# 128-head prefill or a 128k-context decode then runs in bounded memory on CPU and GPU.
SCORE_BLOCK_ELEMENTS = 1 << 27


@dataclass
class Result:
    out: torch.Tensor  # [Tq, H, Dv]
    lse: torch.Tensor  # [Tq, H], natural log; -inf for rows that see no key


@contextlib.contextmanager
def exact_matmuls() -> Iterator[None]:
    """TF32/XF32 off (full fp32 matmuls) inside the reference; restore afterwards."""
    prev = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev[:2]
        torch.set_float32_matmul_precision(prev[2])


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    soft_cap: float = 0.0,
    kv_mask: torch.Tensor | None = None,
    budget: int = SCORE_BLOCK_ELEMENTS,
) -> Result:
    """Attention of one request in the dtype of q (fp32 or fp64).

    q [Sq, H, D]; k [Sk, Hk, D], v [Sk, Hk, Dv] with Hk = H (MHA) or 1 (MQA, shared latent).
    Causal is bottom-right aligned: query i sees kv j <= Sk - Sq + i. soft_cap (> 0) applies
    cap * tanh(s / cap) to the scaled scores. kv_mask [Sq, Sk] (bool, True = visible) adds a
    per-query mask (sparse top-k).
    """
    sq, h, _ = q.shape
    sk, hk = k.shape[0], k.shape[1]
    dv = v.shape[-1]
    out = torch.zeros((sq, h, dv), dtype=q.dtype, device=q.device)
    lse = torch.full((sq, h), float("-inf"), dtype=q.dtype, device=q.device)
    if sq == 0 or sk == 0:
        return Result(out, lse)
    kt = k.permute(1, 2, 0)  # [Hk, D, Sk]
    vt = v.permute(1, 0, 2)  # [Hk, Sk, Dv]
    if hk == 1:
        kt, vt = kt.contiguous(), vt.contiguous()
    offset = sk - sq
    v_finite = bool(torch.isfinite(v).all())  # else take the slower NaN-localising p @ v
    # heads per block, then queries per block, so that hb * qb * Sk <= budget
    hb = max(1, min(h, budget // max(1, sk)))
    qb = max(1, min(sq, budget // max(1, hb * sk)))
    with exact_matmuls():
        for h0 in range(0, h, hb):
            h1 = min(h, h0 + hb)
            kh = kt if hk == 1 else kt[h0:h1]
            vh = vt if hk == 1 else vt[h0:h1]
            for q0 in range(0, sq, qb):
                q1 = min(sq, q0 + qb)
                end = min(sk, offset + q1) if causal else sk
                if end <= 0:
                    continue
                qh = q[q0:q1, h0:h1].permute(1, 0, 2)  # [hb, qb, D]
                s = torch.matmul(qh, kh[..., :end]) * scale  # [hb, qb, end]
                if soft_cap > 0:
                    s = soft_cap * torch.tanh(s / soft_cap)
                visible = _visible(q0, q1, end, offset, causal, kv_mask, q.device)
                if visible is not None:
                    s = s.masked_fill(~visible, float("-inf"))
                m = torch.logsumexp(s, dim=-1, keepdim=True)  # [hb, qb, 1]
                # rows that see nothing (m = -inf) get p = 0; a NaN input stays NaN (must show)
                p = torch.exp(s - m.masked_fill(torch.isneginf(m), 0.0))
                vb = vh[:, :end]
                o = torch.matmul(p, vb) if v_finite else _apply_v(p, vb, visible)  # [hb, qb, Dv]
                out[q0:q1, h0:h1] = o.permute(1, 0, 2)
                lse[q0:q1, h0:h1] = m.squeeze(-1).permute(1, 0)
    return Result(out, lse)


def _apply_v(p: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
    """p @ v, where a non-finite V value only reaches the rows that see its position (NaN
    there): a plain matmul would leak it (0 * NaN) into masked rows, depending on blocking."""
    bad = ~torch.isfinite(v)
    if not bool(bad.any()):
        return torch.matmul(p, v)
    seen_f = torch.ones_like(p) if seen is None else seen.expand_as(p).to(p.dtype)
    hit = torch.matmul(seen_f, bad.to(p.dtype)) > 0
    return torch.matmul(p, v.masked_fill(bad, 0.0)).masked_fill(hit, float("nan"))


def _visible(
    q0: int, q1: int, end: int, offset: int, causal: bool, kv_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    vis = None
    if causal:
        qi = torch.arange(q0, q1, device=device)[:, None]
        kj = torch.arange(end, device=device)[None, :]
        vis = kj <= qi + offset
    if kv_mask is not None:
        m = kv_mask[q0:q1, :end].to(device)
        vis = m if vis is None else vis & m
    return vis
