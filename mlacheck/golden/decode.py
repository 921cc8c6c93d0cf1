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
         else Operand(inputs.q.stored, per_tensor(inputs.q.scale)))
    qo = inputs.qo_indptr.tolist()
    kv_scale = per_tensor(inputs.pool.scale)

    def request(r: int) -> Request:
        kv = (Operand(inputs.kv[r].ideal) if variant == "ideal"
              else Operand(inputs.pool.gather(r, dequant=False), kv_scale))
        return q.view(lambda x: x[qo[r] : qo[r + 1]]), kv, rank

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
