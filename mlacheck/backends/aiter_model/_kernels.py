"""Model of AITER's MLA asm kernels: which variants exist, and what stage 1 computes.

Kernel choice re-implements asm_mla.cu's mapping from (dtypes, query heads, q length,
persistent, causal, LSE) to a kernel key and looks the key up in a table of the decode and
FP8-prefill kernels AITER ships for gfx942 / gfx950 (the hsa/<gfx>/mla/mla_asm.csv rows at
the modelled commit, restated as data). A missing key raises the RuntimeError AITER raises.

Stage 1 computes, per work item (persistent) or per (request, KV split) (non-persistent),
kernel-style attention with mlacheck's same-precision numerics (mlacheck.backends.numerics.flash_attend):
scores from the stored values in fp32, `logits = q.k * sm_scale * q_scale * kv_scale`, an
online softmax over 64-token KV tiles, P rounded to the chip's FP8 when q is FP8 (bf16
otherwise) before the PV product, fp32 accumulation, `out = P.v * kv_scale`.

A persistent work [batch, partial_qo_loc, qo_start, qo_end, kv_start, kv_end, kv_offset]
takes query rows qo_start..qo_end over the tokens of kv_indices[kv_start:kv_end] (pages when
page_size > 1; the last page holds kv_last_page_lens[request] tokens when kv_offset is 0,
i.e. when the work reaches the request's end). The causal mask is bottom-right and anchored
by kv_offset: the request's KV ends kv_offset tokens after the work's last key, so row i of a
request with q_len rows sees work-local key k iff k <= n_kv + kv_offset - q_len + i. With
max_seqlen_q == 1 the mask is a no-op (AITER picks the same kernel either way), which is
also what makes sparse top-k works (one token each) see all their keys.

Deliberate differences from AITER (a model, not the asm kernels):
- reads outside q, kv_indices, kv_buffer or the partial buffer raise RuntimeError (a GPU
  would read or write out of bounds); a work_meta_data whose pointers are not the
  work_indptr / work_info_set passed raises too (the kernel would follow the stale pointers);
- sparse slots of -1 inside a token's min(kv_len, topk) range are masked (AITER's behaviour
  is undocumented, probably an out-of-bounds read);
- non-persistent splits are equal whole-64-token chunks of each request (the asm kernel's
  exact boundaries are not documented); empty splits have LSE -inf and output 0;
- the HK, opus and gfx1250 kernels and context-parallel decode are not modelled (the former
  compute the same attention; the latter raises NotImplementedError).
"""

from __future__ import annotations

import torch

from mlacheck import fp8
from mlacheck.backends.aiter_model._common import (
    as_chip_values,
    cdiv,
    check,
    chip_fp8_name,
    is_fp8_dtype,
    scalar_scale,
)
from mlacheck.backends.aiter_model._metadata import (
    BATCH,
    KV_END,
    KV_OFFSET,
    KV_START,
    NO_PARTIAL,
    PARTIAL_QO_LOC,
    QO_END,
    QO_START,
)
from mlacheck.backends.aiter_model.jit.utils.chip_info import get_gfx
from mlacheck.backends.numerics import flash_attend

V_HEAD_DIM = 512  # kv_lora_rank: V is the first 512 of the 576 latent values
# Non-persistent stage 1 cuts a request's KV into equal chunks of whole 64-token tiles, so
# every non-empty split lies within the first ceil(kv_len / mgc) splits the merge reads.
NONPERSISTENT_SPLIT_GRANULE = 64

# Kernel keys: (q, kv, query heads per kv head, persistent, q_len key, prefill, causal, lse).
# q_len key 0 means "any" (the kernel packs heads x tokens itself).
_COMMON = {
    ("bf16", "bf16", 8, 0, 1, 0, 1, 0), ("bf16", "bf16", 16, 0, 0, 1, 0, 0),
    ("bf16", "bf16", 16, 0, 1, 0, 1, 0), ("bf16", "bf16", 16, 0, 4, 0, 1, 0),
    ("bf16", "bf16", 16, 0, 8, 0, 1, 0), ("bf16", "bf16", 16, 1, 4, 0, 1, 0),
    ("bf16", "bf16", 32, 0, 0, 0, 1, 0), ("bf16", "bf16", 64, 0, 0, 0, 1, 0),
    ("bf16", "bf16", 128, 0, 0, 0, 1, 0), ("bf16", "bf16", 128, 0, 0, 1, 0, 0),
    ("bf16", "fp8", 16, 1, 4, 0, 1, 0), ("fp8", "fp8", 1, 1, 0, 1, 0, 0),
    ("fp8", "fp8", 1, 1, 0, 1, 1, 0), ("fp8", "fp8", 8, 0, 1, 0, 1, 0),
    ("fp8", "fp8", 16, 0, 1, 0, 1, 0), ("fp8", "fp8", 16, 0, 2, 0, 1, 0),
    ("fp8", "fp8", 16, 0, 4, 0, 1, 0), ("fp8", "fp8", 16, 1, 1, 0, 1, 0),
    ("fp8", "fp8", 16, 1, 2, 0, 1, 0), ("fp8", "fp8", 16, 1, 4, 0, 1, 0),
    ("fp8", "fp8", 128, 0, 0, 0, 1, 0),
}
KERNELS: dict[str, frozenset[tuple[str, str, int, int, int, int, int, int]]] = {
    "gfx942": frozenset(_COMMON | {
        ("bf16", "bf16", 8, 1, 2, 0, 1, 0), ("fp8", "fp8", 64, 1, 1, 0, 1, 0),
        ("fp8", "fp8", 64, 1, 1, 0, 1, 1), ("fp8", "fp8", 128, 1, 0, 0, 1, 0),
    }),
    "gfx950": frozenset(_COMMON | {
        ("bf16", "bf16", 8, 0, 2, 0, 1, 0), ("bf16", "bf16", 16, 1, 4, 0, 1, 1),
        ("bf16", "bf16", 64, 0, 1, 0, 1, 0),
        *{("bf16", "bf16", 32, 1, 4, 0, c, lse) for c in (0, 1) for lse in (0, 1)},
        *{("bf16", "bf16", 64, 1, 1, 0, c, lse) for c in (0, 1) for lse in (0, 1)},
        *{("fp8", "fp8", 8, 1, 4, 0, c, lse) for c in (0, 1) for lse in (0, 1)},
        *{("fp8", "fp8", 16, 1, q, 0, c, lse) for q in (1, 4) for c in (0, 1) for lse in (0, 1)},
        *{("fp8", "fp8", 32, 1, 4, 0, c, lse) for c in (0, 1) for lse in (0, 1)},
        ("fp8", "fp8", 16, 0, 1, 0, 0, 0), ("fp8", "fp8", 16, 0, 4, 0, 0, 0),
        ("fp8", "fp8", 32, 1, 1, 0, 1, 0), ("fp8", "fp8", 32, 1, 1, 0, 1, 1),
        ("fp8", "fp8", 128, 0, 0, 0, 0, 0),
    }),
}


def type_name(dtype: torch.dtype) -> str:
    if dtype == torch.bfloat16:
        return "bf16"
    if is_fp8_dtype(dtype):
        return "fp8"
    raise RuntimeError(f"mla_decode_stage1_asm_fwd: unsupport dtype: {dtype}")


def _lookup(gfx: str, key: tuple[str, str, int, int, int, int, int, int]) -> str:
    q, kv, gqa, ps, qlen, prefill, causal, lse = key
    check(key in KERNELS[gfx],
          f"get_heuristic_kernel_mla: cannot get heuristic kernel! q_type:{q} kv_type:{kv} "
          f"gqa:{gqa} ps:{ps} prefill:{prefill} causal:{causal} qseqlen:{qlen} lse:{lse} cprr:0")
    return f"{gfx}:mla:{q}:{kv}:gqa{gqa}:ps{ps}:q{qlen}:p{prefill}:c{causal}:lse{lse}"


def decode_kernel(q_type: str, kv_type: str, gqa: int, max_seqlen_q: int, persistent: bool,
                  causal: bool, lse: bool) -> str:
    """The decode kernel AITER would launch (asm_mla.cu's mapping); raises if none exists."""
    gfx = get_gfx()
    ps = 1 if persistent else 0
    cfg_causal = 1 if max_seqlen_q == 1 else int(causal)  # one query token: mask is a no-op
    cfg_q, cfg_gqa = max_seqlen_q, gqa
    bf16_both = q_type == kv_type == "bf16"
    fp8_both = q_type == kv_type == "fp8"
    msq = max_seqlen_q
    if gqa == 128:
        cfg_q = 0
        if bf16_both and gfx == "gfx942":
            ps = 0  # the gfx942 bf16 128-head kernel is not persistent
    elif gqa == 16:
        if bf16_both:
            if persistent:
                cfg_q = 4 if msq <= 4 else msq
            else:
                cfg_q = 1 if msq == 1 else (4 if msq <= 4 else 8)
        elif q_type == "bf16" and kv_type == "fp8":
            if persistent and msq <= 4:
                cfg_q = 4
        elif q_type == "fp8":
            if msq in (1, 2):
                cfg_q = msq
            elif msq <= 4:
                cfg_q = 4
            elif persistent and gfx == "gfx950":
                cfg_q, cfg_gqa = 4, 32
            else:
                check(False, "mla_decode_stage1_asm_fwd:only support gqa_ratio=16 fp8 mla decoding "
                      "with qo_len <= 4 and qo_len>4 in persistent mode on gfx950")
    elif gqa == 32:
        if bf16_both and not persistent:
            cfg_q = 0
        elif fp8_both:
            if msq == 1:
                cfg_q = 1
            elif msq >= 3 and persistent and gfx == "gfx950":
                cfg_q = 4
            elif msq == 2 and persistent:
                cfg_q = 2
            else:
                check(False, "mla_decode_stage1_asm_fwd: fp8/fp8 with gqa_ratio=32 only supports "
                      "decode_qlen=1,2 in persistent mode and decode_qlen>=3 in persistent mode "
                      "on gfx950")
    elif gqa == 64:
        if bf16_both and not persistent:
            cfg_q = 1 if msq == 1 else 0
        elif fp8_both:
            check(persistent, "mla_decode_stage1_asm_fwd: fp8/fp8 with gqa_ratio=64 only "
                  "supports persistent mode")
            cfg_q = 1 if msq == 1 else 4
    elif gqa == 8 and fp8_both and not persistent and msq == 1:
        cfg_q = 1
    if gfx == "gfx950" and persistent:
        if bf16_both and (gqa * msq >= 128 or gqa > 64) and gqa != 48:
            cfg_q, cfg_gqa = 4, 32
        elif bf16_both and (gqa * msq >= 64 or gqa >= 16):
            cfg_q, cfg_gqa = 1, 64
        elif fp8_both and ((gqa == 32 and msq >= 4) or (gqa == 64 and msq >= 2) or gqa == 128):
            cfg_q, cfg_gqa = 4, 32
        elif fp8_both and ((gqa == 16 and msq in (3, 4)) or (gqa == 32 and msq in (2, 3))
                           or (gqa == 64 and msq == 1)):
            cfg_q, cfg_gqa = 4, 16
    lse_flag = 1 if (lse and persistent) else 0
    return _lookup(gfx, (q_type, kv_type, cfg_gqa, ps, cfg_q, 0, cfg_causal, lse_flag))


def prefill_ps_kernel(q_dtype: torch.dtype, k_dtype: torch.dtype, gqa: int,
                      is_causal: bool) -> str:
    """The FP8 persistent prefill kernel (gfx950 only; fp8 Q and K; one q head per kv head)."""
    check(is_fp8_dtype(q_dtype), f"mla_prefill_ps_asm_fwd: unsupport Q dtype:{q_dtype}")
    check(is_fp8_dtype(k_dtype), f"mla_prefill_ps_asm_fwd: unsupport K dtype:{k_dtype}")
    gfx = get_gfx()
    check(gfx != "gfx942",
          "mla_prefill_ps_asm_fwd: fp8 mla persistent prefill is not supported on gfx942")
    return _lookup(gfx, ("fp8", "fp8", gqa, 1, 0, 1, int(is_causal), 0))


# --------------------------------------------------------------------------- numerics


def gather_tokens(buffer: torch.Tensor, pages: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` tokens of `pages` (page ids into buffer dim 0), flattened, as stored.

    A negative id (sparse padding) reads page 0 here; callers mask those positions.
    """
    n_pages = buffer.shape[0]
    bad = pages >= n_pages
    if bool(bad.any()):
        raise RuntimeError(f"AITER model: kv index {int(pages[bad][0])} is outside the "
                           f"{n_pages}-page buffer (the kernel would read out of bounds)")
    bits = fp8.int_dtype(buffer.dtype)
    sel = buffer.view(bits).index_select(0, pages.clamp(min=0).to(buffer.device).long())
    return sel.view(buffer.dtype).reshape(-1, *buffer.shape[2:])[:count]


def attend(q: torch.Tensor, kv_tokens: torch.Tensor, scale: float, p_format: str,
           limits: torch.Tensor | None, valid: torch.Tensor | None,
           v_dim: int = V_HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D] fp32 stored values, kv [m, 1, D] fp32 stored values; key k is visible to
    row r iff k <= limits[r] (None: all) and valid[k]. Returns (out fp32, lse)."""
    causal = limits is not None
    return flash_attend(q, kv_tokens, kv_tokens[..., :v_dim], scale, causal, p_format,
                        kv_valid=valid, q_positions=limits)


def decode_scales(q_dtype: torch.dtype, kv_dtype: torch.dtype, q_scale: torch.Tensor | None,
                  kv_scale: torch.Tensor | None) -> tuple[float, float]:
    """(q factor, kv factor) stage 1 applies: scales only act on FP8 inputs."""
    if is_fp8_dtype(q_dtype):
        check(q_scale is not None and kv_scale is not None,
              "mla_decode_stage1_asm_fwd: fp8 Q requires q_scale and kv_scale")
        return scalar_scale(q_scale), scalar_scale(kv_scale)
    if is_fp8_dtype(kv_dtype) and kv_scale is not None:
        return 1.0, scalar_scale(kv_scale)
    return 1.0, 1.0


def decode_p_format(q_dtype: torch.dtype) -> str:
    """P goes through the chip's FP8 before PV when q is FP8 (AITER's reference), else bf16."""
    return chip_fp8_name() if is_fp8_dtype(q_dtype) else "bf16"


def mla_decode_stage1_asm_fwd(
    Q: torch.Tensor,
    KV: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    num_kv_splits_indptr: torch.Tensor | None,
    work_meta_data: torch.Tensor | None,
    work_indptr: torch.Tensor | None,
    work_info_set: torch.Tensor | None,
    max_seqlen_q: int,
    page_size: int,
    nhead_kv: int,
    softmax_scale: float,
    splitData: torch.Tensor,
    splitLse: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    g_kv_indptr: torch.Tensor | None = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    valid_split_count: torch.Tensor | None = None,
    use_valid_split_count_reduce: int = 0,
    causal: bool = True,
) -> None:
    """Stage 1 of MLA decode (model): persistent when num_kv_splits_indptr is None."""
    persistent = num_kv_splits_indptr is None
    check(Q.is_contiguous(), "mla_decode_stage1_asm_fwd:only support Q.is_contiguous() for now")
    check(nhead_kv == 1, "mla_decode_stage1_asm_fwd:only support num_kv_heads==1 for now")
    check(Q.shape[-1] == KV.shape[-1],
          "mla_decode_stage1_asm_fwd:only support head_size == KV.size(3) for now")
    if g_kv_indptr is not None or cp_world_size > 1:
        raise NotImplementedError("the AITER model does not model context-parallel decode")
    q_factor, kv_factor = decode_scales(Q.dtype, KV.dtype, q_scale, kv_scale)
    decode_kernel(type_name(Q.dtype), type_name(KV.dtype), Q.shape[1] // nhead_kv, max_seqlen_q,
                  persistent, causal, lse is not None)
    qo_tokens = int(qo_indptr[-1]) if qo_indptr.numel() else 0
    # mla_decode_fwd folds heads by viewing q as [T * fold, 16, D]: infer the fold from q
    fold = Q.shape[0] // qo_tokens if qo_tokens and Q.shape[0] % qo_tokens == 0 else 1
    geo = _Geometry(Q, KV, qo_indptr, kv_indptr, kv_page_indices, kv_last_page_lens,
                    max_seqlen_q, page_size, softmax_scale * q_factor * kv_factor, kv_factor,
                    causal, max(fold, 1))
    if persistent:
        check(work_indptr is not None and work_info_set is not None,
              "mla_decode_stage1_asm_fwd: work_indptr and work_info_set must be provided")
        assert work_indptr is not None and work_info_set is not None
        if work_meta_data is not None:  # the kernel follows these pointers, not the tensors
            _check_pointers(work_meta_data, work_indptr, work_info_set)
        _run_works(geo, work_indptr, work_info_set, splitData, splitLse, output, lse)
    else:
        _run_splits(geo, num_kv_splits_indptr, splitData, splitLse)


def _check_pointers(work_meta_data: torch.Tensor, work_indptr: torch.Tensor,
                    work_info_set: torch.Tensor) -> None:
    """work_meta_data holds [&work_indptr, &work_info_set] (get_mla_metadata_v1 writes it):
    AITER's kernel reads the buffers those pointers name, so a stale pair means the kernel
    runs another schedule than the tensors passed; the model refuses instead."""
    ptrs = work_meta_data.reshape(-1)[:2].view(torch.int64).tolist()
    want = [work_indptr.data_ptr(), work_info_set.data_ptr()]
    check(ptrs == want,
          "AITER model: work_meta_data does not point at work_indptr / work_info_set (not filled "
          "by get_mla_metadata_v1 for these buffers?): AITER's kernel would read the schedule "
          "at the stale addresses")


class _Geometry:
    """What the stage-1 kernel reads besides the metadata."""

    def __init__(self, q: torch.Tensor, kv: torch.Tensor, qo_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last: torch.Tensor,
                 max_seqlen_q: int, page_size: int, scale: float, kv_factor: float,
                 causal: bool, fold: int) -> None:
        self.q, self.kv, self.kv_indices = q, kv, kv_indices
        self.qo = [int(x) for x in qo_indptr.tolist()]
        self.kv_pages = [int(x) for x in kv_indptr.tolist()]
        self.last = [int(x) for x in last.tolist()]
        self.max_seqlen_q, self.page_size = max_seqlen_q, page_size
        self.scale, self.kv_factor, self.causal = scale, kv_factor, causal
        self.p_format = decode_p_format(q.dtype)
        self.total_rows, self.heads = q.shape[0], q.shape[1]
        self.fold = fold  # head folding: q rows per original token

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        check(0 <= lo <= hi <= self.total_rows,
              f"AITER model: query rows {lo}-{hi - 1} outside q's {self.total_rows} rows "
              "(the kernel would read out of bounds)")
        return as_chip_values(self.q[lo:hi])

    def limits(self, request: int, lo: int, hi: int, n_kv: int, kv_offset: int
               ) -> torch.Tensor | None:
        """Last visible work-local key per query row: bottom-right causal, anchored so that
        the request's KV ends kv_offset tokens after this work's last key."""
        if not self.causal or self.max_seqlen_q <= 1:
            return None  # one query token per request: the mask is a no-op
        rows = torch.arange(lo, hi)
        if self.fold > 1:  # folded rows: [request][fold group][token] with uniform q length
            local, q_len = rows % self.max_seqlen_q, self.max_seqlen_q
        else:
            r = min(max(request, 0), len(self.qo) - 2)
            local, q_len = rows - self.qo[r], self.qo[r + 1] - self.qo[r]
        return (n_kv + kv_offset - q_len + local).to(self.q.device)


def _run_works(geo: _Geometry, work_indptr: torch.Tensor, work_info_set: torch.Tensor,
               split_data: torch.Tensor, split_lse: torch.Tensor, output: torch.Tensor,
               final_lse: torch.Tensor | None) -> None:
    """Every work group (CU) runs its works: work_indptr[cu] .. work_indptr[cu + 1]."""
    heads = geo.heads
    part_o = split_data.view(-1, heads, split_data.shape[-1])
    part_lse = split_lse.view(-1, heads)
    indptr = [int(x) for x in work_indptr.tolist()]
    rows = work_info_set.tolist()
    for cu in range(len(indptr) - 1):
        for w in range(indptr[cu], indptr[cu + 1]):
            check(0 <= w < len(rows), f"AITER model: CU {cu} reads work {w} outside work_info_set")
            _run_work(geo, rows[w], part_o, part_lse, output, final_lse)


def _run_work(geo: _Geometry, row: list[int], part_o: torch.Tensor, part_lse: torch.Tensor,
              output: torch.Tensor, final_lse: torch.Tensor | None) -> None:
    request = row[BATCH] // geo.fold
    qs, qe, ks, ke, koff = row[QO_START], row[QO_END], row[KV_START], row[KV_END], row[KV_OFFSET]
    if qe <= qs:
        return
    ps = geo.page_size
    if ps == 1 or koff > 0:
        n_kv = max(ke - ks, 0) * ps
    else:  # the work reaches the request's end: its last page holds kv_last_page_lens tokens
        last = geo.last[min(max(request, 0), len(geo.last) - 1)]
        n_kv = max((ke - ks - 1) * ps + last, 0)
    check(ks >= 0 and ke <= geo.kv_indices.numel(),
          f"AITER model: work reads kv_indices[{ks}:{ke}] outside its {geo.kv_indices.numel()} "
          "entries")
    pages = geo.kv_indices[ks:ke].long().cpu()
    kv = as_chip_values(gather_tokens(geo.kv, pages, n_kv))
    valid = None
    if bool((pages < 0).any()):  # sparse padding (-1) inside the range: masked (and zeroed,
        valid = (pages.repeat_interleave(ps)[:n_kv] >= 0).to(kv.device)  # a 0 x NaN-free PV)
        kv = kv.masked_fill(~valid[:, None, None], 0.0)
    out, lse = attend(geo.rows(qs, qe), kv, geo.scale, geo.p_format,
                      geo.limits(request, qs, qe, n_kv, koff), valid)
    out = out * geo.kv_factor
    loc = row[PARTIAL_QO_LOC]
    if loc == NO_PARTIAL:
        output[qs:qe] = out.to(output.dtype)
        if final_lse is not None:
            final_lse.view(-1, geo.heads)[qs:qe] = lse
        return
    check(loc >= 0 and loc + (qe - qs) <= part_o.shape[0],
          f"AITER model: partial rows {loc}-{loc + qe - qs - 1} outside the {part_o.shape[0]}-row "
          "partial buffer (the kernel would write out of bounds)")
    part_o[loc:loc + qe - qs] = out
    part_lse[loc:loc + qe - qs] = lse


def _run_splits(geo: _Geometry, splits_indptr: torch.Tensor | None, split_data: torch.Tensor,
                split_lse: torch.Tensor) -> None:
    """Non-persistent: each request's KV in equal whole-tile chunks, one per split."""
    assert splits_indptr is not None
    n_split = split_data.shape[1]
    sp = [int(x) for x in splits_indptr.tolist()]
    ps = geo.page_size
    for b in range(len(geo.qo) - 1):
        qs, qe = geo.qo[b], geo.qo[b + 1]
        n_pages = geo.kv_pages[b + 1] - geo.kv_pages[b]
        kv_len = (n_pages - 1) * ps + geo.last[b] if n_pages > 0 else 0
        pages = geo.kv_indices[geo.kv_pages[b]:geo.kv_pages[b + 1]].long().cpu()
        kv = as_chip_values(gather_tokens(geo.kv, pages, kv_len))
        splits = min(max(sp[b + 1] - sp[b], 1), n_split)
        chunk = max(1, cdiv(cdiv(kv_len, splits), NONPERSISTENT_SPLIT_GRANULE)) * \
            NONPERSISTENT_SPLIT_GRANULE
        q = geo.rows(qs, qe)
        for s in range(n_split):
            lo, hi = min(s * chunk, kv_len), min((s + 1) * chunk, kv_len)
            limits = geo.limits(b, qs, qe, hi - lo, kv_len - hi)
            out, lse = attend(q, kv[lo:hi], geo.scale, geo.p_format, limits, None)
            split_data[qs:qe, s] = (out * geo.kv_factor).to(split_data.dtype)
            split_lse[qs:qe, s] = lse.unsqueeze(-1)
