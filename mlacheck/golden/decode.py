"""Decode references (absorbed MQA form): dense paged decode and sparse top-k decode."""

from __future__ import annotations

import functools

import torch

from mlacheck.fp8 import cat_rows
from mlacheck.golden.core import (
    Operand,
    Request,
    Result,
    attend_each,
    concat,
    per_tensor,
)
from mlacheck.golden.sparse import sparse_attention
from mlacheck.inputs import DecodeInputs


def query_operand(inputs: DecodeInputs, variant: str) -> Operand:
    """exact: q as stored with its scale (dequantised in the reference's own dtype, so fp64
    is exact); ideal: the unquantised original."""
    if variant == "ideal":
        return Operand(inputs.q.ideal)
    return Operand(inputs.q.stored, per_tensor(inputs.q.scale))


def kv_operand(inputs: DecodeInputs, variant: str, r: int) -> Operand:
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
    q = query_operand(inputs, variant)
    qo = inputs.qo_indptr.tolist()

    def request(r: int) -> Request:
        return q.view(lambda x: x[qo[r] : qo[r + 1]]), kv_operand(inputs, variant, r), rank

    return concat(attend_each([functools.partial(request, r) for r in range(len(case.requests))],
                              case.softmax_scale, causal=True, dtype=dtype))


def sparse_reference(
    inputs: DecodeInputs, variant: str = "exact", dtype: torch.dtype = torch.float32,
    budget: int | None = None,
) -> Result:
    """Sparse decode: token t attends to the kv positions topk_indices[t] of its request
    (-1, or a position past the request's kv_len, ignored).

    A token with no valid index gets output 0 and LSE -inf (defined, not NaN). The requests'
    KV is laid end to end and the positions made rows of it, so the one sparse attention
    (golden.sparse) serves decode and prefill alike.
    """
    case = inputs.case
    res = sparse_attention(query_operand(inputs, variant), sparse_kv(inputs, variant),
                           sparse_rows(inputs), case.softmax_scale, case.dims.kv_lora_rank,
                           dtype, budget)
    return Result(res.out, res.lse)


def sparse_kv(inputs: DecodeInputs, variant: str) -> Operand:
    """Every request's latent KV laid end to end (the rows `sparse_rows` index)."""
    kvs = [kv_operand(inputs, variant, r) for r in range(len(inputs.case.requests))]
    return Operand(cat_rows([k.data for k in kvs]), kvs[0].scale)


def sparse_rows(inputs: DecodeInputs) -> torch.Tensor:
    """Each token's top-k positions as rows of `sparse_kv` (-1: no position)."""
    case = inputs.case
    assert inputs.topk_indices is not None
    q_lens = torch.tensor([r.q_len for r in case.requests])
    kv_lens = torch.tensor([r.kv_len for r in case.requests])
    starts = torch.cumsum(kv_lens, 0) - kv_lens
    owner = torch.repeat_interleave(torch.arange(len(case.requests)), q_lens)
    idx = inputs.topk_indices.long().cpu()
    inside = (idx >= 0) & (idx < kv_lens[owner][:, None])
    return torch.where(inside, idx + starts[owner][:, None], torch.full_like(idx, -1))
