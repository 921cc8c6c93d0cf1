"""Blocked exact-softmax attention in FP32/FP64: the one piece of math every reference uses.

Queries and heads are processed in blocks whose score matrix stays under a fixed element
budget, and with causal masking each query block only touches the kv prefix it can see;
within a block the softmax is exact (no online rescaling), so the reference has no
accumulation-order error beyond the matmuls themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mlacheck.footprint import SCORE_BLOCK_BYTES


def score_block_elements(dtype: torch.dtype) -> int:
    return SCORE_BLOCK_BYTES // torch.empty((), dtype=dtype).element_size()


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
        """Dequantised in `dtype`: stored value x scale computed in `dtype` itself, so the fp64
        reference is exact (an FP8 value times an amax scale needs up to 28 mantissa bits: in
        fp32 the product rounds); in fp32 it is fp8.dequantize's value."""
        # Layout is preserved (no .contiguous()): a transposed K view goes to the GEMM as a
        # transposed operand instead of being copied.
        if isinstance(self.scale, torch.Tensor):
            return self.data.to(dtype) * self.scale.to(dtype)
        if self.scale != 1.0:
            return self.data.to(dtype) * self.scale
        return self.data.to(dtype)


def per_tensor(scale: torch.Tensor | float) -> torch.Tensor | float:
    """A per-tensor scale as a Python float, read once per reference: a unit scale then costs
    no multiply pass, and no block waits on the device to read it. Per-token scales stay."""
    if isinstance(scale, torch.Tensor) and scale.dim() == 0:
        return float(scale)
    return scale


def _operand(x: torch.Tensor | Operand) -> Operand:
    return x if isinstance(x, Operand) else Operand(x)


# The LSE without a max pass (see softmax_v): lse = s_a - log(p_a) at an anchor column a,
# the largest score among the first ANCHOR_COLUMNS of the row (a short contiguous read).
ANCHOR_COLUMNS = 512
# Exact in any column; in floating point p_a carries the rounding of (s_a - max), up to
# ulp(32) / 2 = 1.9e-6 in fp32 when p_a >= e^-32: 50x under tolerances.LSE_FLOOR. A row whose
# anchor is further below its max makes the careful pass (the true max) redo the request.
ANCHOR_MIN_P = 1.2664165549094176e-14  # e^-32


def attend(
    q: torch.Tensor | Operand,
    k: torch.Tensor | Operand,
    v: torch.Tensor | Operand | int,
    scale: float,
    causal: bool,
    soft_cap: float = 0.0,
    budget: int | None = None,
    dtype: torch.dtype | None = None,
) -> Result:
    """Attention of one request in `dtype` (fp32 or fp64; default: q's dtype).

    q [Sq, H, D]; k [Sk, Hk, D], v [Sk, Hk, Dv] with Hk = H (MHA) or 1 (MQA, shared latent);
    each a tensor or an Operand (stored data + dequantisation scale, converted per block).
    v as an int Dv: V is K's first Dv channels (MLA's absorbed latent), converted once.
    Causal is bottom-right aligned: query i sees kv j <= Sk - Sq + i. soft_cap (> 0) applies
    cap * tanh(s / cap) to the scaled scores. budget: score elements per block (default:
    SCORE_BLOCK_BYTES worth).
    """
    return attend_each([(q, k, v)], scale, causal, soft_cap, budget, dtype)[0]


Request = tuple[torch.Tensor | Operand, torch.Tensor | Operand, torch.Tensor | Operand | int]


def attend_each(
    requests: list[Request | Callable[[], Request]], scale: float, causal: bool,
    soft_cap: float = 0.0, budget: int | None = None, dtype: torch.dtype | None = None,
) -> list[Result]:
    """attend() over independent requests (q, k, v) that share the settings; a request may be
    a function that builds it (e.g. gathers its KV), so only one is held at a time.

    A fast pass computes every request without waiting on the device; one check at the end
    sends any request whose fast result cannot be trusted as is (a non-finite value, a row
    that sees no key, an LSE anchor far below the row max) through the careful pass, which
    finds the row max and handles NaN placement exactly.
    """
    def build(req: Request | Callable[[], Request]) -> Request:
        return req() if callable(req) else req

    fast = [_attend_one(*build(req), scale, causal, soft_cap, budget, dtype, careful=False)
            for req in requests]
    if not fast:
        return []
    trusted = torch.stack([ok for _, ok in fast]).tolist()  # the one host-device sync
    return [res if ok else
            _attend_one(*build(req), scale, causal, soft_cap, budget, dtype, careful=True)[0]
            for (res, _), ok, req in zip(fast, trusted, requests, strict=True)]


def concat(results: list[Result]) -> Result:
    """Requests' results in token order (no copy for a single request: its output can be
    the largest tensor the reference holds)."""
    if len(results) == 1:
        return results[0]
    return Result(torch.cat([r.out for r in results]), torch.cat([r.lse for r in results]))


def _attend_one(
    q: torch.Tensor | Operand, k: torch.Tensor | Operand, v: torch.Tensor | Operand | int,
    scale: float, causal: bool, soft_cap: float, budget: int | None, dtype: torch.dtype | None,
    careful: bool,
) -> tuple[Result, torch.Tensor]:
    q, k = _operand(q), _operand(k)
    dtype = dtype or q.data.dtype
    budget = budget or score_block_elements(dtype)
    sq, h, _ = q.data.shape
    sk, hk = k.data.shape[0], k.data.shape[1]
    if isinstance(v, int):
        dv = vt = v
    else:
        v = _operand(v)
        dv = v.data.shape[-1]
        vt = v.view(lambda x: x.permute(1, 0, 2))  # [Hk, Sk, Dv]
    dev = q.data.device
    ok = torch.ones((), dtype=torch.bool, device=dev)
    if sq == 0 or sk == 0:
        return Result(
            torch.zeros((sq, h, dv), dtype=dtype, device=dev),
            torch.full((sq, h), float("-inf"), dtype=dtype, device=dev),
        ), ok
    if hk == 1:
        # MQA (the absorbed latent): every (query, head) row shares K/V, so fold heads into
        # the rows: one [rows, D] x [D, Sk] GEMM per block instead of H matrix-vector products.
        # Rows are ordered (query, head), so row r is query position r // H.
        qg = q.view(lambda x: x.reshape(1, sq * h, x.shape[-1]))
        fold = h
    else:
        qg = q.view(lambda x: x.permute(1, 0, 2))  # [H, Sq, D]
        fold = 1
    kt = k.view(lambda x: x.permute(1, 2, 0))  # [Hk, D, Sk]
    og, lg = _attend_groups(qg, kt, vt, fold, sk - sq, scale, causal, soft_cap, budget, dtype,
                            careful, ok)
    if hk == 1:
        return Result(og.reshape(sq, h, dv), lg.reshape(sq, h)), ok
    return Result(og.permute(1, 0, 2), lg.permute(1, 0)), ok


def _attend_groups(
    qg: Operand, kt: Operand, vt: Operand | int, fold: int, offset: int, scale: float,
    causal: bool, soft_cap: float, budget: int, dtype: torch.dtype, careful: bool,
    ok: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qg [G, R, D] rows at query positions row // fold; kt [G or 1, D, Sk]; vt [G or 1, Sk,
    Dv], or an int Dv: V is K's first Dv channels (the absorbed latent). `ok` (a device bool)
    is cleared where the fast pass cannot be trusted.

    Groups are converted (dequantised) a block at a time and blocks of groups x rows keep
    the score block under `budget` elements; with causal masking a row block reads only the
    kv prefix its last row can see and masks only the columns some of its rows cannot see.
    """
    g, r, d = qg.data.shape
    sk = kt.data.shape[-1]
    dv = vt if isinstance(vt, int) else vt.data.shape[-1]
    shared = kt.data.shape[0] == 1
    dev = qg.data.device
    out = torch.empty((g, r, dv), dtype=dtype, device=dev)
    lse = torch.empty((g, r), dtype=dtype, device=dev)
    per_group = r * d + (0 if shared else sk * (d + dv))  # converted operand elements / group
    gb = max(1, min(g, budget // max(1, sk), budget // max(1, per_group)))
    rb = max(1, min(r, budget // max(1, gb * sk)))

    def convert(a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        kh = kt.view(lambda x: x[a:b]).get(dtype)
        if isinstance(vt, int):  # V = K's first channels: one conversion serves both
            return kh, kh.transpose(1, 2)[..., :vt]
        return kh, vt.view(lambda x: x[a:b]).get(dtype)

    with exact_matmuls():
        kv_shared = convert(0, 1) if shared else None
        for g0 in range(0, g, gb):
            g1 = min(g, g0 + gb)
            qh = qg.view(lambda x, a=g0, b=g1: x[a:b]).get(dtype)
            kh, vh = kv_shared or convert(g0, g1)
            for r0 in range(0, r, rb):
                r1 = min(r, r0 + rb)
                first, last = r0 // fold, (r1 - 1) // fold  # query positions of the block
                end = min(sk, offset + last + 1) if causal else sk
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
                visible = None
                c0 = max(0, min(end, offset + first + 1))  # columns before c0: seen by all rows
                if causal and c0 < end:
                    pos = torch.arange(r0, r1, device=dev)[:, None] // fold
                    visible = torch.arange(c0, end, device=dev)[None, :] <= pos + offset
                    s[..., c0:end].masked_fill_(~visible, float("-inf"))
                o, lse_b = softmax_v(s, vh[:, :end], visible, c0, careful, ok)
                out[g0:g1, r0:r1] = o
                lse[g0:g1, r0:r1] = lse_b
    return out, lse


def softmax_v(
    s: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, c0: int, careful: bool = True,
    ok: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(s) @ v and the LSE of the score block s [.., rows, end] (overwritten with P).

    Fast (careful=False): three passes over the block, the least an exact softmax allows: the
    GEMM writes it, one fused softmax in place, the GEMM with V reads it. The LSE needs no
    pass of its own: for any column a, p_a = exp(s_a - max) / l, so lse = max + log(l) =
    s_a - log(p_a); the anchor a is the largest of the row's first ANCHOR_COLUMNS scores.
    What the fast pass cannot answer exactly clears `ok` (the caller redoes the request):
    non-finite output (NaN scores, a row that sees nothing, non-finite V) or a small p_a.

    Careful: the true row max (an extra pass) and, with the device's answers, rows that see
    no key get output 0 and LSE -inf, NaN scores give NaN rows, and a non-finite V value
    reaches only the rows that see its position.
    """
    if careful:
        a, at = s.max(dim=-1, keepdim=True)
    else:
        a, at = s[..., :ANCHOR_COLUMNS].max(dim=-1, keepdim=True)
    _softmax_in_place(s)
    p_a = s.gather(-1, at)
    lse = (a - torch.log(p_a)).squeeze(-1)
    if careful:
        blind = torch.isneginf(a)  # softmax of an all -inf row is NaN: make it p = 0
        if bool(blind.any()):
            s.masked_fill_(blind, 0.0)
            lse.masked_fill_(blind.squeeze(-1), float("-inf"))
    o = torch.matmul(s, v)
    if not careful:
        assert ok is not None
        ok &= torch.isfinite(o).all() & (p_a >= ANCHOR_MIN_P).all()
    elif not bool(torch.isfinite(o).all()):
        # 0 x NaN: a non-finite V value at a masked position must not reach the row
        seen = None if visible is None else torch.nn.functional.pad(visible, (c0, 0), value=True)
        o = _apply_v(s, v, seen)
    return o, lse


def _softmax_in_place(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim written over its input: one read, one write, no second block.

    The out= form of aten's softmax reads each row before writing it (CPU and CUDA kernels),
    so aliasing input and output is safe for a contiguous block; tests compare it with
    torch.softmax on both devices.
    """
    if not s.is_contiguous():
        raise ValueError("in-place softmax needs a contiguous score block")
    return torch.ops.aten._softmax.out(s, -1, False, out=s)


def _apply_v(p: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
    """p @ v, where a non-finite V value only reaches the rows that see its position (NaN
    there): a plain matmul would leak it (0 * NaN) into masked rows, depending on blocking."""
    bad = ~torch.isfinite(v)
    if not bool(bad.any()):
        return torch.matmul(p, v)
    seen_f = torch.ones_like(p) if seen is None else seen.expand_as(p).to(p.dtype)
    hit = torch.matmul(seen_f, bad.to(p.dtype)) > 0
    return torch.matmul(p, v.masked_fill(bad, 0.0)).masked_fill(hit, float("nan"))
