"""Model of `aiter.mha_batch_prefill_func` (CK batch prefill over a paged K/V cache).

Layouts (by K/V ndim): 4-D linear [pages, page_size, H_kv, D], 3-D linear [tokens, H_kv, D]
(page size 1) and 5-D vectorized K [pages, H_kv, D/vec, page_size, vec], V [pages, H_kv,
page_size/vec, D, vec] with vec = 16 bytes / element size. Page table: kv_indptr (page
cumsum) + kv_page_indices + kv_last_page_lens (required for page_size > 1), or block_table
[B, max_pages] + seqlen_k [B]. FP8 q/k/v (one dtype, bf16 output) with per-tensor
q/k/v_descale or q_descale + kv_block_descale [pages, H_kv, 2]. Causal is bottom-right per
request (max_seqlen_q == 1 makes it a no-op); logits_soft_cap > 0 applies cap*tanh(s/cap)
after the scale. LSE is [H, total_q], natural log of the scaled logits.

Numerics: mlacheck's flash_attend (fp32 scores from the stored values, 64-token online
softmax, P rounded to the input format before PV, fp32 accumulation). Not modelled (raise
NotImplementedError): dropout, alibi, sinks, sliding windows, the rational soft-cap variant.
As in AITER, the 3-D layout is refused when K's and V's head sizes differ (its Python check
compares dim 2 of K and V), so MLA's 192 / 128 needs the 4-D layout even with one-token pages.
"""

from __future__ import annotations

import torch

from mlacheck import fp8
from mlacheck.backends.aiter_model._common import (
    as_chip_values,
    check,
    is_fp8_dtype,
    p_format_for,
    scalar_scale,
)
from mlacheck.backends.numerics import flash_attend

VECTOR_BYTES = 16  # CK loads 16-byte vectors: vec = 16 // element size
MAX_HEAD_DIM = 256  # CK batch prefill head-size limit
KV_BLOCK_DESCALE_PAIR = 2  # kv_block_descale[..., 0] = K descale, [..., 1] = V descale


def mha_batch_prefill_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    logits_soft_cap: float = 0.0,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_attn_probs: bool = False,
    out: torch.Tensor | None = None,
    kv_last_page_lens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    seqlen_k: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    kv_block_descale: torch.Tensor | None = None,
    sink_ptr: torch.Tensor | None = None,
    sink_size: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Paged varlen prefill (model). Returns out, or (out, lse[, probs]) like AITER."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    if dropout_p > 0 or alibi_slopes is not None or sink_ptr is not None or sink_size:
        raise NotImplementedError("the AITER model does not model dropout, alibi or sinks")
    vec = VECTOR_BYTES // k.element_size()
    vectorized = k.dim() == 5 and v.dim() == 5
    linear = (k.dim() == 4 and v.dim() == 4) or (k.dim() == 3 and v.dim() == 3)
    if not (vectorized or linear):
        raise ValueError("Batch prefill requires 5D vectorized, 4D linear, or 3D linear "
                         "(page_size=1) K/V tensors")
    d_q = q.shape[-1]
    d_v = v.shape[-2] if vectorized else v.shape[-1]
    if d_q % vec or d_v % vec:
        raise ValueError("Batch prefill requires head size divisible by vector size")
    if vectorized:
        if k.shape[-3] * vec != d_q:
            raise ValueError("K vectorized layout does not match Q head size")
        if k.shape[-2] % vec:
            raise ValueError("Vectorized KV requires page size divisible by vector size")
        if v.shape[-1] != vec:
            raise ValueError("Vectorized KV requires last dim equal to vector size")
    else:
        if k.shape[-1] != d_q:
            raise ValueError("K linear layout does not match Q head size")
        if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
            raise ValueError("K/V linear layout must match page size and head count")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("Batch prefill requires K/V with contiguous last dimension")

    fp8_in = is_fp8_dtype(q.dtype)
    check(q.dtype in (torch.float16, torch.bfloat16) or fp8_in,
          "FlashAttention only support fp16, bf16 and fp8_e4m3 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    check(kv_indptr.dtype == torch.int32, "kv_indptr must have dtype int32")
    check(kv_page_indices.dtype == torch.int32, "kv_page_indices must have dtype torch.int32")
    out_dtype = torch.bfloat16 if fp8_in else q.dtype
    if fp8_in and out is not None:
        check(out.dtype == torch.bfloat16, "For FP8 input, output must have dtype BF16 for now")
    q_f, k_f, v_f = _descales(q_descale, k_descale, v_descale, kv_block_descale)

    if vectorized:
        heads_k, page_size, n_pages = k.shape[1], k.shape[3], k.shape[0]
    elif k.dim() == 4:
        n_pages, page_size, heads_k = k.shape[0], k.shape[1], k.shape[2]
    else:
        n_pages, page_size, heads_k = k.shape[0], 1, k.shape[1]
    total_q, heads = q.shape[0], q.shape[1]
    batch = cu_seqlens_q.numel() - 1
    check(batch > 0, "batch size must be postive")
    check(d_q <= MAX_HEAD_DIM and d_v <= MAX_HEAD_DIM,
          "CK only supports head dimension at most 256")
    check(heads % heads_k == 0,
          "Number of heads in key/value must divide number of heads in query")
    check(kv_indptr.numel() == batch + 1, "kv_indptr must have shape [batch_size + 1]")
    if page_size > 1 and block_table is None:
        check(kv_last_page_lens is not None,
              "if page_block_size > 1, must pass kv_last_page_lens to kernel")
    if window_size != (-1, -1) and not all(w >= max_seqlen_k for w in window_size if w >= 0):
        raise NotImplementedError("the AITER model does not model sliding windows")
    if max_seqlen_q == 1:
        causal = False  # bottom-right causal with one query token sees every key
    if out is None:
        out = torch.empty((total_q, heads, d_v), dtype=out_dtype, device=q.device)
    else:
        check(out.dtype == out_dtype, "For FP16/BF16 input, output must have the same dtype as "
              "inputs. For FP8 input, output must have dtype BF16")
        check(tuple(out.shape) == (total_q, heads, d_v), "out has the wrong shape")
    lse = torch.full((heads, total_q), float("nan"), dtype=torch.float32, device=q.device)

    qo = [int(x) for x in cu_seqlens_q.tolist()]
    pages_of, kv_lens = _page_table(batch, page_size, kv_indptr, kv_page_indices,
                                    kv_last_page_lens, block_table, seqlen_k)
    p_format = p_format_for(q.dtype)
    group = heads // heads_k
    for b in range(batch):
        qs, qe, kv_len = qo[b], qo[b + 1], kv_lens[b]
        if qe <= qs:
            continue
        pages = pages_of[b]
        check(bool(((pages >= 0) & (pages < n_pages)).all()),
              f"AITER model: request {b} has page ids outside the {n_pages}-page cache")
        kb = _tokens(k, "k", pages, kv_len)
        vb = _tokens(v, "v", pages, kv_len)
        if kv_block_descale is not None:  # per-page K/V descales, per kv head
            per_tok = kv_block_descale[pages.to(kv_block_descale.device)].float()
            per_tok = per_tok.repeat_interleave(page_size, dim=0)[:kv_len]  # [kv, H_kv, 2]
            kb = kb * per_tok[..., 0:1].to(kb.device)
            vb = vb * per_tok[..., 1:2].to(vb.device)
        if group > 1:
            kb = kb.repeat_interleave(group, dim=1)
            vb = vb.repeat_interleave(group, dim=1)
        o, l_ = flash_attend(as_chip_values(q[qs:qe]), kb, vb, softmax_scale * q_f * k_f,
                             causal, p_format, soft_cap=logits_soft_cap)
        out[qs:qe] = (o * v_f).to(out.dtype)
        lse[:, qs:qe] = l_.transpose(0, 1)
    result: list[torch.Tensor] = [out]
    if return_lse:
        result.append(lse)
    if return_attn_probs:
        result.append(torch.empty(0, device=q.device))  # AITER: empty unless dropout > 0
    return result[0] if len(result) == 1 else tuple(result)


def _descales(q_descale: torch.Tensor | None, k_descale: torch.Tensor | None,
              v_descale: torch.Tensor | None, kv_block_descale: torch.Tensor | None
              ) -> tuple[float, float, float]:
    """(q, k, v) per-tensor factors; with kv_block_descale K/V factors are applied per page."""
    if kv_block_descale is not None:
        check(q_descale is not None,
              "kv_block_descale requires q_descale for per-tensor Q scaling")
        check(k_descale is None and v_descale is None,
              "kv_block_descale and k_descale/v_descale are mutually exclusive. Use "
              "kv_block_descale for per-page KV scaling, or k_descale/v_descale for per-tensor "
              "scaling.")
        check(kv_block_descale.dim() == 3 and kv_block_descale.shape[2] == KV_BLOCK_DESCALE_PAIR,
              "kv_block_descale must be [num_block, num_kv_head, 2]")
        return scalar_scale(q_descale), 1.0, 1.0
    if q_descale is not None:
        check(k_descale is not None and v_descale is not None,
              "For per-tensor mode, q_descale, k_descale, v_descale must all be provided")
        return scalar_scale(q_descale), scalar_scale(k_descale), scalar_scale(v_descale)
    check(k_descale is None and v_descale is None,
          "k_descale and v_descale require q_descale to also be provided")
    return 1.0, 1.0, 1.0


def _page_table(batch: int, page_size: int, kv_indptr: torch.Tensor,
                kv_page_indices: torch.Tensor, kv_last_page_lens: torch.Tensor | None,
                block_table: torch.Tensor | None, seqlen_k: torch.Tensor | None
                ) -> tuple[list[torch.Tensor], list[int]]:
    """Per request: physical page ids and kv token count."""
    if block_table is not None:
        check(block_table.dtype == torch.int32, "block_table must be int32")
        check(block_table.dim() == 2 and block_table.shape[0] == batch,
              "block_table first dim must match batch_size")
        check(seqlen_k is not None, "block_table requires seqlen_k for per-batch lengths")
        assert seqlen_k is not None
        lens = [int(x) for x in seqlen_k.tolist()]
        bt = block_table.long().cpu()
        return [bt[b, : -(-lens[b] // page_size)] for b in range(batch)], lens
    ind = [int(x) for x in kv_indptr.tolist()]
    flat = kv_page_indices.long().cpu()
    last = [int(x) for x in kv_last_page_lens.tolist()] if kv_last_page_lens is not None else None
    pages, lens = [], []
    for b in range(batch):
        n = ind[b + 1] - ind[b]
        pages.append(flat[ind[b]:ind[b + 1]])
        if page_size == 1 or last is None:
            lens.append(n * page_size)
        else:
            lens.append((n - 1) * page_size + last[b] if n > 0 else 0)
    return pages, lens


def _tokens(pool: torch.Tensor, kind: str, pages: torch.Tensor, count: int) -> torch.Tensor:
    """fp32 values [count, H_kv, D] of `pages` of a K or V pool in any of the three layouts."""
    bits = fp8.int_dtype(pool.dtype)
    sel = pool.view(bits).index_select(0, pages.to(pool.device)).view(pool.dtype)
    if sel.dim() == 5 and kind == "k":  # [P, H, D/vec, ps, vec] -> [P, ps, H, D]
        sel = sel.permute(0, 3, 1, 2, 4).flatten(3)
    elif sel.dim() == 5:  # [P, H, ps/vec, D, vec] -> [P, ps, H, D]
        sel = sel.permute(0, 2, 4, 1, 3).flatten(1, 2)
    elif sel.dim() == 3:  # [tokens, H, D]: pages of one token
        sel = sel.unsqueeze(1)
    return as_chip_values(sel.reshape(-1, *sel.shape[2:])[:count])
