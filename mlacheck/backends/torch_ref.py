"""`torch`: a same-precision PyTorch implementation of every op.

It computes as an attention kernel does: scores in fp32 from the stored (bf16/fp16/fp8)
inputs — products of such values are exact in fp32, so this *is* a bf16/fp8 matmul with
fp32 accumulation — an online softmax over kv blocks, P rounded to the kernel's P format
before the PV product, fp32 accumulation, and the output rounded to its dtype. It is both a
backend under test and the *baseline* of the FlashAttention rule in the judge.

Variants change accumulation order and structure without changing precision, so they are
correct implementations that differ from the baseline (the false-alarm check needs those):
`kv_block` (online-softmax tile), `splits` (KV split into chunks, each normalised with its
LSE and merged, as persistent decode does) and `reverse` (blocks visited last to first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import fp8
from mlacheck.backends.base import Capability, Output
from mlacheck.golden.core import exact_matmuls
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs
from mlacheck.spec import Case, PrefillCase, SparseDecodeCase

# Online-softmax tile a typical MLA kernel uses along kv (AITER/FlashMLA use 64).
DEFAULT_KV_BLOCK = 64


@dataclass(frozen=True)
class Numerics:
    kv_block: int = DEFAULT_KV_BLOCK
    splits: int = 1
    reverse: bool = False
    p_format: str | None = None  # None: the kv format (bf16 -> bf16 P, fp8 -> fp8 P)
    # Format the running output (P.V accumulator) is kept in between kv blocks: fp32 in every
    # correct kernel; "bf16" is the narrow-accumulation bug (fault:narrow-accumulation).
    acc_format: str = "fp32"


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
    q_positions (absolute kv position of each query) is given. kv_valid [Sk] masks keys."""
    sq, h, _ = q.shape
    sk = k.shape[0]
    if q_positions is None:
        q_positions = torch.arange(sq, device=q.device) + (sk - sq)
    bounds = _split_bounds(sk, numerics.splits)
    outs, lses = [], []
    with exact_matmuls():
        for lo, hi in bounds:
            o, lse = _online(q, k, v, lo, hi, scale, causal, p_format, numerics, soft_cap,
                             kv_valid, q_positions)
            outs.append(o)
            lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return merge_partials(torch.stack(outs), torch.stack(lses))


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce per-split normalised partials: lse* = logsumexp(lse_k), o = sum exp(lse_k - lse*) o_k.

    outs [S, ..., Dv], lses [S, ...]; splits that saw no key (lse -inf) contribute nothing.
    """
    lse = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - lse.unsqueeze(0))
    w = torch.nan_to_num(w, nan=0.0)
    return (w.unsqueeze(-1) * torch.nan_to_num(outs, nan=0.0)).sum(0), lse


def _split_bounds(sk: int, splits: int) -> list[tuple[int, int]]:
    n = max(1, min(splits, sk))
    edges = [round(i * sk / n) for i in range(n + 1)]
    return [(edges[i], edges[i + 1]) for i in range(n)]


def _online(
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
        kb = k[b0:b1].permute(1, 2, 0)  # [Hk, D, n]
        vb = v[b0:b1].permute(1, 0, 2)  # [Hk, n, Dv]
        s = torch.matmul(qh, kb) * scale  # [H, Sq, n]
        if soft_cap > 0:
            s = soft_cap * torch.tanh(s / soft_cap)
        vis = torch.ones((sq, b1 - b0), dtype=torch.bool, device=q.device)
        if causal:
            vis &= torch.arange(b0, b1, device=q.device)[None, :] <= q_positions[:, None]
        if kv_valid is not None:
            vis &= kv_valid[b0:b1][None, :]
        s = s.masked_fill(~vis, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        l = l * alpha + p.sum(-1, keepdim=True)
        p_r = fp8.round_trip(p, p_format) if p_format != "fp32" else p
        acc = acc * alpha + torch.matmul(p_r, vb)
        if nm.acc_format != "fp32":
            acc = fp8.round_trip(acc, nm.acc_format)
        m = m_new
    out = acc / l
    lse = (m + torch.log(l)).squeeze(-1)
    empty = l.squeeze(-1) == 0
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
    return out.permute(1, 0, 2), lse.permute(1, 0)


class TorchBackend:
    """Same-precision PyTorch implementation (see module docstring)."""

    def __init__(self, numerics: Numerics = Numerics(), name: str = "torch") -> None:
        self.numerics = numerics
        self.name = name

    def unavailable(self) -> str | None:
        return None

    def softmax_scale(self, case: Case) -> float:
        """The scale this implementation applies (always the case's; fault doubles override)."""
        return case.softmax_scale

    def capabilities(self) -> dict[str, Capability]:
        full = Capability(soft_cap=True, per_token_scales=True, empty_requests=True)
        decode = Capability(causal=(True,), per_token_scales=True, empty_requests=True)
        return {
            "mla_prefill": full,
            "paged_prefill": full,
            "mla_decode": decode,
            "mla_sparse_decode": decode,
        }

    def run(self, case: Case, inputs: Inputs) -> Output:
        if isinstance(inputs, PrefillInputs):
            out, lse = self._prefill(inputs)
        elif isinstance(case, SparseDecodeCase):
            out, lse = self._sparse(inputs)
        else:
            out, lse = self._decode(inputs)
        inputs.out.out.copy_(out.to(inputs.out.out.dtype))
        return Output(inputs.out.out, lse, wrote_into_guarded=True)

    # -- ops
    def _prefill(self, inputs: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor]:
        case: PrefillCase = inputs.case
        from mlacheck.golden.prefill import kv_tensors  # the same gather the kernel would do

        ks, vs = kv_tensors(inputs, "exact")
        q = inputs.q.dequant()
        qc = inputs.cu_seqlens_q.tolist()
        pf = p_format_for(case.quant.kv, self.numerics)
        res = [
            flash_attend(q[qc[i] : qc[i + 1]], ks[i], vs[i], self.softmax_scale(case), case.causal, pf,
                         self.numerics, case.soft_cap)
            for i in range(len(case.segments))
        ]
        return torch.cat([r[0] for r in res]), torch.cat([r[1] for r in res])

    def _decode(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        case = inputs.case
        rank = case.dims.kv_lora_rank
        q = inputs.q.dequant()
        qo = inputs.qo_indptr.tolist()
        pf = p_format_for(case.quant.kv, self.numerics)
        outs, lses = [], []
        for r in range(len(case.requests)):
            kv = inputs.pool.gather(r)
            o, lse = flash_attend(q[qo[r] : qo[r + 1]], kv, kv[..., :rank], self.softmax_scale(case),
                                  True, pf, self.numerics)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)

    def _sparse(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        case = inputs.case
        assert isinstance(case, SparseDecodeCase) and inputs.topk_indices is not None
        rank = case.dims.kv_lora_rank
        q = inputs.q.dequant()
        pf = p_format_for(case.quant.kv, self.numerics)
        idx = inputs.topk_indices.long()
        outs, lses = [], []
        t = 0
        for r, req in enumerate(case.requests):
            kv = inputs.pool.gather(r)
            for _ in range(req.q_len):
                row = idx[t]
                valid = row >= 0
                sel = kv[row.clamp(min=0)]
                o, lse = flash_attend(q[t : t + 1], sel, sel[..., :rank], self.softmax_scale(case),
                                      False, pf, self.numerics, kv_valid=valid)
                outs.append(o)
                lses.append(lse)
                t += 1
        return torch.cat(outs), torch.cat(lses)


def factory() -> TorchBackend:
    return TorchBackend()


def split_factory() -> TorchBackend:
    """KV split in 4 chunks merged by LSE (persistent-decode structure), smaller tiles."""
    return TorchBackend(Numerics(kv_block=32, splits=4), "torch-split")


def reverse_factory() -> TorchBackend:
    """KV tiles visited last to first: another accumulation order."""
    return TorchBackend(Numerics(kv_block=16, reverse=True), "torch-reverse")
