"""Decode references (absorbed MQA form): dense paged decode and sparse top-k decode."""

from __future__ import annotations

import functools

import torch

from mlacheck.golden.core import (
    Operand,
    Request,
    Result,
    attend_each,
    concat,
    exact_matmuls,
    per_tensor,
    score_block_elements,
    softmax_v,
)
from mlacheck.inputs import DecodeInputs


def _query_operand(inputs: DecodeInputs, variant: str) -> Operand:
    """exact: q as stored with its scale (dequantised in the reference's own dtype, so fp64
    is exact); ideal: the unquantised original."""
    if variant == "ideal":
        return Operand(inputs.q.ideal)
    return Operand(inputs.q.stored, per_tensor(inputs.q.scale))


def _kv_operand(inputs: DecodeInputs, variant: str, r: int) -> Operand:
    """Request r's latent KV [kv_len, 1, 576]. exact: gathered from the paged pool through
    the page table as stored (what the kernel reads), with the pool's scale; ideal: the
    unquantised original."""
    if variant == "ideal":
        return Operand(inputs.kv[r].ideal)
    return Operand(inputs.pool.gather(r, dequant=False), per_tensor(inputs.pool.scale))


def reference(inputs: DecodeInputs, variant: str = "exact", dtype: torch.dtype = torch.float32) -> Result:
    """Dense decode: each request's q_len tokens (MTP causal, bottom-right) over its kv.

    Requests are gathered one at a time (as stored, converted per block), so memory stays
    near one request's KV whatever the batch.
    """
    case = inputs.case
    rank = case.dims.kv_lora_rank
    q = _query_operand(inputs, variant)
    qo = inputs.qo_indptr.tolist()

    def request(r: int) -> Request:
        return q.view(lambda x: x[qo[r] : qo[r + 1]]), _kv_operand(inputs, variant, r), rank

    return concat(attend_each([functools.partial(request, r) for r in range(len(case.requests))],
                              case.softmax_scale, causal=True, dtype=dtype))


def sparse_reference(
    inputs: DecodeInputs, variant: str = "exact", dtype: torch.dtype = torch.float32,
    budget: int | None = None,
) -> Result:
    """Sparse decode: token t attends to the kv positions topk_indices[t] (-1 ignored).

    A token with no valid index gets output 0 and LSE -inf (defined, not NaN).
    """
    case = inputs.case
    assert inputs.topk_indices is not None
    rank = case.dims.kv_lora_rank
    q = _query_operand(inputs, variant).get(dtype)
    kvs = [_kv_operand(inputs, variant, r).get(dtype) for r in range(len(case.requests))]
    idx = inputs.topk_indices.long()
    t_total, h, _ = q.shape
    topk = idx.shape[1]
    owner = torch.repeat_interleave(
        torch.arange(len(kvs)), torch.tensor([r.q_len for r in case.requests])
    ).tolist()
    out = torch.zeros((t_total, h, rank), dtype=dtype, device=q.device)
    lse = torch.full((t_total, h), float("-inf"), dtype=dtype, device=q.device)
    tb = max(1, (budget or score_block_elements(dtype)) // max(1, h * topk))
    with exact_matmuls():
        for t0 in range(0, t_total, tb):
            t1 = min(t_total, t0 + tb)
            rows = idx[t0:t1]
            valid = rows >= 0
            gathered = torch.stack(
                [kvs[owner[t]][rows[t - t0].clamp(min=0), 0] for t in range(t0, t1)]
            )  # [tb, topk, 576]
            s = torch.einsum("thd,tkd->thk", q[t0:t1], gathered).mul_(case.softmax_scale)
            seen = valid[:, None, :].to(s.device)  # padded slots (clamped to 0) must not leak
            s.masked_fill_(~seen, float("-inf"))
            out[t0:t1], lse[t0:t1] = softmax_v(s, gathered[..., :rank], seen, 0, careful=True)
    return Result(out, lse)
