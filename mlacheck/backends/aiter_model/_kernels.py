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

from dataclasses import dataclass

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
    return gather_pages(buffer, pages[None], count)[0]


def gather_pages(buffer: torch.Tensor, pages: torch.Tensor, count: int) -> torch.Tensor:
    """gather_tokens of every row of `pages` [W, P]: [W, count, *token shape] (one read)."""
    n_pages = buffer.shape[0]
    bad = pages >= n_pages
    if bool(bad.any()):
        raise RuntimeError(f"AITER model: kv index {int(pages[bad][0])} is outside the "
                           f"{n_pages}-page buffer (the kernel would read out of bounds)")
    bits = fp8.int_dtype(buffer.dtype)
    flat = pages.reshape(-1).clamp(min=0).to(buffer.device).long()
    sel = buffer.view(bits).index_select(0, flat).view(buffer.dtype)
    tokens = pages.shape[1] * buffer.shape[1]  # buffer [pages, page size, *token shape]
    return sel.reshape(pages.shape[0], tokens, *buffer.shape[2:])[:, :count]


def _select_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t[rows] as stored (FP8 bytes moved as integers)."""
    return t.view(fp8.int_dtype(t.dtype)).index_select(0, rows).view(t.dtype)


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
        self.kv_indices_host = kv_indices.long().cpu()  # page ids, read once
        self.qo = [int(x) for x in qo_indptr.tolist()]
        self.kv_pages = [int(x) for x in kv_indptr.tolist()]
        self.last = [int(x) for x in last.tolist()]
        self.max_seqlen_q, self.page_size = max_seqlen_q, page_size
        self.scale, self.kv_factor, self.causal = scale, kv_factor, causal
        self.p_format = decode_p_format(q.dtype)
        self.total_rows, self.heads = q.shape[0], q.shape[1]
        self.fold = fold  # head folding: q rows per original token

    def check_rows(self, lo: int, hi: int) -> None:
        check(0 <= lo <= hi <= self.total_rows,
              f"AITER model: query rows {lo}-{hi - 1} outside q's {self.total_rows} rows "
              "(the kernel would read out of bounds)")

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        self.check_rows(lo, hi)
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
    """Every work group (CU) runs its works: work_indptr[cu] .. work_indptr[cu + 1].

    The works are checked first, in CU order, as the kernel meets them; those before the
    first refusal run (and write) before it is raised, as when they ran one by one. Works of
    one shape share a launch sequence (sparse prefill has a work per query token: 16k
    launch-bound works one by one), unless two works write the same rows: then they run one
    by one, in order, so the last write wins as on the GPU's serial order of the model."""
    sink = _Sink(geo, split_data, split_lse, output, final_lse)
    works, refusal = _admitted_works(geo, work_indptr, work_info_set, sink.partial_rows)
    batches = _batches(geo, works) if sink.writes_commute(works) else [[w] for w in works]
    for batch in batches:
        if batch[0].limits is not None:  # causal works run one by one (few: MTP decode)
            sink.write(batch[0], *_attend_one(geo, batch[0]))
        else:
            sink.write_many(batch, *_attend_batch(geo, batch))
    if refusal is not None:
        raise refusal


# Works of one shape share a launch sequence gathering at most this many fp32 elements of KV
# and q (128 MiB: several workers share a GPU); 0: one work per launch sequence (same numerics).
BATCH_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class _Work:
    """An admitted work item: query rows qs..qe over the pages kv_indices[ks:ke], n_kv tokens
    of them (the causal anchor), `tokens` of which exist (n_kv at most what the pages hold)."""

    request: int
    qs: int
    qe: int
    ks: int
    ke: int
    n_kv: int
    tokens: int
    loc: int  # PARTIAL_QO_LOC; NO_PARTIAL: the work writes the output
    limits: torch.Tensor | None  # last visible key per row; None: every key visible
    padded: bool  # a page id in kv_indices[ks:ke] is negative (sparse padding)


def _admitted_works(geo: _Geometry, work_indptr: torch.Tensor, work_info_set: torch.Tensor,
                    partial_rows: int) -> tuple[list[_Work], Exception | None]:
    """The works the kernel runs before its first refusal, and that refusal (None if none);
    each work's checks in the order the kernel meets them."""
    indptr = [int(x) for x in work_indptr.tolist()]
    rows = work_info_set.tolist()
    order: list[int] = []
    refusal: Exception | None = None
    for cu in range(len(indptr) - 1):
        w = next((w for w in range(indptr[cu], indptr[cu + 1]) if not 0 <= w < len(rows)), None)
        order.extend(range(indptr[cu], indptr[cu + 1] if w is None else w))
        if w is not None:
            refusal = RuntimeError(f"AITER model: CU {cu} reads work {w} outside work_info_set")
            break
    n_idx = geo.kv_indices.numel()
    parsed: list[tuple[list[int], int, int]] = []  # (row, request, n_kv) of works with rows
    for w in order:
        row = rows[w]
        if row[QO_END] <= row[QO_START]:
            continue
        try:
            request, n_kv = _request_and_tokens(geo, row)
            check(row[KV_START] >= 0 and row[KV_END] <= n_idx,
                  f"AITER model: work reads kv_indices[{row[KV_START]}:{row[KV_END]}] outside "
                  f"its {n_idx} entries")
        except Exception as error:  # noqa: BLE001 - raised once the works before it ran
            refusal = error
            break
        parsed.append((row, request, n_kv))
    beyond, negative = _page_counts(geo, [(r[KV_START], r[KV_END]) for r, _, _ in parsed])
    works: list[_Work] = []
    for (row, request, n_kv), bad, neg in zip(parsed, beyond, negative, strict=True):
        qs, qe, ks, ke = row[QO_START], row[QO_END], row[KV_START], row[KV_END]
        loc = row[PARTIAL_QO_LOC]
        try:
            if bad:
                gather_tokens(geo.kv, geo.kv_indices_host[ks:ke], n_kv)  # raises its message
            geo.check_rows(qs, qe)
            if loc != NO_PARTIAL:
                check(loc >= 0 and loc + (qe - qs) <= partial_rows,
                      f"AITER model: partial rows {loc}-{loc + qe - qs - 1} outside the "
                      f"{partial_rows}-row partial buffer (the kernel would write out of bounds)")
        except Exception as error:  # noqa: BLE001 - raised once the works before it ran
            return works, error
        tokens = max(0, min(n_kv, max(ke - ks, 0) * geo.page_size))
        works.append(_Work(request, qs, qe, ks, ke, n_kv, tokens, loc,
                           geo.limits(request, qs, qe, n_kv, row[KV_OFFSET]), neg > 0))
    return works, refusal


def _request_and_tokens(geo: _Geometry, row: list[int]) -> tuple[int, int]:
    """(request, kv tokens) of a work row: its last page holds kv_last_page_lens tokens when
    the work reaches the request's end (kv_offset 0)."""
    request = row[BATCH] // geo.fold
    ks, ke, ps = row[KV_START], row[KV_END], geo.page_size
    if ps == 1 or row[KV_OFFSET] > 0:
        return request, max(ke - ks, 0) * ps
    last = geo.last[min(max(request, 0), len(geo.last) - 1)]
    return request, max((ke - ks - 1) * ps + last, 0)


def _page_counts(geo: _Geometry, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Per span of kv_indices: how many page ids lie past the KV buffer, how many are
    negative (one pass over kv_indices, not one per work)."""
    if not spans:
        return [], []
    idx = geo.kv_indices_host
    zero = torch.zeros(1, dtype=torch.long)
    beyond = torch.cat([zero, (idx >= geo.kv.shape[0]).long().cumsum(0)])
    negative = torch.cat([zero, (idx < 0).long().cumsum(0)])
    lo = torch.tensor([a for a, _ in spans], dtype=torch.long)
    hi = torch.maximum(torch.tensor([b for _, b in spans], dtype=torch.long), lo)
    return (beyond[hi] - beyond[lo]).tolist(), (negative[hi] - negative[lo]).tolist()


def _batches(geo: _Geometry, works: list[_Work]) -> list[list[_Work]]:
    """Works that can share a launch sequence: one query-row count, page count and token
    count, no causal limits; chunked so each gathers at most BATCH_ELEMENTS of KV and q."""
    groups: dict[tuple[int, int, int] | int, list[_Work]] = {}
    for i, w in enumerate(works):
        key = i if w.limits is not None else (w.qe - w.qs, w.ke - w.ks, w.tokens)
        groups.setdefault(key, []).append(w)
    batches = []
    for group in groups.values():
        w = group[0]  # q rows weigh too: works of one key each would gather a huge q
        per_work = ((w.ke - w.ks) * geo.page_size + (w.qe - w.qs) * geo.heads) * geo.kv.shape[-1]
        size = max(1, BATCH_ELEMENTS // max(1, per_work))
        batches.extend(group[i:i + size] for i in range(0, len(group), size))
    return batches


def _attend_one(geo: _Geometry, work: _Work) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [rows, H, Dv] fp32 x kv scale, lse [rows, H]) of one work with causal limits."""
    pages = geo.kv_indices_host[work.ks:work.ke]
    kv = as_chip_values(gather_tokens(geo.kv, pages, work.n_kv))
    valid = None
    if work.padded:  # sparse padding (-1) inside the range: masked (and zeroed, a 0 x
        valid = (pages.repeat_interleave(geo.page_size)[:work.n_kv] >= 0).to(kv.device)
        kv = kv.masked_fill(~valid[:, None, None], 0.0)  # NaN-free PV)
    out, lse = attend(geo.rows(work.qs, work.qe), kv, geo.scale, geo.p_format, work.limits,
                      valid)
    return out * geo.kv_factor, lse


def _attend_batch(geo: _Geometry, works: list[_Work]) -> tuple[torch.Tensor, torch.Tensor]:
    """_attend_one of W works of one shape (no causal limits) as one launch sequence:
    MLA has one KV head, so a work's heads are query rows; the works stand along
    flash_attend's head axis (q [rows x H, W, D], kv [n, W, D], a [W, n] key mask) and every
    product is a plain batched matmul. Returns (out [W, rows, H, Dv], lse [W, rows, H])."""
    first = works[0]
    n_rows, n_pages, tokens = first.qe - first.qs, first.ke - first.ks, first.tokens
    host = geo.kv_indices_host
    pages = (torch.cat([host[w.ks:w.ke] for w in works]) if n_pages
             else torch.zeros(0, dtype=torch.long)).view(len(works), n_pages)
    kv = as_chip_values(gather_pages(geo.kv, pages, tokens)).squeeze(2)  # [W, n, D]
    valid = None
    if any(w.padded for w in works):  # as in _attend_one, a mask per work
        valid = (pages.repeat_interleave(geo.page_size, dim=1)[:, :tokens] >= 0).to(kv.device)
        kv.masked_fill_(~valid[..., None], 0.0)  # kv is this call's own gathered copy
    starts = torch.tensor([w.qs for w in works], dtype=torch.long)
    q_rows = (starts[:, None] + torch.arange(n_rows)).reshape(-1).to(geo.q.device)
    q = as_chip_values(_select_rows(geo.q, q_rows))  # [W x rows, H, D]
    heads = q.shape[1]
    q = q.view(len(works), n_rows * heads, -1).transpose(0, 1)  # [rows x H, W, D]
    k = kv.transpose(0, 1)  # [n, W, D]
    out, lse = flash_attend(q, k, k[..., :V_HEAD_DIM], geo.scale, False, geo.p_format,
                            kv_valid=valid)
    out = (out * geo.kv_factor).transpose(0, 1).reshape(len(works), n_rows, heads, -1)
    return out, lse.transpose(0, 1).reshape(len(works), n_rows, heads)


class _Sink:
    """Where works write: the output (and final LSE) or the partial buffers."""

    def __init__(self, geo: _Geometry, split_data: torch.Tensor, split_lse: torch.Tensor,
                 output: torch.Tensor, final_lse: torch.Tensor | None) -> None:
        self.heads = geo.heads
        self.part_o = split_data.view(-1, self.heads, split_data.shape[-1])
        self.part_lse = split_lse.view(-1, self.heads)
        self.output, self.final_lse = output, final_lse
        self.partial_rows = self.part_o.shape[0]

    def write(self, work: _Work, out: torch.Tensor, lse: torch.Tensor) -> None:
        qs, qe, loc = work.qs, work.qe, work.loc
        if loc == NO_PARTIAL:
            self.output[qs:qe] = out.to(self.output.dtype)
            if self.final_lse is not None:
                self.final_lse.view(-1, self.heads)[qs:qe] = lse
            return
        self.part_o[loc:loc + qe - qs] = out
        self.part_lse[loc:loc + qe - qs] = lse

    def write_many(self, works: list[_Work], outs: torch.Tensor, lses: torch.Tensor) -> None:
        """write() of works whose writes commute, one indexed copy per buffer."""
        if outs.shape[2:] != self.output.shape[1:] or outs.shape[2:] != self.part_o.shape[1:]:
            for work, out, lse in zip(works, outs, lses, strict=True):
                self.write(work, out, lse)
            return
        final = [i for i, w in enumerate(works) if w.loc == NO_PARTIAL]
        partial = [i for i, w in enumerate(works) if w.loc != NO_PARTIAL]
        targets = [(final, [w.qs for w in works], self.output, self.final_lse),
                   (partial, [w.loc for w in works], self.part_o, self.part_lse)]
        n_rows = outs.shape[1]
        for chosen, starts, o_buf, lse_buf in targets:
            if not chosen:
                continue
            pick = torch.tensor(chosen, device=outs.device)
            at = (torch.tensor([starts[i] for i in chosen])[:, None] + torch.arange(n_rows))
            at = at.reshape(-1).to(o_buf.device)
            o_buf.index_copy_(0, at, outs.index_select(0, pick).flatten(0, 1).to(o_buf.dtype))
            if lse_buf is not None:
                lse_buf.view(-1, self.heads).index_copy_(
                    0, at, lses.index_select(0, pick).flatten(0, 1).to(lse_buf.dtype))

    def writes_commute(self, works: list[_Work]) -> bool:
        """No two works write the same rows, and the buffers share no memory: then the order
        the works run in cannot change what the buffers hold."""
        buffers = [t for t in (self.output, self.final_lse, self.part_o, self.part_lse)
                   if t is not None]
        if len({t.untyped_storage().data_ptr() for t in buffers}) < len(buffers):
            return False
        final = sorted((w.qs, w.qe) for w in works if w.loc == NO_PARTIAL)
        partial = sorted((w.loc, w.loc + w.qe - w.qs) for w in works if w.loc != NO_PARTIAL)
        return all(a[1] <= b[0] for spans in (final, partial)
                   for a, b in zip(spans, spans[1:], strict=False))


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
        pages = geo.kv_indices_host[geo.kv_pages[b]:geo.kv_pages[b + 1]]
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
