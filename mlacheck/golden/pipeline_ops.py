"""The references of the DeepSeek-V3.2 sparse-pipeline ops, on a case's inputs.

Each wraps the op's pure golden (golden.indexer, golden.topk, mlacheck.sparse_index,
golden.sparse, golden.decode) around the exact tensors the kernel received. Results carry
`out`, the op's primary output (logits, the reference selection, slots, attention), and
what the judge needs beside it (the logits' magnitudes, the local logits a selection is
judged against, the LSE and max logits). The indexer, top-k and conversion ops have no
"ideal" variant (their inputs are the quantised tensors by definition: None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import sparse_index
from mlacheck.golden.core import Operand, Result, per_tensor
from mlacheck.golden.indexer import IndexerLogits, mqa_logits, paged_mqa_logits
from mlacheck.golden.pipeline import local_rows
from mlacheck.golden.sparse import SparseResult, sparse_attention
from mlacheck.golden.topk import reference_topk
from mlacheck.ops import Op
from mlacheck.pipeline_inputs import (
    ConversionInputs,
    IndexerInputs,
    PagedIndexerInputs,
    PipelineInputs,
    SparsePrefillInputs,
    TopkInputs,
)


@dataclass
class LogitsResult:
    out: torch.Tensor  # [R, W] logits, -inf outside each row's window
    magnitude: torch.Tensor  # [R, W] sum of |terms| (0 outside): the logit error scale


@dataclass
class SelectionResult:
    out: torch.Tensor  # [R, k] the reference selection, request-local, -1 padded
    logits: torch.Tensor  # [R, W] request-local logits the selection is judged against


@dataclass
class SlotsResult:
    out: torch.Tensor  # [T, topk] global slots, -1 padded (row-major)
    indptr: torch.Tensor  # [T + 1] the ragged layout's offsets (valid entries per token)


@dataclass
class PipelineResult(Result):
    """The golden path: attention (out, lse) over the golden selection, and the golden
    logits (request-local, with magnitudes) that selection came from."""

    logits: torch.Tensor | None = None  # [R, W]
    magnitude: torch.Tensor | None = None  # [R, W]
    selection: torch.Tensor | None = None  # [R, topk] request-local, -1 padded


def _logits(got: IndexerLogits) -> LogitsResult:
    return LogitsResult(got.logits, got.magnitude)


def indexer_logits(inputs: IndexerInputs, variant: str = "exact",
                   dtype: torch.dtype = torch.float32) -> LogitsResult | None:
    if variant != "exact":
        return None
    q = inputs.query
    return _logits(mqa_logits(Operand(q.q), Operand(inputs.keys.values, inputs.keys.scales[:, None]),
                              q.weights, inputs.k_start, inputs.k_end, dtype))


def paged_logits(inputs: PagedIndexerInputs, dtype: torch.dtype = torch.float32
                 ) -> LogitsResult:
    """Through the paged pool (what the kernel reads), each request's first kv_len keys."""
    values, scales = inputs.pool.halves()
    return _logits(paged_mqa_logits(Operand(inputs.query.q), values, scales, inputs.query.weights,
                                    inputs.block_table, inputs.context_lens, inputs.row_request,
                                    inputs.row_visible, inputs.width, dtype))


def paged_indexer_logits(inputs: PagedIndexerInputs, variant: str = "exact",
                         dtype: torch.dtype = torch.float32) -> LogitsResult | None:
    return paged_logits(inputs, dtype) if variant == "exact" else None


def local_topk_logits(inputs: TopkInputs) -> torch.Tensor:
    """[T, max kv_len] request-local logits (the prefill form's rows shifted by k_start)."""
    width = max(inputs.case.kv_lengths)
    if inputs.case.form == "decode":
        return inputs.logits[:, :width]
    return local_rows(inputs.logits, inputs.k_start, width)


def topk_selection(inputs: TopkInputs, variant: str = "exact",
                   dtype: torch.dtype = torch.float32) -> SelectionResult | None:
    if variant != "exact":
        return None
    local = local_topk_logits(inputs).to(dtype)
    return SelectionResult(reference_topk(local, inputs.case.topk), local)


def conversion_slots(inputs: ConversionInputs, variant: str = "exact",
                     dtype: torch.dtype = torch.float32) -> SlotsResult | None:
    if variant != "exact":
        return None
    req = sparse_index.token_requests(inputs.qo_indptr.cpu())
    slots = sparse_index.to_global_slots(inputs.local.cpu(), req, inputs.block_table.cpu(),
                                         inputs.case.page_size, inputs.kv_lens.cpu())
    return SlotsResult(slots, sparse_index.to_ragged(slots).indptr)


def sparse_prefill(inputs: SparsePrefillInputs, variant: str = "exact",
                   dtype: torch.dtype = torch.float32) -> SparseResult:
    case = inputs.case
    if variant == "ideal":
        q, kv = Operand(inputs.q.ideal), Operand(inputs.kv.ideal)
    else:
        q = Operand(inputs.q.stored, per_tensor(inputs.q.scale))
        kv = Operand(inputs.kv.stored, per_tensor(inputs.kv.scale))
    return sparse_attention(q, kv, inputs.indices, case.softmax_scale, case.dims.kv_lora_rank,
                            dtype)


def pipeline(inputs: PipelineInputs, variant: str = "exact",
             dtype: torch.dtype = torch.float32) -> PipelineResult | None:
    """Golden logits (through the paged key cache) -> reference top-k -> golden sparse
    decode over the selected positions."""
    if variant != "exact":
        return None
    got = paged_logits(inputs.indexer, dtype)
    selection = reference_topk(got.out, inputs.case.topk)
    idx = inputs.indexer
    slots = sparse_index.to_global_slots(selection.cpu(), idx.row_request, idx.block_table.cpu(),
                                         inputs.case.page_size, idx.context_lens.cpu())
    att = attention_on_slots(inputs, slots, dtype)
    return PipelineResult(att.out, att.lse, got.out, got.magnitude, selection)


def attention_on_slots(inputs: PipelineInputs, slots: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> Result:
    """The golden sparse decode of every query token over global slots [T, topk] of the
    latent pool (-1 ignored): what attention over that selection is, whoever selected it."""
    case, pool = inputs.case, inputs.attention.pool
    lin = pool.linear()
    kv = Operand(lin.reshape(-1, *lin.shape[2:]), per_tensor(pool.scale))
    q = inputs.attention.q
    res = sparse_attention(Operand(q.stored, per_tensor(q.scale)), kv, slots.to(q.stored.device),
                           case.softmax_scale, case.dims.kv_lora_rank, dtype)
    return Result(res.out, res.lse)


REFERENCES = {
    Op.MQA_LOGITS: indexer_logits,
    Op.PAGED_MQA_LOGITS: paged_indexer_logits,
    Op.TOPK: topk_selection,
    Op.INDEX_CONVERSION: conversion_slots,
    Op.SPARSE_PREFILL: sparse_prefill,
    Op.SPARSE_PIPELINE: pipeline,
}
