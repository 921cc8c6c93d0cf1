"""What AITER's MLA kernels accept, as data the adapter's capabilities are built from: head
counts and their padding, page sizes, the chips' head folding.
"""


from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from mlacheck import fp8
from mlacheck.backends.aiter import rules
from mlacheck.backends.aiter.api import (
    AdapterError,
)
from mlacheck.backends.base import CaseRule
from mlacheck.spec import Case

MIN_AITER_HEADS = 16  # AITER's MLA kernels and metadata work in groups of 16 query heads
MAX_DECODE_HEADS = 128
# Non-persistent decode cannot fold heads: it needs a kernel for the padded head count.
# From AITER main's hsa/<gfx>/mla/mla_asm.csv (ps = 0 rows, after asm_mla.cu's qlen mapping):
# bf16 16 / 32 / 64 / 128 (gfx942: no 64-head q_len-1 kernel); fp8 16 and 128 only (fp8
# gqa 64 "only supports persistent mode", no fp8 gqa 32 non-persistent kernel).
NONPERSISTENT_HEAD_TARGETS = (16, 32, 64, 128)
NONPERSISTENT_BF16_GFX942_QLEN1_TARGETS = (16, 32, 128)
NONPERSISTENT_FP8_HEADS = (16, 128)


def nonpersistent_head_targets(gfx: str, q_fp8: bool, max_q_len: int) -> tuple[int, ...]:
    """Head counts a non-persistent decode kernel exists for (see above)."""
    if q_fp8:
        return NONPERSISTENT_FP8_HEADS
    if gfx == "gfx942" and max_q_len == 1:
        return NONPERSISTENT_BF16_GFX942_QLEN1_TARGETS
    return NONPERSISTENT_HEAD_TARGETS
DEFAULT_MAX_SPLIT_PER_BATCH = 32  # what AITER's op tests pass (and vLLM's cap)
# Non-persistent: a fixed split count (> 1 so the Triton merge runs and writes the LSE; the
# one-split fp8 kernel writes none, which is why vLLM forces >= 2 splits for LSE too).
DEFAULT_NONPERSISTENT_KV_SPLITS = 8
PAGE_SIZES_POW2 = tuple(2**i for i in range(11))  # metadata and kernels need log2(page_size)
# mla_reduce_v1 instantiations for Dv 128 (the FP8 prefill reduce always runs).
PREFILL_PS_HEADS = (1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128)
PREFILL_PS_TILE_Q = 256  # qlen granularity of the FP8 ASM prefill kernel (vLLM's tile)
PREFILL_PS_KVLEN_GRANULARITY = 128
# The message AITER raises when no kernel variant matches (asm_mla.cu get_heuristic_kernel_mla).
NO_KERNEL_MESSAGE = "cannot get heuristic kernel"

# Why the kernels refuse what the capabilities leave out, read in AITER at TARGET_COMMIT
# (e4048607a5; paths from the repository root). Appended to the SKIP reasons.
ASM_FORMATS = ("the ASM MLA kernels exist for (qType, kvType) bf16/bf16, fp8/fp8 and bf16/fp8 "
               "(the a16w8 rows are persistent, ps=1): hsa/gfx950/mla/mla_asm.csv, "
               "hsa/gfx942/mla/mla_asm.csv; fp8 is the chip's e4m3 (fnuz on gfx942, fn on "
               "gfx950: aiter/utility/dtypes.py:12-13)")
DECODE_REASONS = {
    "q_formats": ASM_FORMATS, "kv_formats": ASM_FORMATS, "format_pairs": ASM_FORMATS,
    "page_sizes": "the kernel takes log2 of the page size (log2_page, "
                  "csrc/py_itfs_cu/asm_mla.cu:419, :715)",
    "layouts": "kv_buffer is [num_page, page_size, num_kv_heads, head_size] "
               "(csrc/py_itfs_cu/asm_mla.cu:646)",
}
PREFILL_PS_REASONS = {
    "q_formats": "mla_prefill_ps_fwd takes fp8 Q and K only ('unsupport Q dtype' / 'unsupport "
                 "K dtype', csrc/py_itfs_cu/asm_mla.cu:1148-1156; the chip's e4m3, "
                 "aiter/utility/dtypes.py:12-13)",
    "kv_formats": "mla_prefill_ps_fwd takes fp8 Q and K only (csrc/py_itfs_cu/asm_mla.cu:"
                  "1153-1156)",
    "head_counts": "the reduce that always runs has Dv-128 instantiations for these head counts "
                   "only (MLA_REDUCE_ROUTER, csrc/kernels/mla/reduce.cu:924-940)",
    "per_token_scales": "q_scale / k_scale / v_scale are fp32 scalars "
                        "(csrc/py_itfs_cu/asm_mla.cu:1104-1106)",
    "soft_cap": "mla_prefill_ps_fwd has no logit cap parameter (aiter/mla.py:1191-1212)",
}
PAGED_PREFILL_REASONS = {
    "q_formats": "mha_batch_prefill takes fp16, bf16 or fp8_e4m3 q, k and v of one dtype "
                 "(csrc/py_itfs_ck/mha_batch_prefill_kernels.cu:440-448); fp8 is the chip's "
                 "e4m3 (aiter/utility/dtypes.py:12-13)",
    "kv_formats": "k and v have q's dtype ('query and key must have the same dtype', "
                  "csrc/py_itfs_ck/mha_batch_prefill_kernels.cu:447-448)",
    "format_pairs": "k and v have q's dtype (csrc/py_itfs_ck/mha_batch_prefill_kernels.cu:"
                    "447-448)",
}



# --------------------------------------------------------------------------- head padding


def _bits_view(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the same width (fp8 has no cat / repeat kernels on every device)."""
    return t.view(fp8.int_dtype(t.dtype))


@dataclass(frozen=True)
class HeadPadding:
    """How H query heads become the head count AITER runs with, and back.

    `repeat > 1`: each head duplicated `repeat` times in a row (vLLM's
    `q.repeat_interleave(16 // H)`, unpadded by `o[:, ::16 // H]`); only for H dividing 16.
    Otherwise `padded - heads` zero heads are appended and `o[:, :H]` is kept.
    """

    heads: int
    padded: int
    repeat: int = 1

    @property
    def identity(self) -> bool:
        return self.padded == self.heads

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [T, padded, D], contiguous, same dtype."""
        if self.identity:
            return x.contiguous()
        bits = _bits_view(x.contiguous())
        if self.repeat > 1:
            out = bits.repeat_interleave(self.repeat, dim=1)
        else:
            zeros = bits.new_zeros((x.shape[0], self.padded - self.heads, *x.shape[2:]))
            out = torch.cat([bits, zeros], dim=1)  # all-zero bits are +0.0 in every format
        return out.view(x.dtype).contiguous()

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, padded, ...] -> [T, H, ...] (a view)."""
        if self.identity:
            return x
        return x[:, :: self.repeat] if self.repeat > 1 else x[:, : self.heads]


def head_padding(heads: int, targets: Collection[int] | None = None) -> HeadPadding:
    """The padding for `heads` query heads.

    targets None: any multiple of 16 (persistent decode: AITER folds 32..128 itself).
    Divisors of 16 repeat each head 16 // H times, as vLLM does. Every other count is padded
    with zero heads: `16 // 12 == 1`, so "repeat 16 // H times" would leave 12 heads
    unpadded (bug class 5); 24 -> 32 likewise (a zero head attends uniformly and
    is sliced off).
    """
    if heads < MIN_AITER_HEADS and MIN_AITER_HEADS % heads == 0:
        return HeadPadding(heads, MIN_AITER_HEADS, MIN_AITER_HEADS // heads)
    if targets is None:
        padded = -(-heads // MIN_AITER_HEADS) * MIN_AITER_HEADS
    else:
        fits = [t for t in sorted(targets) if t >= heads]
        if not fits:
            raise AdapterError(f"{heads} heads exceed the largest AITER head count {max(targets)}")
        padded = fits[0]
    return HeadPadding(heads, padded)


# --------------------------------------------------------------------------- capabilities

def nonpersistent_fp8_heads(case: Case) -> str | None:
    """fp8 non-persistent kernels exist for 16 and 128 heads: pad up to 16, never 8x to 128."""
    if not fp8.fmt(case.quant.q).is_fp8 or case.num_heads <= MIN_AITER_HEADS:
        return None
    if case.num_heads not in NONPERSISTENT_FP8_HEADS:
        return (f"non-persistent fp8 decode has kernels for 16 or 128 heads only, not "
                f"{case.num_heads} (use persistent decode; the fp8 ps=0 rows of "
                f"hsa/gfx950/mla/mla_asm.csv)")
    return None


def aiter_folds_heads(gfx: str, heads: int, max_q_len: int, q_fp8: bool, kv_fp8: bool) -> bool:
    """Whether persistent decode runs `heads` (already padded) as heads/16 pseudo-batches of
    16: the head counts AITER's persistent kernels do NOT take natively (mla_decode_fwd's
    list, mlacheck.backends.aiter.rules), with AITER_ENABLE_EXPERIMENTAL off as the adapter
    pins it."""
    return (not rules.natively_supported(gfx, heads, max_q_len, q_fp8, kv_fp8)
            and heads % rules.FOLD_HEADS == 0)


def folded_heads_need_uniform_q_len(gfx: str) -> CaseRule:
    """AITER folds heads only for a uniform q_len: mla_decode_fwd reshapes q as
    [T // max_q, max_q, fold, 16, D], and the v1.2 planner, given uni_seqlen_qo = -1, reads
    qo_indptr at the pseudo-batch index (b * fold + f): out of bounds for mixed MTP lengths."""

    def rule(case: Case) -> str | None:
        lens = {n for n in case.q_lengths if n}  # empty requests are left out of the call
        if len(lens) == 1 or case.sparse:  # sparse: every token a pseudo-request of q_len 1
            return None
        padded = head_padding(case.num_heads).padded
        if aiter_folds_heads(gfx, padded, max(lens), fp8.fmt(case.quant.q).is_fp8,
                             fp8.fmt(case.quant.kv).is_fp8):
            return (f"AITER folds {padded} heads into 16-head pseudo-batches only for a uniform "
                    f"q_len (q reshaped by total_s // max_seqlen_q, aiter/mla.py:819-836); this "
                    f"batch mixes q_len {sorted(lens)}")
        return None

    return rule


