"""The AITER adapter's DeepSeek-V3.2 sparse-pipeline ops, called as vLLM's ROCm sparse MLA
backend calls them (vllm/v1/attention/ops/rocm_aiter_mla_sparse.py), by keyword:

| op | AITER |
|---|---|
| mqa_logits | `ops.triton.attention.fp8_mqa_logits.fp8_mqa_logits` (clean_logits=True) |
| paged_mqa_logits | `ops.triton.attention.pa_mqa_logits.deepgemm_fp8_paged_mqa_logits` (the plain page layout: Preshuffle=False, KVBlockSize = the page size; out_logits initialised to -inf, as the kernel writes only the chunks covering each context) |
| topk_indices | `top_k_per_row_decode` (next_n=1, one length per row, as vLLM passes MTP rows) / `top_k_per_row_prefill`, whose positions count from the row's start and are localised here (vLLM's `_localize_aiter_prefill_topk`) |
| index_conversion (ragged) | `ops.triton.attention.sparse_attention_dsv4.compute_global_topk_ragged_indices_and_indptr` where installed (AITER v0.1.18 .. v0.1.19.post2), else its kernels `_compute_topk_lens_kernel` + `_pack_global_topk_ragged_kernel` (`ops.triton._triton_kernels.attention.sparse_attention_dsv4`, AITER main): `aiter_conversion`, shared with aiter-triton; row-major: AITER has none (a SKIP) |
| mla_sparse_prefill | the sparse decode (`mla_decode_fwd` with sparse metadata): vLLM's ROCm V3.2 backend runs prefill tokens as sparse decode pseudo-batches over the flat latent KV (a page-size-1 pool); no max_logits |
| sparse_pipeline | paged logits -> `top_k_per_row_decode` -> the adapter's conversion (`global_slots`, the layout each sparse decode reads) -> sparse decode |

Nothing here has run on ROCm hardware: it is verified against mlacheck's AITER model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mlacheck.backends import aiter_conversion
from mlacheck.backends.aiter.api import FP8_MQA_LOGITS, PAGED_MQA_LOGITS, AdapterError, AiterApi
from mlacheck.backends.aiter.capability import ASM_FORMATS, MAX_DECODE_HEADS
from mlacheck.backends.base import Capability, Output, Range
from mlacheck.kvcache import PageTable
from mlacheck.ops import Op
from mlacheck.spec import Case

if TYPE_CHECKING:
    from mlacheck.backends.aiter.adapter import AiterAdapter

# deepgemm_fp8_paged_mqa_logits' chunk along kv (its default): ChunkK and the page size
# must divide one another.
CHUNK_K = 256


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _indexer_rule(case: Case) -> str | None:
    heads = getattr(case, "index_heads", None) or case.num_heads
    dim = getattr(case, "index_head_dim", None) or getattr(case, "head_dim", 0)
    if not _pow2(heads) or not _pow2(dim):
        return (f"AITER's indexer kernels take power-of-two head counts and head dims "
                f"('num q. heads should be power of 2'), not {heads} x {dim}")
    return None


def _chunk_rule(case: Case) -> str | None:
    ps = case.page_size  # type: ignore[union-attr]
    if not (CHUNK_K % ps == 0 or ps % CHUNK_K == 0):
        return (f"page size {ps}: deepgemm_fp8_paged_mqa_logits needs ChunkK ({CHUNK_K}) and "
                "KVBlockSize to divide one another")
    return None


# The FP8 bytes the indexer kernels read are the chip's e4m3 (AITER e4048607a5).
CHIP_FP8_REASON = ("the kernel reads FP8 bytes in the chip's format: AITER's dtypes.fp8, fnuz on "
                   "gfx942 and fn on gfx950 (aiter/utility/dtypes.py:12-13), the paged kernel's "
                   "cache viewed as it (aiter/ops/triton/attention/pa_mqa_logits.py:219, "
                   ":290-291)")
# Sparse prefill runs as bf16 sparse-decode pseudo-batches over the bf16 latent KV.
SPARSE_PREFILL_FORMATS = "it runs as the bf16 sparse decode over bf16 latent KV; " + ASM_FORMATS
# Why its sparse prefill hands back no max_logits (Output.metadata["max_logits"]: left out only
# with a reason, mlacheck.pipeline_judge), read in AITER at TARGET_COMMIT (e4048607a5).
SPARSE_PREFILL_NO_MAX_LOGITS = (
    "it runs as the sparse decode, whose mla_decode_fwd writes the output and returns "
    "(logits, lse): the per-split outputs and the LSE (aiter/mla.py:623-656, :709-710, "
    ":1006), no max scaled score")


def capabilities(adapter: AiterAdapter, api: AiterApi, decode_common: dict[str, Any],
                 decode_rules: Sequence[Any]) -> dict[str, Capability]:
    chip = api.fp8_format
    # the prefill-form kernel recasts OCP e4m3fn to fnuz on gfx942; elsewhere it reads the
    # chip's own format. The paged kernel always reads the chip's format.
    prefill_fmts = ("fp8_e4m3fn", "fp8_e4m3fnuz") if api.gfx == "gfx942" else (chip,)
    chip_only = dict.fromkeys(("q_formats", "kv_formats"), CHIP_FP8_REASON)
    dev = adapter.devices
    def pipeline_format(case: Case) -> str | None:
        fmt = case.index_fmt  # type: ignore[union-attr]
        return None if fmt == chip else (f"indexer keys in {fmt}: the paged kernel reads "
                                         f"{chip} on {api.gfx} ({CHIP_FP8_REASON})")

    return {
        Op.MQA_LOGITS: Capability(
            q_formats=prefill_fmts, kv_formats=prefill_fmts, per_token_scales=True,
            empty_requests=True, devices=dev, rules=(_indexer_rule,), reasons=chip_only,
            refusal=api.op_problem(Op.MQA_LOGITS),
            notes="Triton fp8_mqa_logits (clean_logits=True)"),
        Op.PAGED_MQA_LOGITS: Capability(
            q_formats=(chip,), kv_formats=(chip,), per_token_scales=True, devices=dev,
            rules=(_indexer_rule, _chunk_rule), reasons=chip_only,
            refusal=api.op_problem(Op.PAGED_MQA_LOGITS),
            notes="Triton deepgemm_fp8_paged_mqa_logits, plain page layout (Preshuffle=False)"),
        Op.TOPK: Capability(
            empty_requests=True, devices=dev, refusal=api.op_problem(Op.TOPK),
            notes="top_k_per_row_decode (next_n=1, per-row lengths) / top_k_per_row_prefill "
                  "(positions localised by the adapter, as vLLM does)"),
        Op.INDEX_CONVERSION: Capability(
            empty_requests=True, devices=dev, rules=(aiter_conversion.conversion_layout_rule,),
            refusal=api.conversion.problem,
            notes="AITER's compute_global_topk_ragged_indices_and_indptr where installed, else "
                  "its kernels _compute_topk_lens_kernel + _pack_global_topk_ragged_kernel "
                  "launched as it launches them (aiter_conversion); ragged only"),
        Op.SPARSE_PREFILL: Capability(
            q_formats=("bf16",), kv_formats=("bf16",), head_counts=Range(1, MAX_DECODE_HEADS),
            empty_requests=True, devices=dev, refusal=api.op_problem(Op.SPARSE_PREFILL),
            reasons=dict.fromkeys(("q_formats", "kv_formats"), SPARSE_PREFILL_FORMATS),
            notes="prefill tokens as sparse decode pseudo-batches over a page-size-1 view of "
                  "the flat latent KV (vLLM's ROCm V3.2 path); no max_logits"),
        Op.SPARSE_PIPELINE: Capability(
            **{**decode_common, "q_len": Range(1, 4)}, rules=(*decode_rules, _indexer_rule,
                                                               _chunk_rule, pipeline_format),
            refusal=api.op_problem(Op.SPARSE_PIPELINE),
            notes="paged logits -> top_k_per_row_decode -> the adapter's conversion -> "
                  "sparse decode"),
    }


def run(adapter: AiterAdapter, api: AiterApi, case: Case, inputs: Any) -> Output:
    return _RUN[case.op](adapter, api, case, inputs)


# --------------------------------------------------------------------------- indexer


def _mqa_logits(adapter: AiterAdapter, api: AiterApi, case: Case, inputs: Any) -> Output:
    q = inputs.query
    logits = adapter._call(api, FP8_MQA_LOGITS, Q=q.q, KV=inputs.keys.values,
                           kv_scales=inputs.keys.scales, weights=q.weights,
                           cu_starts=inputs.k_start, cu_ends=inputs.k_end, clean_logits=True)
    out = inputs.out.out
    if tuple(logits.shape) != tuple(out.shape):
        raise AdapterError(f"fp8_mqa_logits returned {tuple(logits.shape)}, expected "
                           f"{tuple(out.shape)}")
    out.copy_(logits)
    return Output(out, wrote_into_guarded=True)


def paged_logits(adapter: AiterAdapter, api: AiterApi, idx: Any, out: torch.Tensor) -> None:
    """deepgemm_fp8_paged_mqa_logits into `out` [B * next_n, W] (filled with -inf first: the
    kernel writes only the ChunkK-wide chunks covering each context)."""
    case = idx.case
    b, nn = len(case.requests), case.next_n
    out.fill_(float("-inf"))
    adapter._call(api, PAGED_MQA_LOGITS,
                  q_fp8=idx.query.q.view(b, nn, case.num_heads, case.head_dim),
                  kv_cache=idx.pool.data, weights=idx.query.weights, out_logits=out,
                  context_lens=idx.context_lens, kv_indices=idx.block_table,
                  max_model_len=out.shape[1], Preshuffle=False,
                  KVBlockSize=idx.pool.page_size, ChunkK=CHUNK_K)


def _paged_mqa_logits(adapter: AiterAdapter, api: AiterApi, case: Case, inputs: Any) -> Output:
    paged_logits(adapter, api, inputs, inputs.out.out)
    return Output(inputs.out.out, wrote_into_guarded=True)


# --------------------------------------------------------------------------- top-k


def topk_decode(adapter: AiterAdapter, api: AiterApi, logits: torch.Tensor,
                lengths: torch.Tensor, out: torch.Tensor, k: int) -> None:
    """top_k_per_row_decode with next_n=1 and one length per row (vLLM's call)."""
    adapter._call(api, "top_k_per_row_decode", logits=logits, next_n=1,
                  seqLens=lengths.to(torch.int32).reshape(-1), indices=out,
                  numRows=logits.shape[0], stride0=logits.stride(0), stride1=logits.stride(1),
                  k=k)


def _topk(adapter: AiterAdapter, api: AiterApi, case: Case, inputs: Any) -> Output:
    out, logits, k = inputs.out.out, inputs.logits, case.topk  # type: ignore[union-attr]
    if case.form == "decode":  # type: ignore[union-attr]
        topk_decode(adapter, api, logits, inputs.lengths, out, k)
        return Output(out, wrote_into_guarded=True)
    starts = inputs.k_start.to(torch.int32)
    adapter._call(api, "top_k_per_row_prefill", logits=logits, rowStarts=starts,
                  rowEnds=inputs.k_end.to(torch.int32), indices=out, values=None,
                  numRows=logits.shape[0], stride0=logits.stride(0), stride1=logits.stride(1),
                  k=k)
    # AITER counts positions from the row's start of the batch-wide row: made request-local
    # as vLLM's _localize_aiter_prefill_topk does
    out.copy_(torch.where(out >= 0, out - starts[:, None].to(out.device), out))
    return Output(out, wrote_into_guarded=True, metadata={"aiter_topk": "prefill, localised"})


# --------------------------------------------------------------------------- slots


def global_slots(local: torch.Tensor, qo_indptr: torch.Tensor, table: PageTable
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Request-local positions [T, topk] (-1 padded, any order) -> (global slots [T, topk]
    with each row's valid slots first, in order, then -1; valid counts [T]) through the page
    table: what the adapter hands AITER's sparse decode (its kv_indices)."""
    idx = local.cpu().long()
    order = torch.argsort((idx < 0).to(torch.int8), dim=1, stable=True)
    compact = idx.gather(1, order)
    counts = (compact >= 0).sum(1)
    slots = torch.full_like(compact, -1)
    qo = qo_indptr.cpu().tolist()
    ps = table.page_size
    for r in range(len(qo) - 1):
        rows = compact[qo[r]: qo[r + 1]]
        valid = rows >= 0
        pos = rows.clamp(min=0)
        if bool((pos[valid] >= int(table.kv_lens[r])).any()):
            raise AdapterError(f"request {r}: top-k position beyond its kv length")
        pages = table.pages_of(r)
        if pages.numel() == 0:
            continue
        glob = pages[(pos // ps).clamp(max=pages.numel() - 1)] * ps + pos % ps
        slots[qo[r]: qo[r + 1]] = torch.where(valid, glob, torch.full_like(glob, -1))
    if slots.numel() and int(slots.max()) >= 2**31:
        raise AdapterError("global kv slot beyond int32: AITER's kv_indices cannot address it")
    return slots, counts


def _conversion(adapter: AiterAdapter, api: AiterApi, case: Case, inputs: Any) -> Output:
    """AITER's ragged conversion (aiter_conversion: the code aiter-triton runs too)."""
    out = inputs.out.out
    indptr, how = aiter_conversion.convert(api.conversion, inputs.local, inputs.qo_indptr,
                                           inputs.block_table, case.page_size, out)  # type: ignore[union-attr]
    return Output(out, extra={"indptr": indptr}, metadata={"conversion": how},
                  wrote_into_guarded=True)


# --------------------------------------------------------------------------- attention


def _sparse_prefill(adapter: AiterAdapter, api: AiterApi, case: Case, inputs: Any) -> Output:
    """One pseudo-request holding every token over the flat latent KV as a page-size-1
    pool: the indices are then its request-local positions (and global slots)."""
    twin, twin_inputs = inputs.as_sparse_decode()
    res = adapter._decode(api, twin, twin_inputs)
    res.metadata["sparse_prefill"] = "run as sparse decode pseudo-batches (page-size-1 view)"
    res.metadata["max_logits"] = SPARSE_PREFILL_NO_MAX_LOGITS
    return res


def _pipeline(adapter: AiterAdapter, api: AiterApi, case: Case, inputs: Any) -> Output:
    idx = inputs.indexer
    rows, width = idx.query.q.shape[0], idx.width
    logits = torch.empty((rows, width), dtype=torch.float32, device=inputs.device)
    paged_logits(adapter, api, idx, logits)
    local = torch.full((rows, case.topk), -1, dtype=torch.int32, device=inputs.device)  # type: ignore[union-attr]
    topk_decode(adapter, api, logits, idx.row_visible, local, case.topk)  # type: ignore[union-attr]
    twin_case = case.attention_case()  # type: ignore[union-attr]
    twin = inputs.attention_with(local)
    res = adapter._decode(api, twin_case, twin)
    slots, _ = global_slots(local, twin.qo_indptr, twin.table)
    res.extra["slots"] = slots.to(torch.int32)
    return res


_RUN = {
    Op.MQA_LOGITS: _mqa_logits,
    Op.PAGED_MQA_LOGITS: _paged_mqa_logits,
    Op.TOPK: _topk,
    Op.INDEX_CONVERSION: _conversion,
    Op.SPARSE_PREFILL: _sparse_prefill,
    Op.SPARSE_PIPELINE: _pipeline,
}
