"""Head-count and tiling rules of AITER's MLA decode (model of aiter/mla.py and the v1.2
metadata C++), shared by the metadata planner, the decode path and the validator.

Pure functions of (chip, heads, q length, FP8-ness): no tensors, no environment reads. The
head counts and q lengths in the conditions are the kernel variants AITER ships per chip.
"""

from __future__ import annotations

FOLD_HEADS = 16  # heads per folded pseudo-batch: the kernels' native 16-head tile
FOLDABLE_HEADS = range(32, 128 + 1, 16)  # what mla_decode_fwd folds (32..128 step 16)
PACKED_QO_PER_WG = 128  # packed (token x head) query rows per work group, default
PACKED_QO_PER_WG_NARROW = 64  # the gfx950 variants that pack 64 rows
MAX_SPLIT_SEARCH = 16  # get_meta_param tries 1..16 KV splits
SPLIT_OVERHEAD = 84.1  # get_meta_param's per-split cost, in kv tokens


def natively_supported(gfx: str, nhead: int, max_seqlen_q: int, q_fp8: bool, kv_fp8: bool,
                       experimental: bool = False) -> bool:
    """Head counts the persistent kernels take without folding (mla_decode_fwd's list)."""
    fp8_both = q_fp8 and kv_fp8
    bf16_both = not q_fp8 and not kv_fp8
    return (
        nhead == 16
        or (gfx == "gfx942" and nhead == 128 and fp8_both)
        or (gfx == "gfx950" and nhead == 128 and fp8_both and experimental)
        or (gfx == "gfx942" and nhead in (16, 32, 64) and nhead * max_seqlen_q == 128
            and fp8_both and experimental)
        or (gfx == "gfx950" and fp8_both and nhead in (32, 64, 128))
        or (gfx == "gfx950" and nhead == 8 and fp8_both and max_seqlen_q == 4)
        or (gfx == "gfx942" and nhead == 8 and bf16_both and max_seqlen_q == 2)
        or (gfx == "gfx942" and nhead == 64 and fp8_both and max_seqlen_q == 1)
        or (gfx == "gfx950" and bf16_both)
    )


def head_fold(gfx: str, nhead: int, max_seqlen_q: int, q_fp8: bool, kv_fp8: bool,
              experimental: bool = False) -> int:
    """Pseudo-batches per request the metadata planner makes (its qk_batch_ratio): heads not
    natively supported but a multiple of 16 are folded into nhead/16 groups of 16."""
    if natively_supported(gfx, nhead, max_seqlen_q, q_fp8, kv_fp8, experimental):
        return 1
    return nhead // FOLD_HEADS if nhead % FOLD_HEADS == 0 else 1


def metadata_heads_supported(gfx: str, folded_heads: int, max_seqlen_qo: int, q_fp8: bool,
                             kv_fp8: bool, native: bool, experimental: bool = False) -> bool:
    """The metadata planner's AITER_CHECK on the (folded) head count."""
    fp8_both = q_fp8 and kv_fp8
    bf16_both = not q_fp8 and not kv_fp8
    h = folded_heads
    hk_mtp = (gfx in ("gfx942", "gfx950") and fp8_both and h * max_seqlen_qo == 128
              and h in (16, 32, 64, 128) and experimental)
    return (
        native or h in (16, 128)
        or (h == 32 and fp8_both)
        or (h == 64 and fp8_both and max_seqlen_qo == 1)
        or (gfx == "gfx950" and h == 8 and max_seqlen_qo == 4 and fp8_both)
        or (gfx == "gfx942" and h == 8 and max_seqlen_qo == 2 and bf16_both)
        or (gfx == "gfx950" and bf16_both)
        or (gfx == "gfx950" and fp8_both and ((h == 32 and max_seqlen_qo == 4) or h in (64, 128)))
        or hk_mtp
    )


METADATA_HEADS_MESSAGE = (
    "get_mla_metadata_v1_2_device: only supports #heads in [16, 64, 128], or (#head, "
    "uni_seqlen_qo) = (16*N, 1) where N is in [2, 8), or (#head, max_seqlen_qo) = (8, 4) where "
    "q and kv are fp8, or q and kv are bf16 on gfx950"
)


def packed_qo_per_wg(gfx: str, folded_heads: int, max_seqlen_qo: int, q_fp8: bool,
                     kv_fp8: bool) -> int:
    """Packed query rows one work group takes (the C++ kPackedQoLenPerWg)."""
    packed = folded_heads * max_seqlen_qo
    narrow, wide = PACKED_QO_PER_WG_NARROW, PACKED_QO_PER_WG
    if (gfx == "gfx950" and not q_fp8 and not kv_fp8 and packed >= narrow
            and folded_heads <= narrow and (packed < wide or folded_heads == 48)):
        return PACKED_QO_PER_WG_NARROW
    if gfx == "gfx950" and q_fp8 and kv_fp8 and folded_heads == 32 and max_seqlen_qo == 3:
        return PACKED_QO_PER_WG_NARROW
    return PACKED_QO_PER_WG


def info_tiles_per_batch(gfx: str, num_head_qo: int, effective_seqlen_qo: int, q_fp8: bool,
                         kv_fp8: bool, experimental: bool = False) -> int:
    """get_mla_metadata_info_v1's max_qo_tiles_per_batch: packed (token x head) query rows
    per batch over the rows a work group takes (16 by default: one folded 16-head group)."""
    packed = effective_seqlen_qo * num_head_qo
    h, s = num_head_qo, effective_seqlen_qo
    wide, narrow = PACKED_QO_PER_WG, PACKED_QO_PER_WG_NARROW
    fp8_both = q_fp8 and kv_fp8
    bf16_both = not q_fp8 and not kv_fp8
    if ((gfx == "gfx950" and bf16_both and packed >= narrow and h <= narrow
         and (packed < wide or h == 48))
            or (gfx == "gfx950" and fp8_both and h == 32 and s == 3)):
        return s if h * 2 > narrow else -(-packed // narrow)
    if (h == FOLD_HEADS
            or (gfx == "gfx942" and h == 128 and fp8_both)
            or (gfx == "gfx942" and h in (16, 32, 64) and h * s == wide and fp8_both
                and experimental)
            or (gfx == "gfx950" and fp8_both and ((h == 32 and s == 4) or h in (64, 128)))
            or (gfx in ("gfx942", "gfx950") and h == 64 and fp8_both and s == 1)):
        return -(-packed // wide)
    if gfx == "gfx950" and (packed >= wide or h > narrow) and bf16_both and h != 48:
        return s if h * 2 > wide else -(-packed // wide)
    return -(-packed // FOLD_HEADS)


def decode_occupancy(gfx: str, num_head_qo: int, max_seqlen_qo: int, q_fp8: bool,
                     kv_fp8: bool, experimental: bool = False) -> int:
    """get_mla_decode_fwd_occupancy: 2 only for the gfx950 HK m16x4 kernel."""
    hk_m16x4 = gfx == "gfx950" and q_fp8 and kv_fp8 and num_head_qo * max_seqlen_qo == 64
    return 2 if hk_m16x4 and experimental else 1
