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


@dataclass(frozen=True)
class Operand:
    """A tensor as stored (bf16/fp16/fp8/fp32) with its dequantisation scale (a scalar, or
    per token broadcastable against `data`). The reference converts it block by block, so
    its memory stays near the inputs' own size even in fp64."""

    data: torch.Tensor
    scale: torch.Tensor | float = 1.0

    def view(self, fn) -> Operand:  # noqa: ANN001 - fn maps a tensor to a view of it
        per_element = isinstance(self.scale, torch.Tensor) and self.scale.dim() > 0
        return Operand(fn(self.data), fn(self.scale) if per_element else self.scale)

    def get(self, dtype: torch.dtype) -> torch.Tensor:
        """Dequantised in fp32 (fp8.dequantize's definition of the value), then in `dtype`."""
        # Layout is preserved (no .contiguous()): a transposed K view goes to the GEMM as a
        # transposed operand instead of being copied.
        if isinstance(self.scale, torch.Tensor) or self.scale != 1.0:
            return (self.data.float() * self.scale).to(dtype)
        return self.data.to(dtype)


def _operand(x: torch.Tensor | Operand) -> Operand:
    return x if isinstance(x, Operand) else Operand(x)


def attend(
    q: torch.Tensor | Operand,
    k: torch.Tensor | Operand,
    v: torch.Tensor | Operand,
    scale: float,
    causal: bool,
    soft_cap: float = 0.0,
    kv_mask: torch.Tensor | None = None,
    budget: int = SCORE_BLOCK_ELEMENTS,
    dtype: torch.dtype | None = None,
) -> Result:
    """Attention of one request in `dtype` (fp32 or fp64; default: q's dtype).

    q [Sq, H, D]; k [Sk, Hk, D], v [Sk, Hk, Dv] with Hk = H (MHA) or 1 (MQA, shared latent);
    each a tensor or an Operand (stored data + dequantisation scale, converted per block).
    Causal is bottom-right aligned: query i sees kv j <= Sk - Sq + i. soft_cap (> 0) applies
    cap * tanh(s / cap) to the scaled scores. kv_mask [Sq, Sk] (bool, True = visible) adds a
    per-query mask (sparse top-k).
    """
    q, k, v = _operand(q), _operand(k), _operand(v)
    dtype = dtype or q.data.dtype
    sq, h, d = q.data.shape
    sk, hk = k.data.shape[0], k.data.shape[1]
    dv = v.data.shape[-1]
    dev = q.data.device
    if sq == 0 or sk == 0:
        return Result(
            torch.zeros((sq, h, dv), dtype=dtype, device=dev),
            torch.full((sq, h), float("-inf"), dtype=dtype, device=dev),
        )
    if hk == 1:
        # MQA (the absorbed latent): every (query, head) row shares K/V, so fold heads into
        # the rows: one [rows, D] x [D, Sk] GEMM per block instead of H matrix-vector products.
        # Rows are ordered (query, head), so row r is query position r // H.
        qg = q.view(lambda x: x.reshape(1, sq * h, x.shape[-1]))
        pos = torch.arange(sq * h, device=dev) // h
    else:
        qg = q.view(lambda x: x.permute(1, 0, 2))  # [H, Sq, D]
        pos = torch.arange(sq, device=dev)
    kt = k.view(lambda x: x.permute(1, 2, 0))  # [Hk, D, Sk]
    vt = v.view(lambda x: x.permute(1, 0, 2))  # [Hk, Sk, Dv]
    og, lg = _attend_groups(qg, kt, vt, pos, sk - sq, scale, causal, soft_cap, kv_mask, budget,
                            dtype)
    if hk == 1:
        return Result(og.reshape(sq, h, dv), lg.reshape(sq, h))
    return Result(og.permute(1, 0, 2), lg.permute(1, 0))


def _attend_groups(
    qg: Operand, kt: Operand, vt: Operand, pos: torch.Tensor, offset: int, scale: float,
    causal: bool, soft_cap: float, kv_mask: torch.Tensor | None, budget: int, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qg [G, R, D] rows at query positions pos [R]; kt [G or 1, D, Sk]; vt [G or 1, Sk, Dv].

    Groups are converted (dequantised) a block at a time and blocks of groups x rows keep
    the score block under `budget` elements; with causal masking a row block reads only the
    kv prefix its last row can see and masks only the columns some of its rows cannot see.
    Softmax pieces are computed in place (max, exp, sum): few passes over the score block.
    """
    g, r, d = qg.data.shape
    sk, dv = kt.data.shape[-1], vt.data.shape[-1]
    shared = kt.data.shape[0] == 1
    dev = qg.data.device
    out = torch.empty((g, r, dv), dtype=dtype, device=dev)
    lse = torch.empty((g, r), dtype=dtype, device=dev)
    per_group = r * d + (0 if shared else sk * (d + dv))  # converted operand elements / group
    gb = max(1, min(g, budget // max(1, sk), budget // max(1, per_group)))
    rb = max(1, min(r, budget // max(1, gb * sk)))
    pos_list = pos.tolist()
    with exact_matmuls():
        kh_all = kt.get(dtype) if shared else None
        vh_all = vt.get(dtype) if shared else None
        v_finite = bool(torch.isfinite(vh_all).all()) if shared else True
        for g0 in range(0, g, gb):
            g1 = min(g, g0 + gb)
            qh = qg.view(lambda x, a=g0, b=g1: x[a:b]).get(dtype)
            if shared:
                kh, vh = kh_all, vh_all
            else:
                kh = kt.view(lambda x, a=g0, b=g1: x[a:b]).get(dtype)
                vh = vt.view(lambda x, a=g0, b=g1: x[a:b]).get(dtype)
                v_finite = bool(torch.isfinite(vh).all())  # else the NaN-localising p @ v
            for r0 in range(0, r, rb):
                r1 = min(r, r0 + rb)
                end = min(sk, offset + pos_list[r1 - 1] + 1) if causal else sk
                if end <= 0:
                    out[g0:g1, r0:r1] = 0
                    lse[g0:g1, r0:r1] = float("-inf")
                    continue
                qb = qh[:, r0:r1]
                kb = kh[..., :end].expand(qb.shape[0], -1, -1)
                # scores = scale * q k^T, the scale applied in the GEMM epilogue (one pass less)
                s = torch.baddbmm(qb.new_empty(()), qb, kb, beta=0.0, alpha=scale)  # [gb, rb, end]
                if soft_cap > 0:
                    s.div_(soft_cap).tanh_().mul_(soft_cap)
                # columns before c0 are visible to every row of the block
                c0 = max(0, min(end, offset + pos_list[r0] + 1)) if causal and kv_mask is None else 0
                visible = _visible(pos[r0:r1], c0, end, offset, causal, kv_mask)
                if visible is not None:
                    s[..., c0:end].masked_fill_(~visible, float("-inf"))
                m = s.amax(dim=-1, keepdim=True)  # [gb, rb, 1]; NaN inputs keep NaN
                # rows that see nothing (m = -inf) get p = 0 and LSE -inf
                s.sub_(m.masked_fill(torch.isneginf(m), 0.0)).exp_()
                l = s.sum(dim=-1, keepdim=True)
                vb = vh[:, :end]
                if v_finite:
                    o = torch.matmul(s, vb)
                else:
                    seen = None if visible is None else torch.nn.functional.pad(visible, (c0, 0), value=True)
                    o = _apply_v(s, vb, seen)
                out[g0:g1, r0:r1] = o.div_(l.clamp_min(torch.finfo(dtype).tiny))
                lse[g0:g1, r0:r1] = (m + torch.log(l)).squeeze(-1)
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
    pos: torch.Tensor, c0: int, end: int, offset: int, causal: bool, kv_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """[rows, end - c0] visibility of kv positions c0..end-1 for rows at query positions pos."""
    vis = None
    if causal and end > c0:
        kj = torch.arange(c0, end, device=pos.device)[None, :]
        vis = kj <= pos[:, None] + offset
    if kv_mask is not None:
        m = kv_mask.to(pos.device)[pos, c0:end]
        vis = m if vis is None else vis & m
    return vis
