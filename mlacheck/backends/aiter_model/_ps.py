"""Model of AITER's FP8 persistent ("PS") MLA prefill: metadata sizing and planning
(`get_ps_metadata_info_v1`, `get_ps_metadata_v1`, host-side in AITER too) and the asm kernel
(`mla_prefill_ps_asm_fwd`): MHA-form attention, Q [T, H, 192], K [pages, H_kv, 192],
V [pages, H_kv, 128], FP8, one token per page, one query head per KV head.

Planner: each request's queries are cut into tiles of qlen_granularity tokens (taken
head/tail alternately); a tile costs ceil(visible kv / kvlen_granularity) units; the units
are dealt out evenly to the CUs of each head cluster (gcd(num_heads_k, CUs) clusters); a
tile a CU cannot finish is split, its fragments write fp32 partials that mla_reduce_v1
merges (grouped by the tile's query rows, in sorted order). Every CU repeats its allocation
for each k-head of its cluster, with the same partial rows (q_head_range tells heads apart).

At AITER main a tile done by one CU writes the output directly (partial_o_loc -1) and so
never gets a final LSE; with MLACHECK_AITER_MODEL_REVISION=pr3606 every work writes a
partial, so the reduce writes every row and its LSE.

Kernel: rows qo_start..qo_end, heads of q_head_range, keys kv_page_indices[kv_start:kv_end],
bottom-right causal from the request geometry (qo_indptr / kv_indptr: PS works carry
kv_offset 0 on final fragments, so it cannot anchor the mask), P rounded to the chip's FP8.

Deliberate differences from AITER: the CU count is the model's (env CU_NUM) where AITER reads
the device's multiProcessorCount (CU_NUM does not reach this path on a GPU); plans that do not
fit the buffers and reads outside Q, K/V or the partial buffer raise RuntimeError; works of one
CU that differ only in their heads are computed together (heads are independent).
"""

from __future__ import annotations

import math

import torch

from mlacheck import fp8
from mlacheck.backends.aiter_model._common import (
    as_chip_values,
    cdiv,
    check,
    chip_fp8_name,
    lse_fix,
    scalar_scale,
)
from mlacheck.backends.aiter_model._kernels import prefill_ps_kernel
from mlacheck.backends.aiter_model._metadata import (
    BATCH,
    KV_END,
    KV_START,
    NO_PARTIAL,
    PARTIAL_QO_LOC,
    QO_END,
    QO_START,
    WORK_INFO_WIDTH,
)
from mlacheck.backends.aiter_model.jit.utils.chip_info import get_cu_num
from mlacheck.backends.numerics import flash_attend

Q_HEAD_RANGE = 7  # work_info column 7 in the PS layout: (q_head_end << 16) | q_head_start
HEAD_FIELD_BITS = 16
HEAD_FIELD_MASK = 0xFFFF
PR3606_KVLEN_GRANULARITY = 128  # get_ps_metadata_info_v1's kvlen_granularity default (#3606)


def pack_heads(start: int, end: int) -> int:
    return (end << HEAD_FIELD_BITS) | (start & HEAD_FIELD_MASK)


def unpack_heads(word: int) -> tuple[int, int]:
    return word & HEAD_FIELD_MASK, (word >> HEAD_FIELD_BITS) & HEAD_FIELD_MASK


def _cluster_shape(num_head_k: int, cu: int) -> tuple[int, int]:
    clusters = math.gcd(num_head_k, cu)
    return clusters, cu // clusters


def get_ps_metadata_info_v1_head(
    batch_size: int,
    num_head_k: int,
    max_qlen: int,
    qlen_granularity: int = 256,
) -> tuple[tuple[object, torch.dtype], ...]:
    """Buffer sizes at AITER main (model). AITER reads the device's CU count here."""
    cu = get_cu_num()
    _, cus_per_cluster = _cluster_shape(num_head_k, cu)
    qsplit = math.ceil(max_qlen / qlen_granularity)
    tiles = batch_size * qsplit
    max_works = (batch_size + cus_per_cluster - 1) * qsplit * num_head_k
    max_partials = min(batch_size + cus_per_cluster - 1, (cus_per_cluster - 1) * 2) * qsplit
    return _ps_sizes(cu, max_works, tiles, max_partials)


def get_ps_metadata_info_v1_pr3606(
    batch_size: int,
    num_head_k: int,
    max_qlen: int,
    qlen_granularity: int = 256,
    max_kvlen: int | None = None,
    kvlen_granularity: int = PR3606_KVLEN_GRANULARITY,
) -> tuple[tuple[object, torch.dtype], ...]:
    """Buffer sizes with ROCm/aiter#3606 (model): room for a partial per work."""
    cu = get_cu_num()
    _, cus_per_cluster = _cluster_shape(num_head_k, cu)
    qsplit = math.ceil(max_qlen / qlen_granularity)
    tiles = batch_size * qsplit
    kv_splits = max(1, math.ceil((max_kvlen if max_kvlen is not None else max_qlen)
                                 / kvlen_granularity))
    per_cluster = tiles * (kv_splits + cus_per_cluster)
    return _ps_sizes(cu, num_head_k * per_cluster, tiles, per_cluster)


def ps_info_function() -> object:
    """The get_ps_metadata_info_v1 of the modelled revision (for its signature)."""
    return get_ps_metadata_info_v1_pr3606 if lse_fix() else get_ps_metadata_info_v1_head


def _ps_sizes(cu: int, works: int, tiles: int, partials: int
              ) -> tuple[tuple[object, torch.dtype], ...]:
    return (
        (2, torch.uint64),
        (cu + 1, torch.int32),
        ((works, WORK_INFO_WIDTH), torch.int32),
        (tiles + 1, torch.int32),
        ((tiles, 2), torch.int32),
        (partials, torch.int32),
    )


def plan_ps(qo_indptr: list[int], kv_indptr: list[int], context_lens: list[int],
            num_heads_k: int, qhead_granularity: int, qlen_granularity: int,
            kvlen_granularity: int, block_size: int, is_causal: bool, cu: int,
            always_partial: bool) -> tuple[list[int], list[list[int]]]:
    """(work_indptr [cu + 1], works): the host planner (see module docstring)."""
    check(kvlen_granularity % block_size == 0,
          "get_ps_metadata_v1: kvlen_granularity must be a multiple of block_size")
    blocks_per_unit = kvlen_granularity // block_size
    clusters, tgs = _cluster_shape(num_heads_k, cu)
    kheads = num_heads_k // clusters
    tiles: list[tuple[int, int, int, int, int]] = []  # batch, qo_start, qo_end, blocks, eff kv
    total_units = 0
    for b in range(len(qo_indptr) - 1):
        q_len, kv_len = qo_indptr[b + 1] - qo_indptr[b], context_lens[b]
        ranges = [(o, min(o + qlen_granularity, q_len)) for o in range(0, q_len, qlen_granularity)]
        for i in range(len(ranges)):
            lo, hi = ranges[i // 2 if i % 2 == 0 else len(ranges) - 1 - i // 2]  # 0, n-1, 1, ..
            eff = min(kv_len - q_len + hi, kv_len) if is_causal else kv_len
            units = cdiv(eff, kvlen_granularity)
            tiles.append((b, lo + qo_indptr[b], hi + qo_indptr[b], units * blocks_per_unit, eff))
            total_units += units
    average, remainder = divmod(total_units, tgs)
    work_indptr = [0] * (cu + 1)
    works: list[list[int]] = []
    for cluster in range(clusters):
        tile = block = partial = 0
        for tg in range(tgs):
            for k_off in range(kheads):
                k_head = cluster * kheads + k_off
                heads = pack_heads(k_head * qhead_granularity, (k_head + 1) * qhead_granularity)
                saved = (tile, block, partial)
                cap = (average + 1 if tg < remainder else average) * blocks_per_unit
                while tile < len(tiles) and cap > 0:
                    b, qs, qe, n_blocks, eff = tiles[tile]
                    rem_blocks = n_blocks - block
                    kv_start = block + kv_indptr[b]
                    if eff - block * block_size <= cap * block_size:  # the rest fits
                        take = rem_blocks
                        loc = NO_PARTIAL
                        if block != 0 or always_partial:
                            loc, partial = qlen_granularity * partial, partial + 1
                        works.append([b, loc, qs, qe, kv_start,
                                      min(kv_start + take, kv_indptr[b + 1]), 0, heads])
                        tile, block = tile + 1, 0
                    else:
                        take = cap
                        loc, partial = qlen_granularity * partial, partial + 1
                        kv_end = min(kv_start + take, kv_indptr[b + 1])
                        kv_offset = context_lens[b] - (kv_end - kv_indptr[b]) * block_size
                        works.append([b, loc, qs, qe, kv_start, kv_end, kv_offset, heads])
                        block += take
                    cap -= take
                if k_off != kheads - 1:
                    tile, block, partial = saved
            work_indptr[cluster * tgs + tg + 1] = len(works)
    return work_indptr, works


def reduce_info(works: list[list[int]]
                ) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """(reduce_indptr, final_map, partial_map): partials grouped by query rows, sorted."""
    groups: dict[tuple[int, int], set[int]] = {}
    for w in works:
        if w[PARTIAL_QO_LOC] != NO_PARTIAL:
            groups.setdefault((w[QO_START], w[QO_END]), set()).add(w[PARTIAL_QO_LOC])
    indptr, final, partial = [0], [], []
    for rows in sorted(groups):
        locs = sorted(groups[rows])
        indptr.append(indptr[-1] + len(locs))
        final.append(rows)
        partial += locs
    return indptr, final, partial


def get_ps_metadata_v1(
    seqlens_qo_indptr: torch.Tensor,
    pages_kv_indptr: torch.Tensor,
    context_lens: torch.Tensor,
    gqa_ratio: int,
    num_heads_k: int,
    work_metadata_ptrs: torch.Tensor,
    work_indptr: torch.Tensor,
    work_info: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    qhead_granularity: int = 1,
    qlen_granularity: int = 256,
    kvlen_granularity: int = 16,
    block_size: int = 16,
    is_causal: bool = True,
) -> None:
    """Plan the PS prefill and overwrite the five buffers (AITER copies whole host vectors,
    zeros past the plan; work_metadata_ptrs is not written). Note work_indptr comes before
    work_info here, unlike get_mla_metadata_v1."""
    indptr, works = plan_ps(
        [int(x) for x in seqlens_qo_indptr.tolist()], [int(x) for x in pages_kv_indptr.tolist()],
        [int(x) for x in context_lens.tolist()], num_heads_k, qhead_granularity,
        qlen_granularity, kvlen_granularity, block_size, is_causal, get_cu_num(), lse_fix())
    r_indptr, final, partial = reduce_info(works)
    _fill("work_indptr", work_indptr, indptr)
    _fill("work_info", work_info, works, rows=True)
    _fill("reduce_indptr", reduce_indptr,
          r_indptr + [r_indptr[-1]] * max(0, reduce_indptr.numel() - len(r_indptr)))
    _fill("reduce_final_map", reduce_final_map, [list(f) for f in final], rows=True)
    _fill("reduce_partial_map", reduce_partial_map, partial)


def _fill(name: str, dst: torch.Tensor, values: list, rows: bool = False) -> None:
    capacity = dst.shape[0] if rows else dst.numel()
    check(len(values) <= capacity,
          f"AITER model: the PS plan needs {len(values)} entries of {name} but the buffer holds "
          f"{capacity} (AITER's host planner would write past its vector): size it with "
          "get_ps_metadata_info_v1 for this batch")
    dst.zero_()
    if values:
        dst[: len(values)] = torch.tensor(values, dtype=dst.dtype).to(dst.device)


def mla_prefill_ps_asm_fwd(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    work_indptr: torch.Tensor | None,
    work_info_set: torch.Tensor | None,
    max_seqlen_q: int,
    softmax_scale: float,
    is_causal: bool,
    splitData: torch.Tensor,
    splitLse: torch.Tensor,
    output: torch.Tensor,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Run every work of every CU (model): rows qo_start..qo_end, heads of q_head_range, over
    kv_page_indices[kv_start:kv_end], bottom-right causal per request; unsplit works write
    `output` (bf16), the others fp32 partial rows partial_o_loc + (row - qo_start)."""
    check(K.shape[1] > 0 and Q.shape[1] % K.shape[1] == 0,
          "mla_prefill_ps_asm_fwd: query heads must be a multiple of kv heads")
    gqa = Q.shape[1] // K.shape[1]
    prefill_ps_kernel(Q.dtype, K.dtype, gqa, is_causal)
    check(work_indptr is not None and work_info_set is not None,
          "mla_prefill_ps_asm_fwd: work_indptr and work_info_set are required")
    assert work_indptr is not None and work_info_set is not None
    scale = softmax_scale * scalar_scale(q_scale) * scalar_scale(k_scale)
    v_factor = scalar_scale(v_scale)
    qo = [int(x) for x in qo_indptr.tolist()]
    kvp = [int(x) for x in kv_indptr.tolist()]
    indptr = [int(x) for x in work_indptr.tolist()]
    rows = work_info_set.tolist()
    p_format = chip_fp8_name()
    heads_total = Q.shape[1]
    for cu in range(len(indptr) - 1):
        # A CU repeats its allocation for each k-head of its cluster: works that differ only
        # in their heads are computed together (heads are independent, results identical).
        groups: dict[tuple[int, ...], list[int]] = {}
        for w in range(indptr[cu], indptr[cu + 1]):
            check(0 <= w < len(rows), f"AITER model: CU {cu} reads work {w} outside work_info")
            row = rows[w]
            h0, h1 = unpack_heads(row[Q_HEAD_RANGE] & 0xFFFFFFFF)
            check(0 <= h0 < h1 <= heads_total,
                  f"AITER model: work {w} has q heads {h0}-{h1 - 1} outside Q's {heads_total}")
            key = (row[BATCH], row[PARTIAL_QO_LOC], row[QO_START], row[QO_END], row[KV_START],
                   row[KV_END])
            check(0 <= key[2] <= key[3] <= Q.shape[0]
                  and 0 <= key[4] <= key[5] <= kv_page_indices.numel(),
                  f"AITER model: work {w} reads outside Q or kv_page_indices")
            groups.setdefault(key, []).extend(range(h0, h1))
        for (b, loc, qs, qe, ks, ke), head_list in groups.items():
            if qe == qs:
                continue
            heads = torch.tensor(sorted(set(head_list)), device=Q.device)
            pages = kv_page_indices[ks:ke].long().cpu()
            # K / V are [pages, H_kv, D] with one token per page; gqa is 1
            k = as_chip_values(_select(K, pages)[:, heads])
            v = as_chip_values(_select(V, pages)[:, heads])
            limits = None
            if is_causal:  # request-relative positions: key j visible to query i iff
                # j <= kv_len - q_len + i (bottom-right)
                q_len, kv_len = qo[b + 1] - qo[b], kvp[b + 1] - kvp[b]
                local = torch.arange(qs, qe) - qo[b]
                limits = (kv_len - q_len + local - (ks - kvp[b])).to(Q.device)
            q = as_chip_values(Q[qs:qe][:, heads])
            out, lse = flash_attend(q, k, v, scale, is_causal, p_format, q_positions=limits)
            out = out * v_factor
            if loc == NO_PARTIAL:
                output[qs:qe, heads] = out.to(output.dtype)
                continue
            check(loc >= 0 and loc + qe - qs <= splitData.shape[0],
                  f"AITER model: a work writes partial rows {loc}-{loc + qe - qs - 1} outside "
                  f"the {splitData.shape[0]}-row partial buffer (out of bounds on a GPU)")
            splitData[loc:loc + qe - qs, heads] = out
            splitLse[loc:loc + qe - qs, heads] = lse


def _select(t: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Rows `pages` of a [pages, H, D] tensor, as stored (fp8 has no index kernels: bits)."""
    n = t.shape[0]
    if bool(((pages < 0) | (pages >= n)).any()):
        raise RuntimeError(f"AITER model: a kv page index is outside the {n}-page K/V "
                           "(the kernel would read out of bounds)")
    bits = fp8.int_dtype(t.dtype)
    return t.view(bits).index_select(0, pages.to(t.device)).view(t.dtype)

