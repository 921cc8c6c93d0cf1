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
    sq, h, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    dv = v.shape[-1]
    if sq == 0 or sk == 0:
        return Result(
            torch.zeros((sq, h, dv), dtype=q.dtype, device=q.device),
            torch.full((sq, h), float("-inf"), dtype=q.dtype, device=q.device),
        )
    if hk == 1:
        # MQA (the absorbed latent): every (query, head) row shares K/V, so fold heads into
        # the rows: one [rows, D] x [D, Sk] GEMM per block instead of H matrix-vector products.
        # Rows are ordered (query, head), so row r is query position r // H.
        qg = q.reshape(1, sq * h, d)
        pos = torch.arange(sq * h, device=q.device) // h
    else:
        qg = q.permute(1, 0, 2)  # [H, Sq, D]
        pos = torch.arange(sq, device=q.device)
    og, lg = _attend_groups(qg, k.permute(1, 2, 0), v.permute(1, 0, 2), pos, sk - sq, scale, causal,
                            soft_cap, kv_mask, budget)
    if hk == 1:
        return Result(og.reshape(sq, h, dv), lg.reshape(sq, h))
    return Result(og.permute(1, 0, 2), lg.permute(1, 0))


def _attend_groups(
    qg: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, pos: torch.Tensor, offset: int,
    scale: float, causal: bool, soft_cap: float, kv_mask: torch.Tensor | None, budget: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qg [G, R, D] rows at query positions pos [R]; kt [G or 1, D, Sk]; vt [G or 1, Sk, Dv].

    Blocks of groups x rows keep each score block under `budget` elements; with causal
    masking a row block only reads the kv prefix its last row can see.
    """
    g, r, _ = qg.shape
    sk, dv = kt.shape[-1], vt.shape[-1]
    shared = kt.shape[0] == 1
    if shared:
        kt, vt = kt.contiguous(), vt.contiguous()
    out = torch.zeros((g, r, dv), dtype=qg.dtype, device=qg.device)
    lse = torch.full((g, r), float("-inf"), dtype=qg.dtype, device=qg.device)
    v_finite = bool(torch.isfinite(vt).all())  # else take the slower NaN-localising p @ v
    gb = max(1, min(g, budget // max(1, sk)))
    rb = max(1, min(r, budget // max(1, gb * sk)))
    pos_list = pos.tolist()
    with exact_matmuls():
        for g0 in range(0, g, gb):
            g1 = min(g, g0 + gb)
            kh = kt if shared else kt[g0:g1]
            vh = vt if shared else vt[g0:g1]
            for r0 in range(0, r, rb):
                r1 = min(r, r0 + rb)
                end = min(sk, offset + pos_list[r1 - 1] + 1) if causal else sk
                if end <= 0:
                    continue
                s = torch.matmul(qg[g0:g1, r0:r1], kh[..., :end]) * scale  # [gb, rb, end]
                if soft_cap > 0:
                    s = soft_cap * torch.tanh(s / soft_cap)
                visible = _visible(pos[r0:r1], end, offset, causal, kv_mask)
                if visible is not None:
                    s = s.masked_fill(~visible, float("-inf"))
                m = torch.logsumexp(s, dim=-1, keepdim=True)  # [gb, rb, 1]
                # rows that see nothing (m = -inf) get p = 0; a NaN input stays NaN (must show)
                p = torch.exp(s - m.masked_fill(torch.isneginf(m), 0.0))
                vb = vh[:, :end]
                out[g0:g1, r0:r1] = torch.matmul(p, vb) if v_finite else _apply_v(p, vb, visible)
                lse[g0:g1, r0:r1] = m.squeeze(-1)
    return out, lse


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
    pos: torch.Tensor, end: int, offset: int, causal: bool, kv_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """[rows, end] visibility of kv positions for rows at query positions `pos`."""
    vis = None
    if causal:
        kj = torch.arange(end, device=pos.device)[None, :]
        vis = kj <= pos[:, None] + offset
    if kv_mask is not None:
        m = kv_mask.to(pos.device)[pos, :end]
        vis = m if vis is None else vis & m
    return vis
