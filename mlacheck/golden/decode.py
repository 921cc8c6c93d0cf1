"""Decode references (absorbed MQA form): dense paged decode and sparse top-k decode."""

from __future__ import annotations

import torch

from mlacheck.golden.core import (
    SCORE_BLOCK_ELEMENTS,
    Operand,
    Result,
    _apply_v,
    attend,
    exact_matmuls,
)
from mlacheck.inputs import DecodeInputs


def kv_tensors(inputs: DecodeInputs, variant: str) -> list[torch.Tensor]:
    """Per request latent KV [kv_len, 1, 576] in fp32.

    exact: gathered from the paged pool through the page table and dequantised, i.e. what
    the kernel reads; ideal: the unquantised originals.
    """
    if variant == "ideal":
        return [kv.ideal for kv in inputs.kv]
    return [inputs.pool.gather(r) for r in range(len(inputs.case.requests))]


def _queries(inputs: DecodeInputs, variant: str) -> torch.Tensor:
    return inputs.q.ideal if variant == "ideal" else inputs.q.dequant()


def reference(inputs: DecodeInputs, variant: str = "exact", dtype: torch.dtype = torch.float32) -> Result:
    """Dense decode: each request's q_len tokens (MTP causal, bottom-right) over its kv.

    Requests are gathered one at a time (as stored, converted per block), so memory stays
    near one request's KV whatever the batch.
    """
    case = inputs.case
    rank = case.dims.kv_lora_rank
    q = (Operand(inputs.q.ideal) if variant == "ideal"
         else Operand(inputs.q.stored, inputs.q.scale))
    qo = inputs.qo_indptr.tolist()
    outs, lses = [], []
    for r in range(len(case.requests)):
        kv = (Operand(inputs.kv[r].ideal) if variant == "ideal"
              else Operand(inputs.pool.gather(r, dequant=False), inputs.pool.scale))
        res = attend(q.view(lambda x, a=qo[r], b=qo[r + 1]: x[a:b]), kv,
                     kv.view(lambda x: x[..., :rank]), case.softmax_scale, causal=True, dtype=dtype)
        outs.append(res.out)
        lses.append(res.lse)
    return Result(torch.cat(outs), torch.cat(lses))


def sparse_reference(
    inputs: DecodeInputs, variant: str = "exact", dtype: torch.dtype = torch.float32,
    budget: int = SCORE_BLOCK_ELEMENTS,
) -> Result:
    """Sparse decode: token t attends to the kv positions topk_indices[t] (-1 ignored).

    A token with no valid index gets output 0 and LSE -inf (defined, not NaN).
    """
    case = inputs.case
    assert inputs.topk_indices is not None
    rank = case.dims.kv_lora_rank
    q = _queries(inputs, variant).to(dtype)
    kvs = [kv.to(dtype) for kv in kv_tensors(inputs, variant)]
    idx = inputs.topk_indices.long()
    t_total, h, _ = q.shape
    topk = idx.shape[1]
    owner = torch.repeat_interleave(
        torch.arange(len(kvs)), torch.tensor([r.q_len for r in case.requests])
    ).tolist()
    out = torch.zeros((t_total, h, rank), dtype=dtype, device=q.device)
    lse = torch.full((t_total, h), float("-inf"), dtype=dtype, device=q.device)
    tb = max(1, budget // max(1, h * topk))
    with exact_matmuls():
        for t0 in range(0, t_total, tb):
            t1 = min(t_total, t0 + tb)
            rows = idx[t0:t1]
            valid = rows >= 0
            gathered = torch.stack(
                [kvs[owner[t]][rows[t - t0].clamp(min=0), 0] for t in range(t0, t1)]
            )  # [tb, topk, 576]
            s = torch.einsum("thd,tkd->thk", q[t0:t1], gathered) * case.softmax_scale
            s = s.masked_fill(~valid[:, None, :].to(s.device), float("-inf"))
            m = torch.logsumexp(s, dim=-1, keepdim=True)
            p = torch.exp(s - m.masked_fill(torch.isneginf(m), 0.0))  # no valid index: p = 0
            seen = valid[:, None, :].to(p.device)  # padded slots (clamped to 0) must not leak
            out[t0:t1] = _apply_v(p, gathered[..., :rank], seen)
            lse[t0:t1] = m.squeeze(-1)
    return Result(out, lse)
