"""Model of `aiter.mla`: `mla_decode_fwd` (persistent and split-KV) and `mla_prefill_ps_fwd`.

Control flow, buffer shapes, head folding and return values follow aiter/mla.py at the
modelled commit; the asm kernels are replaced by `_kernels` (stage 1), `_ps` (FP8 prefill)
and `_reduce` (mla_reduce_v1). Buffers AITER allocates with torch.empty are NaN-filled here,
so whatever a path leaves unwritten (an LSE AITER does not produce) shows as NaN:
- persistent decode: the final LSE of unsplit works comes from stage 1, of split tiles from the
  reduce (on gfx942 only fp8 64-head q_len-1 has persistent LSE kernels: return_lse raises
  AITER's "cannot get heuristic kernel" elsewhere);
- split-KV decode: stage 1 writes no final LSE, the merge does; with one split (or the Triton
  merge's copy-only path) it stays NaN, which is why callers force >= 2 splits for an LSE;
- FP8 prefill at AITER main: the returned LSE is the partial buffer (see mla_prefill_ps_fwd).
Heads 32..128 (step 16) that a chip does not take natively are folded into groups of 16, and
for q_len > 1 the caller's `o` is repointed (Tensor.set_) at the unfolded result, as AITER
does: the memory passed in keeps the folded layout.
"""

from __future__ import annotations

import os

import torch

from mlacheck.backends.aiter import rules
from mlacheck.backends.aiter_model._common import (
    cdiv,
    experimental_enabled,
    lse_fix,
)
from mlacheck.backends.aiter_model._kernels import mla_decode_stage1_asm_fwd
from mlacheck.backends.aiter_model._metadata import get_mla_decode_fwd_max_splits
from mlacheck.backends.aiter_model._ps import mla_prefill_ps_asm_fwd
from mlacheck.backends.aiter_model._reduce import mla_reduce_v1
from mlacheck.backends.aiter_model.dtypes import chip_fp8
from mlacheck.backends.aiter_model.jit.utils.chip_info import get_cu_num, get_gfx
from mlacheck.backends.numerics import merge_partials

PERSISTENT_MAX_BATCH_ENV = "AITER_MLA_DECODE_PERSISTENT_MAX_BATCH"
PERSISTENT_MAX_BATCH_DEFAULT = 32  # gfx950 bf16 16-head q_len-1 decode drops metadata at >= 32
PREFILL_TILE_Q = 256  # mla_prefill_ps_fwd's query tile (rows per partial tile)
# get_meta_param's smallest KV block per split for FP8 q, by packed query rows (heads x q_len)
FP8_MIN_BLOCK_N = {8: 64, 16: 128, 24: 128, 32: 128, 48: 64, 64: 64, 128: 32, 256: 32,
                   384: 32, 512: 32}
MERGE_GRANULE_SMALL_HEADS = 64  # stage-2 merge granularity (mgc) for 8/16 heads, q_len 1
MERGE_GRANULE_DEFAULT = 16
MERGE_GRANULE_WIDE = 32  # 128-head fp8, 64-head bf16 q_len 1


def _nan(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32, device=device)


def get_meta_param(
    num_kv_splits: int | None,
    bs: int,
    total_kv: int,
    nhead: int,
    max_seqlen_q: int,
    dtype: torch.dtype,
    tg_factor: int = 1,
    ignore_total_kv: int = 0,
) -> tuple[int, torch.Tensor]:
    """Split count and uniform split indptr of non-persistent decode (model of AITER's)."""
    if num_kv_splits is None:
        cu = get_cu_num()
        avg_kv = total_kv / bs
        wg_per_split = 2 if nhead == 128 and get_gfx() == "gfx1250" else 1
        bs_occ = bs * max(tg_factor, wg_per_split)
        scores = []
        for i in range(1, rules.MAX_SPLIT_SEARCH + 1):
            occupancy = bs_occ * i / ((bs_occ * i + cu - 1) // cu * cu)
            if not ignore_total_kv:
                occupancy *= avg_kv / (avg_kv + rules.SPLIT_OVERHEAD * i)
            scores.append((occupancy, i))
        num_kv_splits = max(scores, key=lambda x: x[0])[1]
    if dtype == chip_fp8() and not ignore_total_kv:
        min_block_n = FP8_MIN_BLOCK_N[int(nhead * max_seqlen_q)]
        num_kv_splits = min(num_kv_splits, (total_kv + bs * min_block_n - 1) // (bs * min_block_n))
        if num_kv_splits > 1:
            num_kv_splits = min(num_kv_splits,
                                int(abs(total_kv / bs - max_seqlen_q) // min_block_n) + 1)
    indptr = torch.arange(0, (bs + 1) * num_kv_splits, num_kv_splits, dtype=torch.int)
    return num_kv_splits, indptr


def _use_persistent_mla_decode(bs: int, nhead: int, max_seqlen_q: int, q_dtype: torch.dtype,
                               kv_dtype: torch.dtype) -> bool:
    """AITER drops the persistent metadata for gfx950 bf16 16-head q_len-1 decode at large
    batch (env AITER_MLA_DECODE_PERSISTENT_MAX_BATCH, <= 0 disables the gate)."""
    profile = (get_gfx() == "gfx950" and q_dtype == torch.bfloat16
               and kv_dtype == torch.bfloat16 and nhead == 16 and max_seqlen_q == 1)
    if not profile:
        return True
    try:
        max_batch = int(os.getenv(PERSISTENT_MAX_BATCH_ENV, PERSISTENT_MAX_BATCH_DEFAULT))
    except (TypeError, ValueError):
        max_batch = PERSISTENT_MAX_BATCH_DEFAULT
    return max_batch <= 0 or bs < max_batch


def mla_decode_fwd(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    max_seqlen_q: int,
    page_size: int = 1,
    nhead_kv: int = 1,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    num_kv_splits: int | None = None,
    num_kv_splits_indptr: torch.Tensor | None = None,
    work_meta_data: torch.Tensor | None = None,
    work_indptr: torch.Tensor | None = None,
    work_info_set: torch.Tensor | None = None,
    reduce_indptr: torch.Tensor | None = None,
    reduce_final_map: torch.Tensor | None = None,
    reduce_partial_map: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    intra_batch_mode: bool = False,
    return_logits: bool = False,
    return_lse: bool = False,
    g_kv_indptr: torch.Tensor | None = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed MLA decode into `o` (model). Returns (logits, final_lse) like AITER: the fp32
    split partials and the [T, H] LSE (None unless return_lse; see the branches for when it
    is left unwritten)."""
    device = q.device
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    qk_head_dim = q.shape[-1] if kv_buffer.dtype == torch.uint8 else kv_buffer.shape[3]
    if sm_scale is None:
        sm_scale = 1.0 / (qk_head_dim**0.5)
    ori_total_s, ori_nhead, _ = o.shape
    total_s, nhead, v_head_dim = o.shape
    bs = qo_indptr.shape[0] - 1
    total_kv = kv_indices.shape[0]
    fp8 = chip_fp8()

    persistent = work_meta_data is not None
    if persistent and num_kv_splits is None:
        persistent = _use_persistent_mla_decode(bs, nhead, max_seqlen_q, q.dtype, kv_buffer.dtype)

    if not persistent:
        return _decode_split_kv(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices,
                                kv_last_page_lens, max_seqlen_q, page_size, nhead_kv, sm_scale,
                                num_kv_splits, num_kv_splits_indptr, q_scale, kv_scale,
                                return_lse, causal, bs, total_kv)

    if num_kv_splits is None:
        num_kv_splits = get_mla_decode_fwd_max_splits(ori_nhead, max_seqlen_q, q.dtype,
                                                      kv_buffer.dtype)
    folded = False
    o_orig = o
    if rules.natively_supported(get_gfx(), nhead, max_seqlen_q, q.dtype == fp8,
                                 kv_buffer.dtype == fp8, experimental_enabled()):
        pass
    elif nhead in rules.FOLDABLE_HEADS:
        fold = ori_nhead // rules.FOLD_HEADS
        nhead = rules.FOLD_HEADS
        total_s = ori_total_s * fold
        if max_seqlen_q == 1:
            q = q.view(total_s, nhead, -1)
        else:
            q = (q.reshape(ori_total_s // max_seqlen_q, max_seqlen_q, fold, nhead, -1)
                 .permute(0, 2, 1, 3, 4).reshape(total_s, nhead, -1))
        o = o.view(total_s, nhead, -1)
        folded = True
    else:
        raise AssertionError(f"{nhead=} and {max_seqlen_q=} not supported")

    assert reduce_partial_map is not None
    rows = reduce_partial_map.size(0) * max_seqlen_q
    logits = _nan((rows, 1, nhead, v_head_dim), device)
    attn_lse = _nan((rows, 1, nhead, 1), device)
    final_lse = _nan((total_s, nhead), device) if return_lse else None
    mla_decode_stage1_asm_fwd(
        q, kv_buffer, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, num_kv_splits_indptr,
        work_meta_data, work_indptr, work_info_set, max_seqlen_q, page_size, nhead_kv, sm_scale,
        logits, attn_lse, o, final_lse, q_scale, kv_scale, g_kv_indptr, cp_world_size, cp_rank,
        None, 0, causal)
    assert reduce_indptr is not None
    mla_reduce_v1(logits, attn_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                  max_seqlen_q, num_kv_splits, o, final_lse)

    if folded:
        if return_logits:
            logits = logits.view(-1, 1, ori_nhead, v_head_dim)
        if max_seqlen_q == 1:
            o = o.view(ori_total_s, ori_nhead, -1)
            if final_lse is not None:
                final_lse = final_lse.view(ori_total_s, ori_nhead)
        else:
            fold = ori_nhead // nhead
            new_o = (o.reshape(ori_total_s // max_seqlen_q, fold, max_seqlen_q, nhead, -1)
                     .permute(0, 2, 1, 3, 4).reshape(ori_total_s, ori_nhead, -1).contiguous())
            # AITER repoints the caller's tensor at the unfolded copy (Tensor.set_): the
            # memory the caller passed keeps the folded layout.
            o_orig.set_(new_o)
            if final_lse is not None:
                final_lse = (final_lse.reshape(ori_total_s // max_seqlen_q, fold, max_seqlen_q,
                                               nhead)
                             .permute(0, 2, 1, 3).reshape(ori_total_s, ori_nhead).contiguous())
    return logits, final_lse


def _decode_split_kv(
    q: torch.Tensor, kv_buffer: torch.Tensor, o: torch.Tensor, qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_lens: torch.Tensor,
    max_seqlen_q: int, page_size: int, nhead_kv: int, sm_scale: float,
    num_kv_splits: int | None, num_kv_splits_indptr: torch.Tensor | None,
    q_scale: torch.Tensor | None, kv_scale: torch.Tensor | None, return_lse: bool,
    causal: bool, bs: int, total_kv: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Non-persistent decode: stage 1 per (request, split), then the Triton-style merge."""
    device = q.device
    total_s, nhead, v_head_dim = o.shape
    fp8 = chip_fp8()
    q_fp8, kv_fp8 = q.dtype == fp8, kv_buffer.dtype == fp8
    if num_kv_splits is None or num_kv_splits_indptr is None:
        num_kv_splits, num_kv_splits_indptr = get_meta_param(
            num_kv_splits, bs, total_kv, nhead, max_seqlen_q, q.dtype)
    small = nhead in (8, 16) and (max_seqlen_q == 1 or (nhead == 8 and max_seqlen_q == 2))
    mgc = MERGE_GRANULE_SMALL_HEADS if small else MERGE_GRANULE_DEFAULT
    if (nhead == 128 and q_fp8 and kv_fp8) or (
            nhead == 64 and q.dtype == kv_buffer.dtype == torch.bfloat16 and max_seqlen_q == 1):
        mgc = MERGE_GRANULE_WIDE
    maybe_final_out = not (nhead in (8, 16) and max_seqlen_q == 1)
    bf16_both = q.dtype == torch.bfloat16 and kv_buffer.dtype == torch.bfloat16
    direct = num_kv_splits == 1 and (
        q_fp8 or (q.dtype == torch.bfloat16 and max_seqlen_q == 4)
        or (bf16_both and nhead == 32) or (bf16_both and nhead == 8))
    if direct:  # one split written straight into o (bf16)
        logits = o.view((total_s, num_kv_splits, nhead, v_head_dim))
    else:
        logits = _nan((total_s, num_kv_splits, nhead, v_head_dim), device)
    attn_lse = _nan((total_s, num_kv_splits, nhead, 1), device)
    # The non-persistent stage 1 does not write the final LSE (vLLM forces >= 2 splits for
    # fp8 to get one): it stays NaN unless the merge below writes it.
    final_lse = _nan((total_s, nhead), device) if return_lse else None
    mla_decode_stage1_asm_fwd(
        q, kv_buffer, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, num_kv_splits_indptr,
        None, None, None, max_seqlen_q, page_size, nhead_kv, sm_scale, logits, attn_lse, o,
        final_lse, q_scale, kv_scale, None, 1, 0, None, int(num_kv_splits > 1), causal)
    if direct:
        return logits.view(total_s, nhead, v_head_dim), (final_lse if return_lse else attn_lse)
    _merge_splits(logits, attn_lse, o, final_lse, qo_indptr, kv_indptr, kv_last_page_lens,
                  num_kv_splits_indptr, page_size, mgc, maybe_final_out)
    return logits, final_lse


def _merge_splits(logits: torch.Tensor, attn_lse: torch.Tensor, o: torch.Tensor,
                  final_lse: torch.Tensor | None, qo_indptr: torch.Tensor,
                  kv_indptr: torch.Tensor, kv_last_page_lens: torch.Tensor,
                  splits_indptr: torch.Tensor, page_size: int, mgc: int,
                  maybe_final_out: bool) -> None:
    """The stage-2 merge: per request, the first min(splits, ceil(kv_len / mgc)) splits."""
    qo = [int(x) for x in qo_indptr.tolist()]
    kv = [int(x) for x in kv_indptr.tolist()]
    last = [int(x) for x in kv_last_page_lens.tolist()]
    sp = [int(x) for x in splits_indptr.tolist()]
    bs = len(qo) - 1
    final_out = maybe_final_out and sp[bs] == bs  # every request has one split: a copy
    for b in range(bs):
        qs, qe = qo[b], qo[b + 1]
        kv_len = kv[b + 1] - kv[b]
        if page_size > 1:
            kv_len = (kv_len - 1) * page_size + last[b]
        if final_out:
            o[qs:qe] = logits[qs:qe, 0].to(o.dtype)
            continue
        n = min(sp[b + 1] - sp[b], cdiv(kv_len, mgc))
        outs = logits[qs:qe, :n].transpose(0, 1)  # [n, rows, H, Dv]
        lses = attn_lse[qs:qe, :n, :, 0].transpose(0, 1)
        out, lse = merge_partials(outs, lses)
        o[qs:qe] = out.to(o.dtype)
        if final_lse is not None:
            final_lse[qs:qe] = lse


def mla_prefill_ps_fwd(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    output: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    work_indptr: torch.Tensor | None,
    work_info_set: torch.Tensor | None,
    max_seqlen_q: int,
    is_causal: bool,
    reduce_indptr: torch.Tensor | None = None,
    reduce_final_map: torch.Tensor | None = None,
    reduce_partial_map: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 persistent prefill into `output` (model). Returns (output, LSE): at AITER main
    the LSE returned is the partial-LSE buffer [partial rows, H] (only split tiles' rows are
    written, the rest NaN here), with ROCm/aiter#3606 (MLACHECK_AITER_MODEL_REVISION=pr3606)
    the final [T, H] LSE. softmax_scale defaults to 1/sqrt(v_head_dim) like AITER's."""
    device = Q.device
    total_s, nhead, v_head_dim = output.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / (v_head_dim**0.5)
    assert reduce_partial_map is not None and reduce_indptr is not None
    rows = reduce_partial_map.size(0) * PREFILL_TILE_Q
    logits = _nan((rows, nhead, v_head_dim), device)
    attn_lse = _nan((rows, nhead), device)
    final_lse = _nan((total_s, nhead), device)
    mla_prefill_ps_asm_fwd(Q, K, V, qo_indptr, kv_indptr, kv_page_indices, work_indptr,
                           work_info_set, max_seqlen_q, softmax_scale, is_causal, logits,
                           attn_lse, output, q_scale, k_scale, v_scale)
    mla_reduce_v1(logits, attn_lse, reduce_indptr, reduce_final_map, reduce_partial_map,
                  PREFILL_TILE_Q, 0, output, final_lse)
    return output.view(total_s, nhead, v_head_dim), (final_lse if lse_fix() else attn_lse)
