"""Model of AITER's persistent MLA decode metadata: `get_mla_metadata_info_v1` (buffer
sizes) and `get_mla_metadata_v1` with the v1.2 ("fast_mode") planner.

The planner is a re-implementation of the serial v1.2 work-assignment loop (the parallel
planner AITER uses for q_len 1 / page 1 / unfolded batches yields the same plan, so only the
serial one is modelled). Batches are taken in order and packed greedily into CUs of equal
payload; a batch that does not fit is split into KV fragments whose fp32 partials a reduce
tile merges. It runs on the host (AITER runs it on the GPU, one work group) and writes the
six buffers in AITER's format.

kv_start / kv_end count kv_indices entries (pages when page_size > 1) from kv_indptr[0], as
AITER's planners do. With top-k every query token is a pseudo-batch whose entries start at
token * ceil(topk / page_size). Folded heads (not natively supported, multiple of 16) make
nhead/16 pseudo-batches per request; batch_idx is then the pseudo-batch index.

Deliberate differences from AITER:
- a plan that does not fit the buffers raises RuntimeError (AITER's kernel writes past them);
- reads past kv_last_page_lens (AITER indexes it by batch_idx, a pseudo-batch index when heads
  are folded and page_size > 1) give 0; reads past seqlens_qo_indptr (folded heads with
  ragged q lengths) raise;
- only the v1.2 planner (fast_mode=True, intra_batch_mode=False) is modelled; the unused
  tails of reduce_final_map / reduce_partial_map / work_info_set keep what the buffers held,
  as in AITER.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlacheck.backends.aiter import rules
from mlacheck.backends.aiter_model._common import (
    cdiv,
    check,
    experimental_enabled,
    is_fp8_dtype,
)
from mlacheck.backends.aiter_model.dtypes import chip_fp8
from mlacheck.backends.aiter_model.jit.utils.chip_info import get_cu_num, get_gfx

WORK_INFO_WIDTH = 8  # int32 fields per work row (MlaWorkInfo)
# work_info_set columns
BATCH, PARTIAL_QO_LOC, QO_START, QO_END, KV_START, KV_END, KV_OFFSET, PAD = range(8)
NO_PARTIAL = -1  # partial_qo_loc of a work that writes the final output directly
OVERHEAD_TOKENS = 16  # fixed per-work cost, in kv tokens: max(1, ceil(16 / page_size)) blocks


def get_mla_decode_fwd_max_splits(
    num_head_qo: int, max_seqlen_qo: int, q_dtype: torch.dtype, kv_dtype: torch.dtype
) -> int:
    """CU count x occupancy: the most KV splits one tile can get (model)."""
    fp8 = chip_fp8()
    occ = rules.decode_occupancy(get_gfx(), num_head_qo, max_seqlen_qo, q_dtype == fp8,
                                  kv_dtype == fp8, experimental_enabled())
    return get_cu_num() * occ


def get_mla_metadata_info_v1(
    batch_size: int,
    max_seqlen_qo: int,
    num_head_qo: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    is_sparse: bool,
    fast_mode: bool = True,
    num_kv_splits: int = 32,
    intra_batch_mode: bool = False,
    max_split_per_batch: int = -1,
) -> tuple[tuple[object, torch.dtype], ...]:
    """(shape, dtype) of the six metadata buffers, by AITER's formulas (model)."""
    assert num_head_qo % 8 == 0
    fp8 = chip_fp8()
    max_splits = get_mla_decode_fwd_max_splits(num_head_qo, max_seqlen_qo, q_dtype, kv_dtype)
    effective_seqlen_qo = 1 if is_sparse else max_seqlen_qo
    tiles = rules.info_tiles_per_batch(get_gfx(), num_head_qo, effective_seqlen_qo,
                                        q_dtype == fp8, kv_dtype == fp8, experimental_enabled())
    batches = batch_size * max_seqlen_qo if is_sparse else batch_size
    tile_cnt = batches * tiles
    if fast_mode:
        max_work = (batches + max_splits - 1) * tiles
        max_split_tiles = min(batches + max_splits - 1, (max_splits - 1) * 2) * tiles
    else:
        max_work = tile_cnt * max_splits
        max_split_tiles = tile_cnt * max_splits
    if max_split_per_batch > 0:
        max_split_tiles = max(max_split_tiles,
                              tile_cnt + min(max_splits, max_split_per_batch * batches))
    if intra_batch_mode:
        max_work = max_split_tiles = tile_cnt * num_kv_splits
    return (
        ((2), torch.uint64),
        ((max_splits + 1), torch.int32),
        ((max_work, WORK_INFO_WIDTH), torch.int32),
        ((tile_cnt + 1), torch.int32),
        ((tile_cnt, 2), torch.int32),
        (max_split_tiles, torch.int32),
    )


# --------------------------------------------------------------------------- the planner


@dataclass
class Plan:
    """What the v1.2 planner computed, before it is written into AITER's buffers."""

    works: list[list[int]] = field(default_factory=list)
    work_indptr: list[int] = field(default_factory=lambda: [0])
    reduce_indptr: list[int] = field(default_factory=lambda: [0])  # one entry per tile + 1
    reduce_final_map: dict[int, tuple[int, int]] = field(default_factory=dict)
    reduce_partial_map: list[int] = field(default_factory=list)
    head_fold: int = 1
    unassigned_batches: int = 0  # pseudo-batches left when the CUs ran out (AITER: silent)


@dataclass(frozen=True)
class _Params:
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_last_page_lens: list[int]
    num_batches: int  # pseudo-batches (after head folding and sparse expansion)
    num_heads: int  # folded
    ratio: int  # head fold (qk_batch_ratio)
    num_cu: int
    num_splits: int
    page_size: int
    gran: int
    uni: int
    ori: int
    sparse: bool
    topk_units: int
    causal: bool
    cp_round_robin: bool
    overhead: int
    tail_threshold: int
    packed_per_wg: int
    qo_splits: bool


class _Qo:
    """QoState: query geometry of a pseudo-batch, as the planner reads it."""

    def __init__(self, p: _Params) -> None:
        self.p = p
        if p.uni <= 0:  # per-pseudo-batch q lengths, read through qo_indptr
            self.lens = [self._req_len(self._bid_ori(b)) for b in range(p.num_batches)]

    def _bid_ori(self, bid: int) -> int:
        p = self.p
        return bid // p.ori // p.ratio if p.sparse else bid // p.ratio

    def _req_len(self, r: int) -> int:
        return _at(self.p.qo_indptr, r + 1, "seqlens_qo_indptr") - _at(
            self.p.qo_indptr, r, "seqlens_qo_indptr")

    def _row(self, bid: int) -> int:
        return bid // self.p.ori if self.p.sparse else bid

    def seqlen(self, bid: int) -> int:
        return self.p.uni if self.p.uni > 0 else _at(self.lens, self._row(bid), "qo lengths")

    def begin(self, bid: int) -> int:
        if self.p.uni > 0:
            return self.p.uni * bid
        return _at(self.p.qo_indptr, self._row(bid), "seqlens_qo_indptr")

    def end(self, bid: int) -> int:
        if self.p.uni > 0:
            return self.p.uni * (bid + 1)
        return _at(self.p.qo_indptr, self._row(bid) + 1, "seqlens_qo_indptr")

    def tiles(self, bid: int) -> int:
        p = self.p
        if not p.qo_splits:
            return 1
        s = self.seqlen(bid)
        if p.num_heads * 2 > p.packed_per_wg:
            return s
        return cdiv(s * p.num_heads, p.packed_per_wg)


def _at(values: list[int], i: int, what: str) -> int:
    if not 0 <= i < len(values):
        raise RuntimeError(f"AITER model: the v1.2 planner reads {what}[{i}] out of bounds "
                           f"(length {len(values)})")
    return values[i]


def _kv_len(p: _Params, bid: int) -> int:
    """KV entries (kv_indptr units) of pseudo-batch bid; sparse: capped at topk."""
    r = bid // p.ori // p.ratio if p.sparse else bid // p.ratio
    n = _at(p.kv_indptr, r + 1, "seqlens_kv_indptr") - _at(p.kv_indptr, r, "seqlens_kv_indptr")
    return min(n, p.topk_units) if p.sparse else n


def plan_v12(p: _Params) -> Plan:
    """The serial v1.2 work assignment (see the module docstring)."""
    qo = _Qo(p)
    plan = Plan(head_fold=p.ratio)
    if p.num_batches <= 0:
        plan.work_indptr += [0] * p.num_cu
        return plan
    sum_blocks = sum((cdiv(_kv_len(p, b), p.gran) + p.overhead) * qo.tiles(b)
                     for b in range(p.num_batches))
    check(p.num_splits > 0, "AITER model: num_splits is 0 (max_split_per_batch = 0?)")
    payload = cdiv(sum_blocks, p.num_splits) + p.overhead

    batch, kv_block, n_split, tile, sub_head = 0, 0, 0, 0, 0
    kv_begin, kv_end = 0, _kv_len(p, 0)
    partial_idx, last_reduce = 0, 0
    tail_done = False

    def fill(blocks: int, tile_size: int, ntiles: int) -> list[int]:
        """One work row covering `blocks` kv blocks from the current position."""
        req = batch // p.ori // p.ratio if p.sparse else batch
        qs = qo.begin(batch) + tile * tile_size
        qe = min(qs + tile_size, qo.end(batch))
        ks = kv_begin + kv_block * p.gran
        if p.page_size == 1:
            ke = min(ks + blocks * p.gran, kv_end - _tail(p, qs, ntiles, tile))
            koff = kv_end - ke
        else:
            ke = min(ks + blocks * p.gran, kv_end)
            # AITER indexes kv_last_page_lens by this row's batch_idx, a pseudo-batch when
            # heads are folded: the wrong request's entry, or past the end (read as 0 here)
            last = p.kv_last_page_lens[req] if 0 <= req < len(p.kv_last_page_lens) else 0
            koff = 0 if kv_end == ke else (kv_end - ke - 1) * p.page_size + last
        return [req, NO_PARTIAL, qs, qe, ks, ke, koff, 0]

    def sparse_offset(row: list[int]) -> None:
        if p.sparse and p.ratio == 1 and p.page_size == 1:
            row[BATCH] = batch // p.ori
            row[KV_OFFSET] += p.ori - 1 - batch % p.ori

    for _cu in range(p.num_cu):
        remain = payload
        while batch < p.num_batches:
            ntiles = qo.tiles(batch)
            check(ntiles > 0, f"AITER model: pseudo-batch {batch} has no query tokens")
            tile_size = cdiv(qo.seqlen(batch), ntiles)
            rem_blocks = cdiv(kv_end - kv_begin, p.gran) - kv_block
            if remain >= rem_blocks + p.overhead or tail_done:
                row = fill(rem_blocks, tile_size, ntiles)
                if p.page_size == 1 and (0 < kv_end - row[KV_END] < p.tail_threshold
                                         or tail_done):
                    row[KV_END] = min(kv_end - _tail(p, row[QO_START], ntiles, tile), kv_end)
                    row[KV_OFFSET] = kv_end - row[KV_END]
                sparse_offset(row)
                tile_idx = len(plan.reduce_indptr) - 1
                if n_split > 0:
                    row[PARTIAL_QO_LOC] = partial_idx
                    plan.reduce_indptr.append(last_reduce + n_split + 1)
                    plan.reduce_final_map[tile_idx] = (row[QO_START], row[QO_END])
                    plan.reduce_partial_map += [partial_idx - (n_split - k) * tile_size
                                                for k in range(n_split + 1)]
                    partial_idx += tile_size
                    last_reduce += n_split + 1
                else:
                    plan.reduce_indptr.append(last_reduce)
                plan.works.append(row)
                remain -= rem_blocks + p.overhead
                tile = 0 if tile == ntiles - 1 else tile + 1
                kv_block, n_split, tail_done = 0, 0, False
                if not p.qo_splits or tile == 0:
                    batch += 1
                    sub_head = 0 if sub_head == p.ratio - 1 else sub_head + 1
                    if batch < p.num_batches and sub_head == 0:
                        kv_begin = kv_begin + p.topk_units if p.sparse else kv_end
                        kv_end = kv_begin + _kv_len(p, batch)
            else:
                if remain > p.overhead:
                    take = remain - p.overhead
                    row = fill(take, tile_size, ntiles)
                    if p.page_size == 1 and kv_end - row[KV_END] < p.tail_threshold:
                        tail_done = True
                        row[KV_END] = min(kv_end, kv_end - _tail(p, row[QO_START], ntiles, tile))
                        row[KV_OFFSET] = kv_end - row[KV_END]
                    if not tail_done:
                        sparse_offset(row)
                        row[PARTIAL_QO_LOC] = partial_idx
                        plan.works.append(row)
                        partial_idx += tile_size
                        kv_block += take
                        n_split += 1
                if not tail_done:
                    break
        plan.work_indptr.append(len(plan.works))
    plan.unassigned_batches = p.num_batches - batch
    return plan


def _tail(p: _Params, qo_start: int, ntiles: int, tile: int) -> int:
    """The causal KV trim of a q tile (page size 1): later tiles see more kv."""
    tail = 0 if p.cp_round_robin else ntiles - 1 - tile
    if not p.sparse and p.ratio != 1:
        tail = ntiles - _c_mod(qo_start // p.ratio, p.ori) - 1 if p.ori != 0 else _div0()
    return max(tail, 0) if p.causal else 0


def _c_mod(a: int, b: int) -> int:
    """C's %: the remainder takes the dividend's sign (uni_seqlen_qo may be -1)."""
    return a - b * int(a / b)


def _div0() -> int:
    raise RuntimeError("AITER model: the v1.2 planner divides by uni_seqlen_qo = 0 when heads "
                       "are folded: pass uni_seqlen_qo")


# --------------------------------------------------------------------------- public op


def get_mla_metadata_v1(
    seqlens_qo_indptr: torch.Tensor,
    seqlens_kv_indptr: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    num_heads_per_head_k: int,
    num_heads_k: int,
    is_causal: bool,
    work_metadata_ptrs: torch.Tensor,
    work_info_set: torch.Tensor,
    work_indptr: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    page_size: int = 1,
    kv_granularity: int = 16,
    max_seqlen_qo: int = -1,
    uni_seqlen_qo: int = -1,
    fast_mode: bool = True,
    topk: int = -1,
    max_split_per_batch: int = -1,
    intra_batch_mode: bool = False,
    is_cp_round_robin: bool = False,
    mla_version: int = 0,
    dtype_q_nope: torch.dtype | None = None,
    dtype_q_rope: torch.dtype | None = None,
    dtype_kv_nope: torch.dtype | None = None,
    dtype_kv_rope: torch.dtype | None = None,
    dtype_q: torch.dtype | None = None,
    dtype_kv: torch.dtype | None = None,
) -> None:
    """Fill the six buffers with the v1.2 plan, in place (model; see module docstring).

    Note AITER's argument order: work_info_set comes before work_indptr here, while
    get_mla_metadata_info_v1 lists work_indptr first.
    """
    if dtype_q is not None:
        dtype_q_nope = dtype_q_nope or dtype_q
        dtype_q_rope = dtype_q_rope or dtype_q
    if dtype_kv is not None:
        dtype_kv_nope = dtype_kv_nope or dtype_kv
        dtype_kv_rope = dtype_kv_rope or dtype_kv
    if not fast_mode or intra_batch_mode:
        raise NotImplementedError("the AITER model implements the v1.2 planner (fast_mode=True, "
                                  "intra_batch_mode=False) only")
    plan = plan_for(
        seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k,
        num_heads_k, is_causal, page_size=page_size, kv_granularity=kv_granularity,
        max_seqlen_qo=max_seqlen_qo, uni_seqlen_qo=uni_seqlen_qo, topk=topk,
        max_split_per_batch=max_split_per_batch, is_cp_round_robin=is_cp_round_robin,
        q_dtype=dtype_q_nope, kv_dtype=dtype_kv_nope, mla_version=mla_version,
        q_rope_dtype=dtype_q_rope or dtype_q_nope, kv_rope_dtype=dtype_kv_rope or dtype_kv_nope,
    )
    write_plan(plan, work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr,
               reduce_final_map, reduce_partial_map)


MLA_VERSION_V32, MLA_VERSION_V40 = 0, 1  # MlaVersion: V32 all fp8; V40 fp8 nope + bf16 rope


def plan_for(
    seqlens_qo_indptr: torch.Tensor, seqlens_kv_indptr: torch.Tensor,
    kv_last_page_lens: torch.Tensor, num_heads_per_head_k: int, num_heads_k: int,
    is_causal: bool, *, page_size: int = 1, kv_granularity: int = 16, max_seqlen_qo: int = -1,
    uni_seqlen_qo: int = -1, topk: int = -1, max_split_per_batch: int = -1,
    is_cp_round_robin: bool = False, q_dtype: torch.dtype | None = None,
    kv_dtype: torch.dtype | None = None, mla_version: int = MLA_VERSION_V32,
    q_rope_dtype: torch.dtype | None = None, kv_rope_dtype: torch.dtype | None = None,
) -> Plan:
    """The v1.2 plan for a batch, without buffers (the model's reference scheduler)."""
    for name, t in (("seqlens_qo_indptr", seqlens_qo_indptr),
                    ("seqlens_kv_indptr", seqlens_kv_indptr),
                    ("kv_last_page_lens", kv_last_page_lens)):
        check(t.dtype == torch.int32, f"get_mla_metadata_v1: {name} must be int32, got {t.dtype}")
    check(page_size > 0 and page_size & (page_size - 1) == 0,
          f"get_mla_metadata_v1: page_size {page_size} must be a power of 2")
    check(kv_granularity > 0 and kv_granularity & (kv_granularity - 1) == 0,
          f"get_mla_metadata_v1: kv_granularity {kv_granularity} must be a power of 2")
    gfx = get_gfx()
    experimental = experimental_enabled()
    q_fp8 = q_dtype is not None and is_fp8_dtype(q_dtype)
    kv_fp8 = kv_dtype is not None and is_fp8_dtype(kv_dtype)
    qo = [int(x) for x in seqlens_qo_indptr.tolist()]
    kv = [int(x) for x in seqlens_kv_indptr.tolist()]
    last = [int(x) for x in kv_last_page_lens.tolist()]
    sparse = topk >= 0
    num_batches = len(kv) - 1
    num_heads = num_heads_k * num_heads_per_head_k
    native = rules.natively_supported(gfx, num_heads, max_seqlen_qo, q_fp8, kv_fp8,
                                       experimental)
    ratio = 1
    if not native and num_heads % rules.FOLD_HEADS == 0:
        ratio = num_heads // rules.FOLD_HEADS
        num_heads = rules.FOLD_HEADS
        num_batches *= ratio
    check(rules.metadata_heads_supported(gfx, num_heads, max_seqlen_qo, q_fp8, kv_fp8, native,
                                          experimental), rules.METADATA_HEADS_MESSAGE)
    if mla_version == MLA_VERSION_V40:
        rope_ok = q_rope_dtype == torch.bfloat16 and kv_rope_dtype == torch.bfloat16
    else:
        rope_ok = all(d is not None and is_fp8_dtype(d) for d in (q_rope_dtype, kv_rope_dtype))
    # the gfx950 HK m16x4 kernel runs two work groups per CU: twice the clusters
    multiplier = 2 if (experimental and gfx == "gfx950" and q_fp8 and kv_fp8 and rope_ok
                       and num_heads_k * num_heads_per_head_k * max_seqlen_qo == 64) else 1
    num_clusters = get_cu_num() * multiplier // num_heads_k
    num_splits = (num_clusters if max_split_per_batch < 0
                  else min(num_clusters, max_split_per_batch * num_batches))
    ori = (qo[1] - qo[0] if len(qo) > 1 else 0) if sparse else uni_seqlen_qo
    if sparse:
        check(ori > 0, "AITER model: sparse metadata needs seqlens_qo_indptr[1] > 0")
        num_batches *= ori
    packed = rules.packed_qo_per_wg(gfx, num_heads, max_seqlen_qo, q_fp8, kv_fp8)
    params = _Params(
        qo_indptr=qo, kv_indptr=[x - kv[0] for x in kv], kv_last_page_lens=last,
        num_batches=num_batches, num_heads=num_heads, ratio=ratio, num_cu=num_clusters,
        num_splits=num_splits, page_size=page_size, gran=kv_granularity, uni=uni_seqlen_qo,
        ori=ori, sparse=sparse, topk_units=cdiv(topk, page_size) if sparse else -1,
        causal=is_causal, cp_round_robin=is_cp_round_robin,
        overhead=max(1, cdiv(OVERHEAD_TOKENS, page_size)), tail_threshold=max_seqlen_qo,
        packed_per_wg=packed,
        qo_splits=not (0 < max_seqlen_qo * num_heads_per_head_k <= packed),
    )
    return plan_v12(params)


def write_plan(plan: Plan, work_metadata_ptrs: torch.Tensor, work_info_set: torch.Tensor,
               work_indptr: torch.Tensor, reduce_indptr: torch.Tensor,
               reduce_final_map: torch.Tensor, reduce_partial_map: torch.Tensor) -> None:
    """Write a plan into AITER-format buffers (what the metadata kernel stores)."""
    n_works, n_tiles = len(plan.works), len(plan.reduce_indptr) - 1
    _fits("work_indptr", work_indptr.numel(), len(plan.work_indptr))
    _fits("work_info_set", work_info_set.shape[0], n_works)
    _fits("reduce_indptr", reduce_indptr.numel(), n_tiles + 1)
    _fits("reduce_final_map", reduce_final_map.shape[0], n_tiles)
    _fits("reduce_partial_map", reduce_partial_map.numel(), len(plan.reduce_partial_map))
    dev = work_info_set.device

    def put(dst: torch.Tensor, values: list[int] | list[list[int]]) -> None:
        if values:
            dst.copy_(torch.tensor(values, dtype=dst.dtype).to(dev))

    put(work_indptr[: len(plan.work_indptr)], plan.work_indptr)
    put(work_info_set[:n_works], plan.works)
    last = plan.reduce_indptr[-1]
    put(reduce_indptr, plan.reduce_indptr + [last] * (reduce_indptr.numel() - n_tiles - 1))
    if plan.reduce_final_map:  # only split tiles: the other rows keep what they held
        tiles = torch.tensor(list(plan.reduce_final_map), dtype=torch.long, device=dev)
        rows = torch.tensor(list(plan.reduce_final_map.values()), dtype=reduce_final_map.dtype)
        reduce_final_map[tiles] = rows.to(dev)
    put(reduce_partial_map[: len(plan.reduce_partial_map)], plan.reduce_partial_map)
    ptrs = [work_indptr.data_ptr(), work_info_set.data_ptr()]
    work_metadata_ptrs.view(torch.int64)[:2].copy_(torch.tensor(ptrs, dtype=torch.int64))


def _fits(name: str, capacity: int, needed: int) -> None:
    check(needed <= capacity,
          f"AITER model: the metadata needs {needed} entries of {name} but the buffer holds "
          f"{capacity} (AITER's kernel would write past its end): size it with "
          "get_mla_metadata_info_v1 for this batch, q length and head count")
