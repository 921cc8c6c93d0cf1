"""`flashinfer` / `flashinfer-fa3`: FlashInfer's MLA kernels on NVIDIA GPUs.

- mla_decode: `flashinfer.mla.BatchMLAPagedAttentionWrapper` (absorbed MLA: q_nope 512 +
  q_pe 64 against a paged latent cache ckv 512 + kpe 64), its fa2 path (`flashinfer`) or its
  sm_90 fa3 path (`flashinfer-fa3`). mlacheck's latent pool [pages, page_size, 1, 576] is
  handed over as two strided views (ckv = channels 0..511, kpe = 512..575): FlashInfer reads
  the page and token strides of each cache tensor, so nothing is copied. The page table is
  FlashInfer's own convention (kv_indptr / kv_indices / kv_len_arr). MTP (q_len > 1) rows
  come through qo_indptr with causal=True.
- mla_prefill: `flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper` (MHA view, q/k 192,
  v 128, ragged cu_seqlens), causal or not, soft cap as `logits_soft_cap`.
- paged_prefill: `flashinfer.prefill.BatchPrefillWithPagedKVCacheWrapper` with
  `head_dim_qk` 192 / `head_dim_vo` 128: mlacheck's K and V page pools as they are (NHD, the
  same page table), no copy.
- mla_sparse_decode (DeepSeek-V3.2 top-k): FlashInfer has no top-k MLA entry point for sm_90,
  but top-k attention is paged attention with page size 1 whose page list is the selected
  slots. The latent pool is viewed as a flat token pool ([pages * page_size, 1, 576], the same
  bytes: a view, no copy), each query token is one request (causal off) and its kv_indices are
  its valid top-k global slots (-1 padding dropped). The verdict's `implementation` says so.
- mla_sparse_prefill (DeepSeek-V3.2 top-k prefill): the same attention per query token, so the
  same composition runs it: the flat latent KV [N, 1, 576] is a page-size-1 pool whose slots
  are its rows (SparsePrefillInputs.as_sparse_decode, as AITER's adapters do), each token one
  request with its own index list. The kernel returns out and LSE, not the max scaled score:
  the adapter says so (Output.metadata["max_logits"], NO_MAX_LOGITS), which the judge's
  max_logits check shows as "not checked" (mlacheck.pipeline_judge: without a reason a missing
  max_logits FAILs); it is never recomputed here from q and K.
- topk_indices (0.7.x): `flashinfer.top_k_ragged_transform` over mlacheck's logit rows as they
  are (decode rows from column 0; prefill rows with row_starts = each row's window start), so
  the positions come back request-local, -1 past a row's window. Only from FlashInfer's
  prebuilt (AOT) top-k module: its JIT build takes minutes, which no item may start (a7167f4);
  where it is not installed the op is the machine's SKIP naming the tool that builds it.

Versions: written for flashinfer-python 0.2.14.post1 and 0.7.x. What differs is read from the
installed library: where `flashinfer.mla` has `MLAPlanMetadata` (0.7.x) the MLA wrapper is
called in its structural form, `plan(metadata=MLAPlanMetadata.csr(...), query_layout="split",
kv_cache_layout="split", lse_mode="base2")` and `run(query=(q_nope, q_pe), kv_cache=(ckv,
kpe))`, the same tensors and plan values as the flat keywords, which 0.7.2.post1 deprecates;
elsewhere (0.2.14.post1) the flat keywords as before (`implementation.flashinfer.api` says
which). 0.7.x's MLA `plan` takes
`scale_mode="kv-per-tensor"` (bf16 q over an fp8_e4m3fn cache, sm_90, per-tensor
`ckv_scale` / `kpe_scale` in `run`); 0.2.x's fa2 paged prefill refuses K/V caches of
different strides ("k/v strides must be identical", csrc/batch_prefill.cu), which K 192 and
V 128 pools always are; the fa3 (sm_90) paged prefill of both lines takes only head_dim_qk ==
head_dim_vo (cudaErrorNotSupported otherwise, hopper/prefill_sm90.cuh; measured on the H100),
so FlashInfer's paged prefill runs here with 0.7.x's fa2 only. 0.7.x's prefill `run` takes
per-tensor `k_scale` / `v_scale`: fa2 runs an fp8_e4m3fn K/V under a 16-bit q (k_scale folded
into sm_scale, v_scale multiplied into the output by FlashInfer's Python); FP8 q is refused by
both kernels for MLA's head dims (FP8_PREFILL_REASONS_07 quotes the sources).

What FlashInfer refuses is a SKIP naming the source: 0.7.x's MLA plan() refuses causal batches
whose q tile cuts a token at a KV tile start (finding 3, fixed by refusing): `causal_tile_rule`
says so before the call, the same condition. The DeepSeek-V3.2 indexer logits (and the sparse
pipeline they start) have FlashInfer kernels for SM100+ only, positions -> slots none standalone:
kernel limits on the H100, the adapter's choice only on a GPU that has the kernel
(SPARSE_PATH_KERNELS).

FlashInfer returns the LSE in base 2 (log2 of the sum of exp): converted to the natural log
here (x ln 2). The softmax scale is always passed. Every installed function is checked
against the keywords passed (toolkit.signature_problem) before first use, and the library
version goes into every Output's metadata. Capabilities are what was measured on an H100
(docs/flashinfer.md); what a kernel does not take is a SKIP naming it.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from mlacheck import layouts
from mlacheck.backends.base import Capability, CaseRule, Output, adapter_choice, machine_setup
from mlacheck.backends.toolkit import (
    LibraryAdapter,
    Loaded,
    cuda_refusal,
    load_library,
    lse_empty_rows,
    lse_natural,
    lse_tokens_heads,
    signature_problems,
    topk_to_global_slots,
)
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs
from mlacheck.pipeline_inputs import SparsePrefillInputs, TopkInputs
from mlacheck.spec import (
    Case,
    DecodeCase,
    Op,
    PrefillCase,
    SparseDecodeCase,
    SparsePrefillCase,
    TopkCase,
)

MODULE = "flashinfer"
DISTRIBUTIONS = ("flashinfer-python", "flashinfer")
INSTALL_HINT = "pip install flashinfer-python (docs/flashinfer.md)"
# FlashInfer computes the LSE as log2(sum 2^(s * log2 e)): base 2.
LSE_BASE = 2.0
# The split-k workspace FlashInfer's examples allocate.
WORKSPACE_BYTES = 128 << 20

# The keyword parameters this adapter passes to each installed function.
CALLED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "mla.BatchMLAPagedAttentionWrapper": ("float_workspace_buffer", "use_cuda_graph", "backend"),
    "mla.BatchMLAPagedAttentionWrapper.plan": (
        "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv",
        "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type"),
    "mla.BatchMLAPagedAttentionWrapper.run": (
        "q_nope", "q_pe", "ckv_cache", "kpe_cache", "out", "return_lse"),
    "prefill.BatchPrefillWithRaggedKVCacheWrapper": (
        "float_workspace_buffer", "kv_layout", "backend"),
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.plan": (
        "qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo",
        "causal", "logits_soft_cap", "sm_scale", "q_data_type", "kv_data_type"),
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.run": ("q", "k", "v", "out", "return_lse"),
    "prefill.BatchPrefillWithPagedKVCacheWrapper": (
        "float_workspace_buffer", "kv_layout", "backend"),
    "prefill.BatchPrefillWithPagedKVCacheWrapper.plan": (
        "qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
        "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size", "head_dim_vo", "causal",
        "logits_soft_cap", "sm_scale", "q_data_type", "kv_data_type"),
    "prefill.BatchPrefillWithPagedKVCacheWrapper.run": (
        "q", "paged_kv_cache", "out", "return_lse"),
    "top_k_ragged_transform": ("input", "offsets", "lengths", "k", "row_starts"),
}
# 0.7.x's structural MLA call (flashinfer-python 0.7.2.post1), where the installed library has
# its metadata type (STRUCTURAL_MLA): plan(metadata=MLAPlanMetadata.csr(...), ...) and
# run(query=, kv_cache=). 0.7.2 still takes the flat keywords above but warns that they "will
# be removed" (DeprecationWarning: flat plan metadata, mla/_batch_mla/_wrapper.py:585-597; the
# q_nope / q_pe / ckv_cache / kpe_cache run keywords, :968-987; the run-time LSE a flat plan
# allows, :1080-1091). These keywords replace the flat ones' entries in the signature check.
STRUCTURAL_MLA = "mla.MLAPlanMetadata"  # mla/_batch_mla/_contracts.py:37, flashinfer.mla's
STRUCTURAL_MLA_PARAMETERS: dict[str, tuple[str, ...]] = {
    f"{STRUCTURAL_MLA}.csr": ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"),
    "mla.BatchMLAPagedAttentionWrapper.plan": (
        "metadata", "num_heads", "head_dim_ckv", "head_dim_kpe", "page_size", "causal",
        "sm_scale", "q_data_type", "kv_data_type", "query_layout", "kv_cache_layout", "lse_mode"),
    "mla.BatchMLAPagedAttentionWrapper.run": ("query", "kv_cache", "out", "return_lse"),
}
# The run contract a structural plan declares (_wrapper.py:431-433; checked at run time by
# MLAInputContract.validate_run_options, _contracts.py:138-142): the flat form's own split
# layouts (its defaults, _wrapper.py:615-618), so run() gets the same two views per tensor, and
# the base-2 LSE that return_lse=True without return_lse_base_on_e asks for, which a flat plan
# (lse_mode "none") allowed only through its deprecated run-time path (_wrapper.py:1080-1091).
STRUCTURAL_MLA_CONTRACT = {"query_layout": "split", "kv_cache_layout": "split", "lse_mode": "base2"}
# What the verdict's implementation.flashinfer.api says ran (by structural_mla).
MLA_API = {
    True: "structural (MLAPlanMetadata, 0.7.x): plan(metadata=MLAPlanMetadata.csr(qo_indptr, "
          "kv_indptr, kv_indices, kv_len_arr), query_layout='split', kv_cache_layout='split', "
          "lse_mode='base2'), run(query=(q_nope, q_pe), kv_cache=(ckv, kpe), return_lse=True)",
    False: "flat (no MLAPlanMetadata, e.g. 0.2.14.post1): plan(qo_indptr=, kv_indptr=, "
           "kv_indices=, kv_len_arr=), run(q_nope=, q_pe=, ckv_cache=, kpe_cache=, "
           "return_lse=True)",
}
MLA_FUNCTIONS = (*(k for k in CALLED_PARAMETERS if k.startswith("mla.")),
                 f"{STRUCTURAL_MLA}.csr")
OP_FUNCTIONS: dict[str, tuple[str, ...]] = {
    Op.DECODE: MLA_FUNCTIONS,
    Op.SPARSE_DECODE: MLA_FUNCTIONS,
    Op.SPARSE_PREFILL: MLA_FUNCTIONS,
    Op.PREFILL: tuple(k for k in CALLED_PARAMETERS if k.startswith("prefill.BatchPrefillWithRagged")),
    Op.PAGED_PREFILL: tuple(k for k in CALLED_PARAMETERS if k.startswith("prefill.BatchPrefillWithPaged")),
    Op.TOPK: ("top_k_ragged_transform",),
}
# FP8 KV in the MLA decode (0.7.x): extra keywords of plan / run, used only when present.
FP8_PLAN_PARAMETER = "scale_mode"
FP8_RUN_PARAMETERS = ("ckv_scale", "kpe_scale")
FP8_KV_FORMAT = "fp8_e4m3fn"
FP8_REASONS = {  # versions whose MLA wrapper takes an FP8 KV cache (0.7.x)
    "format_pairs": "FlashInfer 0.7's MLA fa2/fa3: fp8_e4m3fn KV only under bf16 q, on sm_90 "
                    "(mla/_batch_mla/_backends/_fa_common.py:151-162, 0.7.2.post1)",
    "q_formats": "FlashInfer's MLA takes fp16 / bf16 q (_fa_common.py:136, 0.7.2.post1)",
    "kv_formats": "FlashInfer's MLA takes kv_data_type fp16 / bf16 / fp8_e4m3fn only "
                  "(supported_kv_dtypes, mla/_batch_mla/_backends/_fa_common.py:140, "
                  "0.7.2.post1); fnuz formats are AMD's",
}
NO_FP8_REASONS = {  # versions without (0.2.14.post1, measured on the H100)
    "q_formats": "no FP8 in this FlashInfer's MLA decode: the fa2 JIT fails to compile an "
                 "fp8 variant (measured with 0.2.14.post1)",
    "kv_formats": "no FP8 KV in this FlashInfer's MLA decode (the fa2 JIT fails to compile an "
                  "fp8 variant, measured with 0.2.14.post1; 0.7.x has one)",
}
# Both release lines: the MLA kernels take one page stride and one token stride per cache
# tensor, a token's channels contiguous; CK's vectorized pages interleave tokens inside each
# 16-byte channel group, which no such pair of strides describes.
DECODE_LAYOUT_REASON = ("FlashInfer's MLA reads ckv / kpe pages through a page stride and a token "
                        "stride only (*_stride_page / *_stride_n = stride(0) / stride(1): "
                        "csrc/batch_mla_run.cu:55-58 and batch_mla_sm90_run.cu:52-55 in "
                        "0.7.2.post1, :54-57 and :55-58 in 0.2.14.post1)")
# Paged prefill: pages [pages, page_size, heads, dim] (NHD) or [pages, heads, page_size, dim] (HND).
PAGED_LAYOUT_REASON = ("FlashInfer's paged KV cache is NHD / HND pages (TensorLayout, "
                       "flashinfer/utils.py:54-56, checked by _check_kv_layout :195-197, "
                       "0.7.2.post1)")
PREFILL_FP8_REASON = {  # 0.2.x, measured on the H100
    "q_formats": "'fp8 tensor core is not supported in fa2 backend' (0.2.14.post1, measured)",
    "kv_formats": "'fp8 tensor core is not supported in fa2 backend' (0.2.14.post1, measured)",
}
# FP8 KV in the ragged / paged prefill (0.7.x): run() keywords, used only when present. Read in
# flashinfer-python 0.7.2.post1 (flashinfer/prefill.py): the ragged run (l. 5881-5890) and the
# paged run (l. 4027-4034) take q_scale / k_scale / v_scale; with a 16-bit q over FP8 K/V, fa2 /
# fa3 fold k_scale into sm_scale (ragged l. 5997-6006, paged l. 4322-4326) and multiply the
# output by v_scale after the kernel, leaving the LSE as is (ragged l. 6466-6469, paged l. 4626-
# 4631). One float per tensor: per-token scales have no place there.
PREFILL_FP8_RUN_PARAMETERS = ("k_scale", "v_scale")
PREFILL_FP8_KV_PAIRS = (("bf16", FP8_KV_FORMAT), ("fp16", FP8_KV_FORMAT))
_FP8_Q_HEAD_DIMS = ("fa3's FP8 prefill (FP8 q and K/V) needs head_dim_qk == head_dim_vo: "
                    "static_assert in csrc/batch_prefill_fp8_sm90.cu:156 (ragged) and :268 (paged) "
                    "of 0.7.2.post1; MLA's are 192 / 128")
FP8_PREFILL_REASONS_07 = {  # by kernel; what 0.7.2.post1's sources refuse
    "fa2": {
        "q_formats": "FlashInfer's fa2 prefill has no FP8 q: 'fp8 tensor core is not supported in "
                     "fa2 backend' (flashinfer/jit/attention/modules.py:1042, and `assert not "
                     "is_float8(q)` in the paged run, prefill.py:837; 0.7.2.post1)",
        "kv_formats": "FlashInfer's FP8 is fp8_e4m3fn / fp8_e5m2 (is_float8, flashinfer/utils.py:"
                      "200); fnuz formats are AMD's",
        "format_pairs": "fa2 takes FP8 K/V under a 16-bit q only (flashinfer/prefill.py:5997)",
        "per_token_scales": "run() takes one k_scale / v_scale per tensor (a float folded into "
                            "sm_scale / multiplied into the output, flashinfer/prefill.py:6005, "
                            "6469)",
    },
    "fa3": {
        "q_formats": _FP8_Q_HEAD_DIMS,
        "kv_formats": "FlashInfer's FP8 is fp8_e4m3fn / fp8_e5m2 (flashinfer/utils.py:200); fa3 "
                      "takes FP8 K/V only under FP8 q ('FA3 FP8 KV cache currently requires "
                      "FP8 query', flashinfer/utils.py:492; the sm_90 QK GMMA is DTypeQ x DTypeKV, "
                      "include/flashinfer/attention/hopper/kernel_traits.cuh:76), and " + _FP8_Q_HEAD_DIMS,
    },
}
# FlashInfer's "infinity" is finite: math::inf = 5e4 (include/flashinfer/math.cuh). A row that
# sees no key (a request with kv_len 0, planned as zero-length work in MLAPlan) keeps m = -5e4
# (mla.cuh init_states_) and gets output 0 and LSE -5e4 + log2(d): measured on the H100 with
# 0.2.14.post1, -49999 (fa2) and -49998 (fa3), base 2. At or below NO_KEY_LSE_BASE2_AT_MOST on
# exactly those rows it is read as mlacheck's -inf; on the H100 the premerge top-k case with
# `valid_cap: 0` FAILed on it ("worst inf") before. 64 above -5e4 leaves room for d up to 2^64
# and is ~49900 below any LSE a row with keys can have.
NO_KEY_LSE_BASE2_AT_MOST = torch.tensor([-5e4 + 64])
# The last release line whose fa2 paged prefill requires identical K and V strides (read in
# 0.2.14.post1's csrc/batch_prefill.cu; 0.7.2's batch_prefill_paged.cuh takes unequal ones).
FA2_EQUAL_KV_STRIDES_UNTIL = (0, 2)

# 0.7.x's MLA plan() refuses, for causal batches, what FlashInfer 0.2.14 computes wrongly
# (docs/gpu-results.md finding 3): a query token cut by a q-row tile end whose last visible key
# starts a KV tile (`_validate_fa_causal_tile_bound`, mla/_batch_mla/_backends/_fa_common.py:
# 325-357 in 0.7.2.post1, raising _BackendPlanUnsupportedError "native execution would omit a
# visible key"). The installed library has that check when this module defines it.
FA_CAUSAL_TILE_CHECK = "mla._batch_mla._backends._fa_common._validate_fa_causal_tile_bound"
FA_TILE_Q = 64  # rows of a q tile, doubled when the batch's mean packed q rows pass it (:336)
FA3_TILE_KV = 64  # Hopper's KV tile, also on its FP8 path (:339-341)
FA2_FP8_TILE_KV = 32  # fa2 over an fp8_e4m3fn cache (:342-343)
# fa2 over a 16-bit cache: the KV tile by shared memory per SM, as mla.cuh's
# DISPATCH_SMEM_CONFIG chooses it (:344-347): (at least these bytes, tile); 16 below.
FA2_TILE_KV_BY_SMEM = ((221696, 64), (147968, 32))
FA2_SMALLEST_TILE_KV = 16
FA_CAUSAL_TILE_REASON = (
    "{version}'s MLA plan() refuses it: request {request}, query token {query} is cut by a "
    "{tile_q}-row q tile end and its last visible key {key} starts a {tile_kv}-key KV tile "
    "(_validate_fa_causal_tile_bound, mla/_batch_mla/_backends/_fa_common.py:325-357: \"native "
    "execution would omit a visible key\"; docs/gpu-results.md finding 3)")


def fa_kv_tile(kernel: str, kv_format: str, smem_per_sm: int | None) -> int | None:
    """The KV tile 0.7.x's causal check assumes (None: fa2 16-bit on a GPU of unknown shared
    memory, where this adapter cannot say; the library's own check still refuses)."""
    if kernel == "fa3":
        return FA3_TILE_KV
    if kv_format == FP8_KV_FORMAT:
        return FA2_FP8_TILE_KV
    if smem_per_sm is None:
        return None
    return next((t for at_least, t in FA2_TILE_KV_BY_SMEM if smem_per_sm >= at_least),
                FA2_SMALLEST_TILE_KV)


def fa_causal_tile_cut(q_lens: list[int], kv_lens: list[int], heads: int,
                       tile_kv: int) -> tuple[int, int, int, int] | None:
    """(request, query, key, tile_q) of the first causal tile cut 0.7.x's MLA plan refuses,
    else None. q rows are packed token-major (row = token * heads + head) per request."""
    tile_q = FA_TILE_Q * (2 if sum(q_lens) * heads // len(q_lens) > FA_TILE_Q else 1)
    if tile_q % heads == 0:  # tile ends fall between tokens
        return None
    for request, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        for end in range(tile_q, q_len * heads, tile_q):
            query, inside = divmod(end, heads)
            key = kv_len - q_len + query
            if inside and query < q_len and 0 <= key < kv_len and key % tile_kv == 0:
                return request, query, key, tile_q
    return None


def causal_tile_rule(version: str, kernel: str, smem_per_sm: int | None) -> CaseRule:
    """The decode capability rule that says 0.7.x's plan-time refusal before the call."""
    def rule(case: Case) -> str | None:
        tile_kv = fa_kv_tile(kernel, case.quant.kv, smem_per_sm)
        if tile_kv is None:
            return None
        reqs = case.requests  # type: ignore[union-attr]
        cut = fa_causal_tile_cut([r.q_len for r in reqs], [r.kv_len for r in reqs],
                                 case.num_heads, tile_kv)
        if cut is None:
            return None
        request, query, key, tile_q = cut
        return FA_CAUSAL_TILE_REASON.format(version=version, request=request, query=query,
                                            key=key, tile_q=tile_q, tile_kv=tile_kv)
    return rule


# mlacheck's DeepSeek-V3.2 sparse-path ops FlashInfer serves nowhere this adapter runs
# (sm_80 / sm_90), read in 0.7.2.post1 (and absent from 0.2.14.post1's flashinfer/): the
# FlashInfer function that would serve the op, the GPUs (compute capability) it has kernels
# for, and where that is written. On one of those GPUs the SKIP is this adapter's (not wired).
@dataclass(frozen=True)
class ArchOnlyKernel:
    function: str  # dotted name under `flashinfer`
    archs: tuple[tuple[int, int], ...]
    source: str


_PAGED_LOGITS = ArchOnlyKernel(
    "fp8_paged_mqa_logits", ((10, 0), (10, 3), (10, 7), (12, 0), (12, 1)),
    "FlashInfer's paged indexer logits are SM100 / SM103 / SM107 only (fp8_paged_mqa_logits: "
    "_PAGED_MQA_CCS = [100, 103, 107], attn_scores/attn_scores.py:759, enforced by "
    "@supported_compute_capability at :1455; \"for Blackwell (SM100/SM103) and Rubin (SM107)\", "
    ":1610; its experimental twin, paged_mqa.py:30, runs sm_100a / sm_103a only) and SM120 / "
    "SM121 (the b12x DSA indexer, experimental/b12x/_api.py:1)")
SPARSE_PATH_KERNELS: dict[str, ArchOnlyKernel] = {
    Op.MQA_LOGITS: ArchOnlyKernel(
        "dense_mqa.fp8_mqa_logits", ((10, 0), (10, 3)),
        "FlashInfer's dense indexer logits (the experimental fp8_mqa_logits, dense_mqa.py:47) "
        "are built for sm_100a / sm_103a only (_ARCHES, experimental/deepgemm_dense_mqa/"
        "dense_mqa.py:28)"),
    Op.PAGED_MQA_LOGITS: _PAGED_LOGITS,
    Op.SPARSE_PIPELINE: replace(
        _PAGED_LOGITS, source="the pipeline's first stage, the paged indexer logits: "
                              + _PAGED_LOGITS.source),
}
# No GPU has it: FlashInfer turns request-local positions into global slots only fused with
# the top-k selection, whose input is scores, not positions.
INDEX_CONVERSION_REASON = (
    "FlashInfer has no positions -> slots kernel: the page-table translation exists only fused "
    "into the top-k over scores (top_k_page_table_transform, topk.py:1077 in 0.7.2.post1; "
    "0.2.14.post1 has neither)")
# FlashInfer has no sparse MLA prefill entry point: mla_sparse_prefill runs through the
# sparse decode's page-size-1 composition, whose kernel returns out and LSE only.
SPARSE_PREFILL_COMPOSITION = (
    "sparse prefill as mla_sparse_decode's composition: the flat latent KV [N, 1, 576] as a "
    "page-size-1 pool (slot = row), every query token its own request over its own index list")
# The reason the judge shows for the max_logits it does not check (Output.metadata
# ["max_logits"]: a sparse prefill's max_logits may be left out only with one).
NO_MAX_LOGITS = ("not produced: BatchMLAPagedAttentionWrapper.run returns out, or (out, lse) "
                 "with return_lse (mla.py:459 in 0.2.14.post1; mla/_batch_mla/_wrapper.py:"
                 "891-893 in 0.7.2.post1): no max scaled score")
# topk_indices: 0.7.x's top_k_ragged_transform (topk.py:1330 in 0.7.2.post1), the top-k of each
# row's window [row_starts, row_starts + lengths) as positions relative to row_starts (plus
# offsets, 0 here), -1 past the window, int32 [rows, k]. Its radix and CUB paths have no arch
# requirement; only the clusters path is SM100 (can_use_clusters_topk). Older lines' top-k
# functions (0.2.14.post1's sampling.py:727, :1185, :1249) return samples, renormalised
# probabilities or masked logits, never the indices.
TOP_K_FUNCTION = OP_FUNCTIONS[Op.TOPK][0]
NO_TOP_K_REASON = ("{version} has no top-k index kernel: its top_k_sampling_from_probs / "
                   "top_k_renorm_probs / top_k_mask_logits (flashinfer/sampling.py:727, :1185, "
                   ":1249 in 0.2.14.post1) return samples, probabilities or masked logits, not "
                   "indices (top_k_ragged_transform came later: topk.py:1330 in 0.7.2.post1)")
# Every function of topk.py runs one JIT module, `topk`: get_topk_module() (topk.py:66-67) is
# gen_topk_module().build_and_load() (jit/topk.py:21). build_and_load loads it without
# compiling only from its AOT path (JitSpec.try_load, jit/core.py:536-570: `aot_artifacts`,
# flashinfer/data/aot/topk/topk.so, jit/env.py:296-300); otherwise it builds it (jit/core.py:
# 337-358), which on the H100 had not finished after 240 s and held a nightly's top-k items
# past its 600 s (a7167f4). So the adapter calls the top-k only where that module is prebuilt
# (mlacheck.tools.flashinfer_prebuild installs it); elsewhere the op is the machine's SKIP.
TOP_K_MODULE = "jit.topk.gen_topk_module"  # the generator, a dotted name under `flashinfer`
# A release whose top-k module generator is not where 0.7.x keeps it (jit/topk.py:21) has the
# kernel somewhere the adapter does not look: the adapter's omission, not the machine's.
TOP_K_GENERATOR_MOVED = adapter_choice(
    "{version}: the top-k module's generator flashinfer." + TOP_K_MODULE + " is not there "
    "({error}); the adapter loads FlashInfer's top-k only through it")
TOP_K_NOT_PREBUILT = machine_setup(
    "FlashInfer's top-k JIT module is not prebuilt here ({where}); building it takes ~16 "
    "minutes (cub_topk.cu's one nvcc run, measured: docs/flashinfer.md), not started inside "
    "an item (topk.py:66-67 builds it on first use; a7167f4): "
    "python -m mlacheck.tools.flashinfer_prebuild --topk-only (docs/flashinfer.md)")


def has_function(got: Loaded, dotted: str) -> bool:
    """`flashinfer.<dotted>` exists in the installed library (a submodule imported if need be)."""
    module, _, name = dotted.rpartition(".")
    try:
        owner = (importlib.import_module(f"{got.module.__name__}.{module}") if module
                 else got.module)
    except ImportError:
        return False
    return hasattr(owner, name)


def top_k_module_missing(got: Loaded) -> str | None:
    """None where FlashInfer's top-k module is installed as a prebuilt (AOT) module, else the
    machine's SKIP reason (TOP_K_MODULE): the spec's `aot_path` is where build_and_load looks
    first (and what build_jit_specs(skip_prebuilt=True) checks, jit/core.py:838)."""
    module, _, name = TOP_K_MODULE.rpartition(".")
    try:
        generator = getattr(importlib.import_module(f"{got.module.__name__}.{module}"), name)
    except (ImportError, AttributeError) as e:  # a release that moved it: the adapter's to follow
        return TOP_K_GENERATOR_MOVED.format(
            version=got.version, error=f"{type(e).__name__}: {e}"[:200])
    try:
        spec = generator()
        aot = spec.aot_path
    except Exception as e:  # noqa: BLE001 - the generator checks the GPU: a one-line reason
        return TOP_K_NOT_PREBUILT.format(where=f"{TOP_K_MODULE}: {type(e).__name__}: {e}"[:200])
    if not aot.exists():
        return TOP_K_NOT_PREBUILT.format(where=f"no {aot}")
    # A file that does not load (built for another CUDA, truncated) makes build_and_load fall
    # back to the JIT build inside the item (try_load, jit/core.py:536-570 in 0.7.2.post1):
    # load it here, once, through the same call.
    try_load = getattr(spec, "try_load", None)
    if try_load is not None:
        try:
            loaded = try_load()
        except Exception as e:  # noqa: BLE001 - the library's own error is the reason
            loaded, why = None, f": {type(e).__name__}: {e}"[:200]
        else:
            why = ""
        if loaded is None:
            return TOP_K_NOT_PREBUILT.format(
                where=f"{aot} is there but does not load (FlashInfer's try_load, "
                      f"jit/core.py:536-570){why}")
    return None


def gpu_arch() -> tuple[int, int] | None:
    """This machine's CUDA compute capability (None: no CUDA GPU)."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def smem_per_sm() -> int | None:
    """Shared memory per SM of this machine's GPU (None: no GPU, or a torch that does not say)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "shared_memory_per_multiprocessor", None)


def sparse_path_refusal(got: Loaded, kernel: ArchOnlyKernel, arch: tuple[int, int] | None
                        ) -> str:
    """Why an op of the sparse path is not run: the library's limit where it has no kernel for
    this GPU (or no such function), the adapter's choice on a GPU it has one for."""
    if not has_function(got, kernel.function):
        return f"{got.version} has no {kernel.function}: {kernel.source}"
    here = f"sm_{arch[0]}{arch[1]}" if arch else "no CUDA GPU"
    if arch in kernel.archs:
        return adapter_choice(f"{kernel.function} has a kernel for {here}; not wired")
    return f"{got.version}: {kernel.source}; none for this GPU ({here})"

# Measured on an H100 with flashinfer-python 0.2.14.post1 (benchmarks/capability_probe.py,
# docs/flashinfer.md): every page size 1..1024, 8..128 heads, MTP (uniform or mixed q_len),
# empty requests / segments, pools past 2^32 bytes, soft cap, pass; FP8 does not build
# (MLA decode: the fa2 JIT fails to compile an fp8 kv variant; ragged prefill: "fp8 tensor
# core is not supported in fa2 backend").
DECODE_FORMATS = ("bf16", "fp16")
PREFILL_FORMATS = ("bf16", "fp16")


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a 'flashinfer-python 0.7.2.post1' style version; (0, 0) if unreadable."""
    m = re.search(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def takes_fp8_kv(got: Loaded) -> bool:
    """The installed MLA wrapper takes an FP8 KV cache with per-tensor scales (0.7.x)."""
    try:
        plan = inspect.signature(got.function("mla.BatchMLAPagedAttentionWrapper.plan"))
        run = inspect.signature(got.function("mla.BatchMLAPagedAttentionWrapper.run"))
    except (AttributeError, TypeError, ValueError):
        return False
    return (FP8_PLAN_PARAMETER in plan.parameters
            and all(p in run.parameters for p in FP8_RUN_PARAMETERS))


def takes_fp8_kv_prefill(got: Loaded, op: str = Op.PREFILL) -> bool:
    """The installed prefill wrapper of `op` takes per-tensor k_scale / v_scale in run (0.7.x's
    ragged and paged; 0.2.14's paged run has them too, but its fa2 paged prefill is refused)."""
    run = next(f for f in OP_FUNCTIONS[op] if f.endswith(".run"))
    try:
        params = inspect.signature(got.function(run)).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return all(p in params for p in PREFILL_FP8_RUN_PARAMETERS)


def structural_mla(got: Loaded) -> bool:
    """The installed MLA wrapper is planned from an MLAPlanMetadata and run on structural
    query= / kv_cache= values (0.7.x; flashinfer.mla exports the type, mla/_core.py:2835 in
    0.7.2.post1); else (0.2.14.post1) the flat keywords are its only form."""
    return has_function(got, STRUCTURAL_MLA)


def load() -> Loaded | str:
    """Import FlashInfer and check the installed signatures; a one-line reason otherwise.
    The MLA wrapper is checked against the keywords of the call the adapter makes with it."""
    got = load_library(MODULE, distributions=DISTRIBUTIONS, install_hint=INSTALL_HINT,
                       called=CALLED_PARAMETERS, submodules=("mla", "prefill"))
    if isinstance(got, str) or not structural_mla(got):
        return got
    for qualname in STRUCTURAL_MLA_PARAMETERS:
        got.problems.pop(qualname, None)
    got.problems.update(signature_problems(got.function, MODULE, STRUCTURAL_MLA_PARAMETERS))
    return got


class FlashInferBackend(LibraryAdapter):
    """FlashInfer MLA decode + ragged prefill behind the backend contract."""

    def __init__(self, kernel: str = "fa2", name: str = "flashinfer") -> None:
        self.kernel = kernel  # FlashInfer's `backend` argument: fa2 or fa3
        self.name = name
        self._workspace: torch.Tensor | None = None
        self._top_k_setup: tuple[str | None] | None = None  # (top_k_module_missing,), once

    def import_library(self) -> Loaded | str:
        return load()

    def machine_refusal(self) -> str | None:
        return cuda_refusal("FlashInfer", 9 if self.kernel == "fa3" else None,
                            "the fa3 kernels need an sm_90 GPU (H100/H200)")

    # -- contract
    def capabilities(self) -> dict[str, Capability]:
        got = self.loaded()
        if isinstance(got, str):
            return {op: Capability(refusal=got) for op in OP_FUNCTIONS}
        same = {(f, f) for f in DECODE_FORMATS}
        decode_q, decode_kv, scales = DECODE_FORMATS, DECODE_FORMATS, None
        fp8_note, reasons = "", NO_FP8_REASONS
        if takes_fp8_kv(got):
            same.add(("bf16", FP8_KV_FORMAT))
            decode_kv, scales = (*DECODE_FORMATS, FP8_KV_FORMAT), ("unit", "amax")
            fp8_note = "; fp8_e4m3fn KV under bf16 q: scale_mode=kv-per-tensor, ckv/kpe_scale"
            reasons = FP8_REASONS
        problem = {op: got.first_problem(fns) for op, fns in OP_FUNCTIONS.items()}
        decode = dict(
            q_formats=decode_q, kv_formats=decode_kv, format_pairs=frozenset(same),
            scale_policies=scales, lse=True, empty_requests=True, devices=("cuda",),
            layouts=(layouts.LINEAR.name,),  # ckv / kpe are strided views of linear pages
            reasons={**reasons, "layouts": DECODE_LAYOUT_REASON})
        prefill = {op: self._prefill_formats(got, op) for op in (Op.PREFILL, Op.PAGED_PREFILL)}
        return {
            **self._sparse_path(got, problem[Op.TOPK]),
            Op.DECODE: Capability(
                **decode, causal=(True,), refusal=problem[Op.DECODE],
                rules=self._decode_rules(got),
                notes=f"BatchMLAPagedAttentionWrapper backend={self.kernel}; latent cache as "
                      "strided ckv/kpe views of mlacheck's pool; LSE base 2 -> natural" + fp8_note),
            Op.SPARSE_DECODE: Capability(
                **decode, refusal=problem[Op.SPARSE_DECODE],
                notes=f"BatchMLAPagedAttentionWrapper backend={self.kernel} at page size 1: the "
                      "pool viewed as flat tokens, one request per query token, its valid top-k "
                      "global slots as kv_indices, causal off; LSE base 2 -> natural" + fp8_note),
            Op.SPARSE_PREFILL: Capability(
                **decode, refusal=problem[Op.SPARSE_PREFILL],
                notes=f"BatchMLAPagedAttentionWrapper backend={self.kernel} at page size 1 over "
                      "the flat latent KV, one request per query token (mla_sparse_decode's "
                      "composition); out and LSE, no max_logits; LSE base 2 -> natural"),
            Op.PREFILL: Capability(
                **prefill[Op.PREFILL][0],
                soft_cap=True, lse=True, empty_requests=True, devices=("cuda",),
                refusal=problem[Op.PREFILL],
                notes=f"BatchPrefillWithRaggedKVCacheWrapper backend={self.kernel}, q/k 192, "
                      "v 128; LSE base 2 -> natural" + prefill[Op.PREFILL][1]),
            Op.PAGED_PREFILL: Capability(
                **prefill[Op.PAGED_PREFILL][0],
                soft_cap=True, lse=True, empty_requests=True, devices=("cuda",),
                layouts=(layouts.LINEAR.name,),
                refusal=problem[Op.PAGED_PREFILL] or self._paged_prefill_refusal(got),
                notes=f"BatchPrefillWithPagedKVCacheWrapper backend={self.kernel}, NHD, "
                      "head_dim_qk 192 / head_dim_vo 128 over mlacheck's K and V pools as they "
                      "are; LSE base 2 -> natural" + prefill[Op.PAGED_PREFILL][1]),
        }

    def _decode_rules(self, got: Loaded) -> tuple[CaseRule, ...]:
        """0.7.x's plan-time causal tile refusal, where the installed library makes it."""
        if not has_function(got, FA_CAUSAL_TILE_CHECK):
            return ()
        return (causal_tile_rule(got.version, self.kernel, smem_per_sm()),)

    def _sparse_path(self, got: Loaded, topk_problem: str | None) -> dict[str, Capability]:
        """The DeepSeek-V3.2 sparse-path ops: the top-k where the library has its kernel (0.7.x)
        and its module is prebuilt here, the others refused with the library's reason."""
        arch = gpu_arch()
        caps = {op: Capability(refusal=sparse_path_refusal(got, kernel, arch))
                for op, kernel in SPARSE_PATH_KERNELS.items()}
        caps[Op.INDEX_CONVERSION] = Capability(refusal=INDEX_CONVERSION_REASON)
        caps[Op.TOPK] = Capability(
            empty_requests=True, devices=("cuda",), refusal=self._topk_refusal(got, topk_problem),
            notes=f"{TOP_K_FUNCTION}: decode rows from column 0, prefill rows with row_starts = "
                  "each row's window start, offsets 0 (positions request-local); -1 past a "
                  "row's window; from the prebuilt top-k module only")
        return caps

    def _topk_refusal(self, got: Loaded, problem: str | None) -> str | None:
        """The library's (no top-k index kernel, a changed signature), else the machine's (its
        module not prebuilt: asked once per backend, the generator's spec is not free)."""
        if not has_function(got, TOP_K_FUNCTION):
            return NO_TOP_K_REASON.format(version=got.version)
        if problem:
            return problem
        if self._top_k_setup is None:
            self._top_k_setup = (top_k_module_missing(got),)
        return self._top_k_setup[0]

    def _prefill_formats(self, got: Loaded, op: str) -> tuple[dict[str, Any], str]:
        """The format fields of a prefill op's Capability (with their reasons) and a note: 16-bit
        only, plus fp8_e4m3fn K/V under a 16-bit q where the installed run() takes the scales
        (0.7.x) and the kernel has that path (fa2)."""
        same = [(f, f) for f in PREFILL_FORMATS]
        reasons: dict[str, str] = dict(PREFILL_FP8_REASON)
        if takes_fp8_kv_prefill(got, op):
            reasons = dict(FP8_PREFILL_REASONS_07[self.kernel])
        if op == Op.PAGED_PREFILL:
            reasons["layouts"] = PAGED_LAYOUT_REASON
        fields: dict[str, Any] = dict(q_formats=PREFILL_FORMATS, kv_formats=PREFILL_FORMATS,
                            format_pairs=frozenset(same), reasons=reasons)
        if self.kernel != "fa2" or not takes_fp8_kv_prefill(got, op):
            return fields, ""
        fields.update(kv_formats=(*PREFILL_FORMATS, FP8_KV_FORMAT),
                      format_pairs=frozenset(same + list(PREFILL_FP8_KV_PAIRS)))
        return fields, ("; fp8_e4m3fn K/V under a 16-bit q: per-tensor k_scale / v_scale in run "
                        "(FlashInfer folds k_scale into sm_scale and scales the output by v_scale)")

    def _paged_prefill_refusal(self, got: Loaded) -> str | None:
        if self.kernel == "fa3":  # measured on the H100: every paged case raised this error
            return (f"{got.version}: the sm_90 (fa3) paged prefill returns cudaErrorNotSupported "
                    "('operation not supported') unless head_dim_qk == head_dim_vo "
                    "(BatchPrefillWithPagedKVCacheDispatched, include/flashinfer/attention/"
                    "hopper/prefill_sm90.cuh:574 / :610 in 0.2.14.post1, :578 / :614 in "
                    "0.7.2.post1); MLA's are 192 and 128")
        if self.kernel == "fa2" and release(got.version) <= FA2_EQUAL_KV_STRIDES_UNTIL:
            return (f"{got.version}: the fa2 paged prefill requires identical K and V cache "
                    "strides ('k/v strides must be identical', csrc/batch_prefill.cu:243); K (192) "
                    "and V (128) pages never have them")
        return None

    def run(self, case: Case, inputs: Inputs) -> Output:
        got = self.loaded()
        if isinstance(got, str):
            raise RuntimeError(got)
        op_run = {Op.PREFILL: self._prefill, Op.PAGED_PREFILL: self._paged_prefill,
                  Op.DECODE: self._decode, Op.SPARSE_DECODE: self._sparse,
                  Op.SPARSE_PREFILL: self._sparse_prefill, Op.TOPK: self._topk}[case.op]
        out = op_run(got, case, inputs)  # type: ignore[operator]
        out.metadata.setdefault("flashinfer", {}).update(version=got.version, kernel=self.kernel)
        return out

    # -- internals
    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _mla(self, got: Loaded, case: DecodeCase | SparseDecodeCase, inputs: DecodeInputs, *,
             qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_lens: torch.Tensor, cache: torch.Tensor, page_size: int, causal: bool) -> Output:
        """One plan + run of the MLA wrapper; cache [pages, page_size, 576] (views of the pool)."""
        dev = inputs.device
        rank = case.dims.kv_lora_rank
        wrapper = got.function("mla.BatchMLAPagedAttentionWrapper")(
            float_workspace_buffer=self._workspace_on(dev), use_cuda_graph=False,
            backend=self.kernel)
        q = inputs.q.stored
        fp8_kv = case.quant.kv == FP8_KV_FORMAT
        plan_extra: dict[str, str] = {FP8_PLAN_PARAMETER: "kv-per-tensor"} if fp8_kv else {}
        table = dict(  # the page table, as FlashInfer's CSR metadata
            qo_indptr=qo_indptr.to(dev, torch.int32), kv_indptr=kv_indptr.to(dev, torch.int32),
            kv_indices=kv_indices.to(dev, torch.int32), kv_len_arr=kv_lens.to(dev, torch.int32))
        plan = dict(
            num_heads=case.num_heads, head_dim_ckv=rank, head_dim_kpe=case.dims.qk_rope,
            page_size=page_size, causal=causal, sm_scale=case.softmax_scale,
            q_data_type=q.dtype, kv_data_type=cache.dtype, **plan_extra)
        run_extra: dict[str, float] = {}
        if fp8_kv:  # the pool's per-tensor dequantisation scale, for both parts of the latent
            scale = float(inputs.pool.scale.reshape(-1)[0])
            run_extra = dict.fromkeys(FP8_RUN_PARAMETERS, scale)
        # q [T, H, 576] and the cache [pages, page_size, 576] as (no-PE, PE) views: no copy
        query, kv_cache = (q[..., :rank], q[..., rank:]), (cache[..., :rank], cache[..., rank:])
        structural = structural_mla(got)
        if structural:
            # 0.7.2.post1's canonical form: plan(*, metadata=, ..., query_layout=,
            # kv_cache_layout=, lse_mode=) (mla/_batch_mla/_wrapper.py:317-342), the metadata
            # from MLAPlanMetadata.csr(qo_indptr, kv_indptr, kv_indices, kv_len_arr)
            # (_contracts.py:50-63); run(*, query=, kv_cache=, out=, return_lse=True, ...)
            # (_wrapper.py:773-794), split pairs (not deprecated, :899-906). The fa2 / fa3
            # backend gets the same four tensors and plan values as from the flat form
            # (_backends/_fa_common.py:933-949, :994-1009).
            wrapper.plan(metadata=got.function(f"{STRUCTURAL_MLA}.csr")(**table), **plan,
                         **STRUCTURAL_MLA_CONTRACT)
            out, lse = wrapper.run(query=query, kv_cache=kv_cache, out=inputs.out.out,
                                   return_lse=True, **run_extra)
        else:
            wrapper.plan(**table, **plan)
            out, lse = wrapper.run(q_nope=query[0], q_pe=query[1], ckv_cache=kv_cache[0],
                                   kpe_cache=kv_cache[1], out=inputs.out.out, return_lse=True,
                                   **run_extra)
        lse = lse_tokens_heads(lse_natural(lse, LSE_BASE), case.total_q, case.num_heads)
        no_key = torch.repeat_interleave(kv_lens == 0, qo_indptr.diff().to(kv_lens.device))
        if bool(no_key.any()):
            lse = lse_empty_rows(lse, no_key, at_most=float(
                lse_natural(NO_KEY_LSE_BASE2_AT_MOST, LSE_BASE)))
        return Output(out, lse, wrote_into_guarded=out.data_ptr() == inputs.out.out.data_ptr(),
                      metadata={"flashinfer": {"api": MLA_API[structural]}})

    def _decode(self, got: Loaded, case: DecodeCase, inputs: DecodeInputs) -> Output:
        kv_indptr, kv_indices, kv_lens = inputs.table.to_flashinfer()
        return self._mla(got, case, inputs, qo_indptr=inputs.qo_indptr, kv_indptr=kv_indptr,
                         kv_indices=kv_indices, kv_lens=kv_lens,
                         cache=inputs.pool.data[:, :, 0, :],  # [pages, page_size, 576]: a view
                         page_size=case.page_size, causal=True)

    def _sparse(self, got: Loaded, case: SparseDecodeCase, inputs: DecodeInputs) -> Output:
        assert inputs.topk_indices is not None
        slots = topk_to_global_slots(inputs.topk_indices, inputs.qo_indptr, inputs.table)
        valid = slots >= 0
        kv_lens = valid.sum(dim=1).to(torch.int32)  # [T]: one request per query token
        kv_indptr = torch.zeros(case.total_q + 1, dtype=torch.int32, device=slots.device)
        kv_indptr[1:] = torch.cumsum(kv_lens, 0)
        pool = inputs.pool.data
        flat = pool.view(pool.shape[0] * pool.shape[1], 1, pool.shape[3])  # same bytes, page 1
        out = self._mla(got, case, inputs,
                        qo_indptr=torch.arange(case.total_q + 1, dtype=torch.int32),
                        kv_indptr=kv_indptr, kv_indices=slots[valid], kv_lens=kv_lens,
                        cache=flat, page_size=1, causal=False)
        out.metadata["flashinfer"]["view"] = (
            f"top-k as paged attention at page size 1: the pool {tuple(pool.shape)} viewed as "
            f"{tuple(flat.shape)} tokens (no copy); one request per query token "
            f"({case.total_q}), kv_indices = its valid top-k global slots, causal off")
        return out

    def _sparse_prefill(self, got: Loaded, case: SparsePrefillCase,
                        inputs: SparsePrefillInputs) -> Output:
        out = self._sparse(got, *inputs.as_sparse_decode())
        out.metadata["flashinfer"]["composition"] = SPARSE_PREFILL_COMPOSITION
        out.metadata["max_logits"] = NO_MAX_LOGITS
        return out

    def _topk(self, got: Loaded, case: TopkCase, inputs: TopkInputs) -> Output:
        """top_k_ragged_transform over mlacheck's FP32 logit rows (pipeline_inputs.TopkInputs):
        each row's window is [k_start, k_end); the prefill form's batch-wide rows start their
        window at the request's first column, so positions relative to it are request-local."""
        lengths = inputs.lengths.to(torch.int32).contiguous()
        prefill = case.form == "prefill"
        out = got.function(TOP_K_FUNCTION)(
            input=inputs.logits.contiguous(), offsets=torch.zeros_like(lengths), lengths=lengths,
            k=case.topk,
            row_starts=inputs.k_start.to(torch.int32).contiguous() if prefill else None)
        return Output(out, metadata={"flashinfer": {"topk": (
            f"{TOP_K_FUNCTION}, {'row_starts = window starts' if prefill else 'rows from 0'}, "
            "offsets 0, prebuilt module")}})

    def _prefill(self, got: Loaded, case: PrefillCase, inputs: PrefillInputs) -> Output:
        dev = inputs.device
        d = case.dims
        wrapper = got.function("prefill.BatchPrefillWithRaggedKVCacheWrapper")(
            float_workspace_buffer=self._workspace_on(dev), kv_layout="NHD", backend=self.kernel)
        q, k, v = inputs.q.stored, inputs.k.stored, inputs.v.stored
        wrapper.plan(
            qo_indptr=inputs.cu_seqlens_q.to(dev, torch.int32),
            kv_indptr=inputs.cu_seqlens_k.to(dev, torch.int32),
            num_qo_heads=case.num_heads, num_kv_heads=case.num_heads, head_dim_qk=d.qk_head,
            head_dim_vo=d.v_head, causal=case.causal,
            logits_soft_cap=case.soft_cap if case.soft_cap > 0 else None,
            sm_scale=case.softmax_scale, q_data_type=q.dtype, kv_data_type=k.dtype)
        scales = kv_scales(k, inputs.k.scale, inputs.v.scale)
        out, lse = wrapper.run(q=q, k=k, v=v, out=inputs.out.out, return_lse=True, **scales)
        lse = lse_tokens_heads(lse_natural(lse, LSE_BASE), case.total_q, case.num_heads)
        return _with_scales(Output(out, lse if case.return_lse else None,
                                   wrote_into_guarded=out.data_ptr() == inputs.out.out.data_ptr()),
                            scales)

    def _paged_prefill(self, got: Loaded, case: PrefillCase, inputs: PrefillInputs) -> Output:
        assert inputs.k_pool is not None and inputs.v_pool is not None
        dev = inputs.device
        d = case.dims
        table = inputs.k_pool.table  # K and V pools share it (inputs.build)
        kv_indptr, kv_indices, _ = table.to_flashinfer()
        wrapper = got.function("prefill.BatchPrefillWithPagedKVCacheWrapper")(
            float_workspace_buffer=self._workspace_on(dev), kv_layout="NHD", backend=self.kernel)
        q, k_cache, v_cache = inputs.q.stored, inputs.k_pool.data, inputs.v_pool.data
        wrapper.plan(
            qo_indptr=inputs.cu_seqlens_q.to(dev, torch.int32), paged_kv_indptr=kv_indptr.to(dev),
            paged_kv_indices=kv_indices.to(dev),
            paged_kv_last_page_len=table.last_page_lens.to(dev, torch.int32),
            num_qo_heads=case.num_heads, num_kv_heads=case.num_heads, head_dim_qk=d.qk_head,
            page_size=table.page_size, head_dim_vo=d.v_head, causal=case.causal,
            logits_soft_cap=case.soft_cap if case.soft_cap > 0 else None,
            sm_scale=case.softmax_scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        scales = kv_scales(k_cache, inputs.k_pool.scale, inputs.v_pool.scale)
        out, lse = wrapper.run(q=q, paged_kv_cache=(k_cache, v_cache), out=inputs.out.out,
                               return_lse=True, **scales)
        lse = lse_tokens_heads(lse_natural(lse, LSE_BASE), case.total_q, case.num_heads)
        return _with_scales(Output(out, lse if case.return_lse else None,
                                   wrote_into_guarded=out.data_ptr() == inputs.out.out.data_ptr()),
                            scales)


def kv_scales(k: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> dict[str, float]:
    """The prefill run()'s FP8 keywords: each per-tensor dequantisation scale as the float
    FlashInfer takes (none for a 16-bit K/V; a per-token scale raises: one float per tensor)."""
    if k.element_size() != 1:
        return {}
    return dict(zip(PREFILL_FP8_RUN_PARAMETERS, (float(k_scale), float(v_scale)), strict=True))


def _with_scales(out: Output, scales: dict[str, float]) -> Output:
    if scales:
        out.metadata.setdefault("flashinfer", {})["kv_scales"] = scales
    return out


def factory() -> FlashInferBackend:
    return FlashInferBackend("fa2", "flashinfer")


def fa3_factory() -> FlashInferBackend:
    return FlashInferBackend("fa3", "flashinfer-fa3")
