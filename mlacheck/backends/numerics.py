"""Attention computed as a kernel computes it, at the kernel's precision: the numerics shared
by the `torch` backend (the judge's same-precision baseline), the AITER model and the planted
faults.

Scores in fp32 from the stored (bf16/fp16/fp8) inputs — products of such values are exact in
fp32, so this *is* a bf16/fp8 matmul with fp32 accumulation — an online softmax over kv
blocks, P rounded to the kernel's P format before the PV product, fp32 accumulation. A
`Numerics` varies accumulation order and structure without changing precision (`kv_block`,
`splits` merged by LSE as persistent decode does, `reverse` block order), or plants a
narrow accumulator (`acc_format`). Independent of mlacheck.golden's softmax (the golden
reuses only its exact-matmul helper's contract, not this code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import fp8
from mlacheck.golden.core import exact_matmuls

# Online-softmax tile a typical MLA kernel uses along kv (AITER/FlashMLA use 64).
DEFAULT_KV_BLOCK = 64
_LN2 = 0.6931471805599453


@dataclass(frozen=True)
class Numerics:
    kv_block: int = DEFAULT_KV_BLOCK
    splits: int = 1
    reverse: bool = False
    p_format: str | None = None  # None: the kv format (bf16 -> bf16 P, fp8 -> fp8 P)
    # Format the running output (P.V accumulator) is kept in between kv blocks: fp32 in every
    # correct kernel; "bf16" is the narrow-accumulation bug (fault:narrow-accumulation).
    acc_format: str = "fp32"
    # Where P is rounded to the P format, two correct kernel families besides the default
    # (P = exp(s - running max), the row's largest P exactly 1):
    # p_normalised: P / l rounded (the normaliser known first: two-pass and split kernels
    # that normalise before the PV product); the largest weight is rounded too.
    p_normalised: bool = False
    # lazy_rescale: the running max moves only when a tile's max passes it by more than
    # this many powers of two (FlashAttention-4 uses 8 with 16-bit P): P = exp(s - stale max)
    # reaches 2^lazy_rescale, and rescales of the accumulator are rare. 0: eager (default).
    lazy_rescale: float = 0.0
    # peak_rounding: the weights the eager rounding puts at the running max's value (P
    # rounded to 1: the max itself, exact, and any weight tied with it to within half a
    # rounding step, off by its distance to 1 at most) at their exact value times (1 + this
    # many unit roundoffs of the P format): as badly as a kernel that scales P otherwise
    # before rounding it (P / l, a stale max) can round them, and in the same direction
    # (near-equal values round alike). Not a kernel: the baseline the judge derives each FP8
    # row's allowance for that rounding from (mlacheck.harness.baselines,
    # tolerances.PEAK_ROUNDOFFS). 0: off.
    peak_rounding: float = 0.0
    # Precision lost in PART of the accumulation (fp32 everywhere in a correct kernel; the
    # faults of mlacheck/backends/faults/precision.py set one): the P.V product of every
    # `tile_every`-th kv tile (the last of each group) kept in `pv_tile_format` before it
    # joins the fp32 accumulator; the scores of those tiles in `score_tile_format`; the RoPE
    # part of every score (q_pe . k_pe, the last `rope_dims` of q and k) in
    # `rope_score_format`; the split partials' LSEs in `partial_lse_format` before the merge.
    pv_tile_format: str | None = None
    score_tile_format: str | None = None
    tile_every: int = 2
    rope_score_format: str | None = None
    rope_dims: int = 64
    partial_lse_format: str | None = None


DEFAULT_NUMERICS = Numerics()  # what a correct kernel does: fp32 accumulation, 64-key tiles


def p_format_for(kv_format: str, numerics: Numerics) -> str:
    return numerics.p_format or kv_format


def flash_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    p_format: str,
    numerics: Numerics = Numerics(),
    soft_cap: float = 0.0,
    kv_valid: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request, kernel-style. q [Sq,H,D] fp32 (values of the stored format), k [Sk,Hk,D],
    v [Sk,Hk,Dv]; returns (out fp32 [Sq,H,Dv], lse [Sq,H]). Causal is bottom-right unless
    q_positions (absolute kv position of each query) is given. kv_valid [Sk] masks keys
    (or [H, Sk]: per head, for independent problems batched along H)."""
    sq, h, _ = q.shape
    sk = k.shape[0]
    if q_positions is None:
        q_positions = torch.arange(sq, device=q.device) + (sk - sq)
    bounds = split_bounds(sk, numerics.splits)
    outs, lses = [], []
    with exact_matmuls():
        for lo, hi in bounds:
            o, lse = _online(q, k, v, lo, hi, scale, causal, p_format, numerics, soft_cap,
                             kv_valid, q_positions)
            outs.append(o)
            lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    stacked = torch.stack(lses)
    if numerics.partial_lse_format:
        stacked = fp8.round_trip(stacked, numerics.partial_lse_format)
    return merge_partials(torch.stack(outs), stacked)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce per-split normalised partials: lse* = logsumexp(lse_k), o = sum exp(lse_k - lse*) o_k.

    outs [S, ..., Dv], lses [S, ...]; splits that saw no key (lse -inf) contribute nothing.
    """
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - lse.unsqueeze(0))
    w = torch.nan_to_num(w, nan=0.0)
    return (w.unsqueeze(-1) * torch.nan_to_num(outs, nan=0.0)).sum(0), lse


def split_bounds(sk: int, splits: int) -> list[tuple[int, int]]:
    n = max(1, min(splits, sk))
    edges = [round(i * sk / n) for i in range(n + 1)]
    return [(edges[i], edges[i + 1]) for i in range(n)]


# Elements of one score block in the vectorised pass (fp32; a few temporaries of this size
# live at once): query rows are taken in chunks so each stays ~32 MB (8 workers share a GPU).
_BLOCK_ELEMENTS = 1 << 23


def _online(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int, scale: float,
    causal: bool, p_format: str, nm: Numerics, soft_cap: float, kv_valid: torch.Tensor | None,
    q_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    # a narrow accumulator is rounded tile by tile, a lazy max moves tile by tile: sequential
    if nm.acc_format != "fp32" or nm.lazy_rescale:
        return _online_sequential(q, k, v, lo, hi, scale, causal, p_format, nm, soft_cap,
                                  kv_valid, q_positions)
    sq, h, _ = q.shape
    n = hi - lo
    tiles = max(1, -(-n // nm.kv_block))
    width = max(nm.kv_block, v.shape[-1]) if nm.pv_tile_format else nm.kv_block
    rows = max(1, _BLOCK_ELEMENTS // max(1, h * tiles * width))
    outs, lses = [], []
    for r0 in range(0, max(sq, 1), rows):  # an empty query block still gets its shapes
        r1 = min(sq, r0 + rows)
        o, lse = _online_tiles(q[r0:r1], k, v, lo, hi, scale, causal, p_format, nm, soft_cap,
                               kv_valid, q_positions[r0:r1])
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def _online_tiles(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int, scale: float,
    causal: bool, p_format: str, nm: Numerics, soft_cap: float, kv_valid: torch.Tensor | None,
    q_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax of _online_sequential, every kv tile at once.

    The running max after tile t is a cumulative max over the tiles' maxima, so P (formed
    against the running max, then rounded to p_format) has exactly the bits the tile loop
    gives it; the rescaled sums sum_t exp(m_t - m_last) (P_t V_t) and the normaliser are
    the same quantities in exact arithmetic and differ from the loop by fp32 reassociation
    only. Hundreds of kernel launches per request become a few dozen."""
    sq, h, _ = q.shape
    n = hi - lo
    blk = nm.kv_block
    tiles = max(1, -(-n // blk))
    pad = tiles * blk - n
    s = _scores(q.permute(1, 0, 2), k, lo, hi, scale, soft_cap, causal, kv_valid, q_positions,
                nm)
    if pad:
        s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
    st = s.view(h, sq, tiles, blk)
    narrow = _narrow_tiles(tiles, nm, s.device)
    if nm.score_tile_format and narrow.any():
        st = st.clone()
        st[:, :, narrow] = fp8.round_trip(st[:, :, narrow], nm.score_tile_format)
    tile_max = st.amax(-1)  # [H, Sq, T]
    if nm.reverse:  # tiles visited last to first: the running max accumulates from the end
        run_max = tile_max.flip(-1).cummax(-1).values.flip(-1)
        last_max = run_max[..., :1]
    else:
        run_max = tile_max.cummax(-1).values
        last_max = run_max[..., -1:]
    m_safe = torch.where(torch.isinf(run_max), torch.zeros_like(run_max), run_max)
    p = torch.exp(st - m_safe.unsqueeze(-1))  # [H, Sq, T, blk]
    last_safe = torch.where(torch.isinf(last_max), torch.zeros_like(last_max), last_max)
    w = torch.exp(m_safe - last_safe)  # each tile's rescaling up to the last running max
    l = (p.sum(-1) * w).sum(-1, keepdim=True)  # [H, Sq, 1]
    if nm.p_normalised:  # the weights P / l themselves rounded, then summed: already normalised
        pn = (p * (w / l.clamp_min(torch.finfo(p.dtype).tiny)).unsqueeze(-1))
        p_r = (fp8.round_trip(pn, p_format) if p_format != "fp32" else pn).view(h, sq,
                                                                                  tiles * blk)
        vv = v[lo:hi].permute(1, 0, 2)
        if pad:
            vv = torch.nn.functional.pad(vv, (0, 0, 0, pad))
        o, lse = _normalised(torch.matmul(p_r, vv), torch.ones_like(l), last_max)
        return o, lse + torch.log(l).squeeze(-1).permute(1, 0)
    p_r = _peak_rounded(p, fp8.round_trip(p, p_format) if p_format != "fp32" else p,
                        p_format, nm)
    vv = v[lo:hi].permute(1, 0, 2)  # [Hk, n, Dv]
    if pad:
        vv = torch.nn.functional.pad(vv, (0, 0, 0, pad))
    if nm.pv_tile_format:  # each tile's product on its own, some kept narrow
        prod = torch.matmul(p_r.permute(0, 2, 1, 3), vv.reshape(vv.shape[0], tiles, blk, -1))
        prod[:, narrow] = fp8.round_trip(prod[:, narrow], nm.pv_tile_format)  # [H, T, Sq, Dv]
        return _normalised((prod * w.permute(0, 2, 1).unsqueeze(-1)).sum(1), l, last_max)
    p_r = (p_r * w.unsqueeze(-1)).view(h, sq, tiles * blk)
    return _normalised(torch.matmul(p_r, vv), l, last_max)


def _peak_rounded(p: torch.Tensor, p_r: torch.Tensor, p_format: str, nm: Numerics
                  ) -> torch.Tensor:
    """p_r with the weights it rounds to the running max's value (p_r == 1: p == 1 and its
    near ties) at p times (1 + nm.peak_rounding unit roundoffs of the P format)."""
    if not nm.peak_rounding or p_format == "fp32":
        return p_r
    return torch.where(p_r == 1, p * (1 + nm.peak_rounding * fp8.fmt(p_format).eps), p_r)


def _narrow_tiles(tiles: int, nm: Numerics, device: torch.device) -> torch.Tensor:
    """Which kv tiles a partial-precision fault narrows: the last of every nm.tile_every."""
    return torch.arange(tiles, device=device) % nm.tile_every == nm.tile_every - 1


def _online_sequential(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int, scale: float,
    causal: bool, p_format: str, nm: Numerics, soft_cap: float, kv_valid: torch.Tensor | None,
    q_positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    sq, h, _ = q.shape
    dv = v.shape[-1]
    qh = q.permute(1, 0, 2)  # [H, Sq, D]
    m = torch.full((h, sq, 1), float("-inf"), device=q.device)
    l = torch.zeros((h, sq, 1), device=q.device)
    acc = torch.zeros((h, sq, dv), device=q.device)
    starts = list(range(lo, hi, nm.kv_block))
    if nm.reverse:
        starts.reverse()
    for b0 in starts:
        b1 = min(hi, b0 + nm.kv_block)
        vb = v[b0:b1].permute(1, 0, 2)  # [Hk, n, Dv]
        s = _scores(qh, k, b0, b1, scale, soft_cap, causal, kv_valid, q_positions, nm)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        if nm.lazy_rescale:  # keep the stale max unless the new one passes it by the threshold
            m_new = torch.where(m_new > m + nm.lazy_rescale * _LN2, m_new, m)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        l = l * alpha + p.sum(-1, keepdim=True)
        p_r = _peak_rounded(p, fp8.round_trip(p, p_format) if p_format != "fp32" else p,
                            p_format, nm)
        acc = acc * alpha + torch.matmul(p_r, vb)
        if nm.acc_format != "fp32":
            acc = fp8.round_trip(acc, nm.acc_format)
        m = m_new
    return _normalised(acc, l, m)


def _scores(qh: torch.Tensor, k: torch.Tensor, b0: int, b1: int, scale: float,
            soft_cap: float, causal: bool, kv_valid: torch.Tensor | None,
            q_positions: torch.Tensor, nm: Numerics = DEFAULT_NUMERICS) -> torch.Tensor:
    """Scaled (soft-capped) scores of keys b0..b1 [H, Sq, n], -inf where a row cannot see."""
    kt = k[b0:b1].permute(1, 2, 0)  # [Hk, D, n]
    if nm.rope_score_format:  # the RoPE part's product kept narrow, the rest fp32
        r = nm.rope_dims
        rope = fp8.round_trip(torch.matmul(qh[..., -r:], kt[:, -r:]), nm.rope_score_format)
        s = (torch.matmul(qh[..., :-r], kt[:, :-r]) + rope) * scale
    else:
        s = torch.matmul(qh, kt) * scale
    if soft_cap > 0:
        s = soft_cap * torch.tanh(s / soft_cap)
    vis = torch.ones((qh.shape[1], b1 - b0), dtype=torch.bool, device=qh.device)
    if causal:
        vis &= torch.arange(b0, b1, device=qh.device)[None, :] <= q_positions[:, None]
    if kv_valid is not None and kv_valid.dim() == 1:
        vis &= kv_valid[b0:b1][None, :]
    s = s.masked_fill(~vis, float("-inf"))
    if kv_valid is not None and kv_valid.dim() == 2:  # [H, Sk]: a mask per head
        s = s.masked_fill(~kv_valid[:, None, b0:b1], float("-inf"))
    return s


def _normalised(acc: torch.Tensor, l: torch.Tensor, m: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Sq, H, Dv], lse [Sq, H]) from the accumulator, normaliser and running max
    [H, Sq, ...]; a row that saw no key gets 0 and -inf."""
    out = acc / l
    lse = (m + torch.log(l)).squeeze(-1)
    empty = l.squeeze(-1) == 0
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
    return out.permute(1, 0, 2), lse.permute(1, 0)
