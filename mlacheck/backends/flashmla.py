"""`flashmla`: DeepSeek's FlashMLA decode on sm_90 (H100/H200): dense, and sparse FP8 (V3.2).

`flash_mla.get_mla_metadata()` + `flash_mla.flash_mla_with_kvcache(...)`: the absorbed-MLA
decode (q 576, kv 576, v = the first 512 channels) over a paged latent cache with FlashMLA's
own persistent tile scheduler (the first call of a schedule computes the work split across
the SMs; the NVIDIA analogue of AITER's persistent decode metadata). q is
[batch, q_len, heads, 576], one q_len per call: a mixed MTP batch runs as one call per q_len,
empty requests left out. The LSE comes back as [batch, heads, q_len] in natural log.

mla_decode (dense): the cache is mlacheck's latent pool as is when its pages are 64 tokens
([pages, 64, 1, 576]: FlashMLA's [num_blocks, page_block_size, num_heads_k, head_dim]); other
page sizes are repacked into a fresh shuffled, tail-poisoned page-64 pool ("Currently
page_block_size must be 64", csrc/api/dense_decode.h), and the verdict's metadata says so.
The page table goes in vLLM's form (block_table + cache_seqlens).

mla_sparse_decode (DeepSeek-V3.2 top-k, `indices=` with `is_fp8_kvcache=True`, causal off):
the cache is FlashMLA's 656-byte V3.2 token (512 float8_e4m3fn NoPE values, 4 float32 scales,
one per 128 NoPE channels, 64 bfloat16 RoPE values), built from mlacheck's fp8_e4m3fn pool
*exactly* by `v32_cache`: every dequantised value the kernel can form is bit for bit the one
the golden uses (see there why), with per-token, per-tile power-of-two scales that really
vary. Pages stay where they are, any page size, so `indices` are the pool's global slots
`page * page_size + offset` (-1 = none, mlacheck's own padding; `topk_length` is not
passed). A query row with no valid index gets LSE +inf from FlashMLA (and output 0):
converted to mlacheck's -inf for exactly those rows (`lse_empty_rows`).

mla_sparse_prefill (V3.2 prefill, `flash_mla_sparse_fwd`): bf16 q [T, H, 576] over the flat
latent KV [N, 1, 576] with per-token global row indices [T, 1, topk] (-1 padded); returns out,
max_logits and the natural-log LSE, +inf (max_logits -inf) for a row without a valid index,
read as mlacheck's -inf for exactly those rows.

What it does not take (SKIP with the reason): FP8 dense caches (sm_90 dense decode is
bf16/fp16 only), pools in a non-linear layout (repacking one would claim a layout the kernel
never saw); for the sparse decode anything but bf16 q over an fp8_e4m3fn pool with a unit
(power-of-two) scale, and head counts other than 64 and 128.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mlacheck import fp8, layouts
from mlacheck.backends.base import Capability, Output
from mlacheck.backends.toolkit import (
    LibraryAdapter,
    Loaded,
    cuda_refusal,
    load_library,
    lse_empty_rows,
    lse_natural,
    lse_tokens_heads,
    topk_to_global_slots,
)
from mlacheck.inputs import DecodeInputs, Inputs, generator
from mlacheck.kvcache import KVPool, repaged
from mlacheck.pipeline_inputs import SparsePrefillInputs
from mlacheck.spec import Case, DecodeCase, Op, SparseDecodeCase, SparsePrefillCase

MODULE = "flash_mla"
DISTRIBUTIONS = ("flash_mla", "flash-mla")
INSTALL_HINT = "build deepseek-ai/FlashMLA for sm_90 (docs/flashmla.md)"
PAGE_SIZE = 64  # "Currently page_block_size must be 64" (csrc/api/dense_decode.h)
REPAGE_SALT = 0x64  # seeds the shuffled page order of a repacked page-64 pool
FORMATS = ("bf16", "fp16")  # sm_90 dense decode: bf16 / fp16 q and cache of the same dtype

# Sparse FP8 decode (csrc/api/sparse_decode.h): bf16 q, the V3.2 cache, h_q 64 or 128 on sm_90.
SPARSE_Q, SPARSE_KV = "bf16", "fp8_e4m3fn"
SPARSE_HEADS = (64, 128)
V32_NOPE, V32_ROPE, V32_TILE = 512, 64, 128  # NoPE channels, RoPE channels, channels per scale
V32_TILES = V32_NOPE // V32_TILE
V32_TOKEN_BYTES = V32_NOPE + 4 * V32_TILES + 2 * V32_ROPE  # 656
E4M3_MAX = fp8.fmt(SPARSE_KV).max  # 448
CONVERT_TOKENS = 1 << 15  # tokens converted at a time (bounds the fp32 working copies)

CALLED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "get_mla_metadata": (),
    "flash_mla_with_kvcache": (
        "q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
        "softmax_scale", "causal", "is_fp8_kvcache", "indices"),
    "flash_mla_sparse_fwd": ("q", "kv", "indices", "sm_scale", "d_v"),
}
DECODE_FUNCTIONS = ("get_mla_metadata", "flash_mla_with_kvcache")

# Sparse prefill (csrc/api/sparse_fwd.h, sm_90): bf16 q [s_q, h_q, 576] and kv [s_kv, 1, 576],
# h_q 64 or 128, topk a multiple of 128 (the kernel's index block; measured on the H100 at
# 128 / 512 / 2048: docs/flashmla.md).
SPARSE_PREFILL_HEADS = (64, 128)
SPARSE_PREFILL_TOPK_MULTIPLE = 128
# Every SKIP reason below is a kernel limit read in FlashMLA's sources at 9241ae3 (the head of
# its main when fetched), named by file:line.
SPARSE_PREFILL_REASONS = {
    "q_formats": "flash_mla_sparse_fwd takes bf16 q and kv (KU_CHECK_DTYPE(q / kv, kBFloat16), "
                 "csrc/api/sparse_fwd.h:140-141)",
    "kv_formats": "flash_mla_sparse_fwd takes bf16 q and kv (KU_CHECK_DTYPE(q / kv, kBFloat16), "
                  "csrc/api/sparse_fwd.h:140-141)",
    "head_counts": "FlashMLA's sm_90 sparse prefill: h_q 64 or 128 ('Unsupported h_q', "
                   "csrc/api/sparse_fwd.h:192-197)",
}

SPARSE_REASONS = {
    "q_formats": "FlashMLA's sparse decode takes bf16 q (KU_CHECK_DTYPE(q, kBFloat16), "
                 "csrc/api/sparse_decode.h:259)",
    "kv_formats": "FlashMLA's V3.2 sparse cache stores float8_e4m3fn NoPE values ('key must have "
                  "dtype fp8_e4m3fn, int8 or uint8', csrc/api/sparse_decode.h:260; the 656-byte "
                  "token, flash_mla/flash_mla_interface.py:94-98)",
    "format_pairs": "FlashMLA's sparse decode: bf16 q over a float8_e4m3fn V3.2 cache "
                    "(csrc/api/sparse_decode.h:259-260)",
    "scale_policies": "the V3.2 cache keeps RoPE in bf16 (64 bfloat16 values, 'not quantized', "
                      "flash_mla/flash_mla_interface.py:98): fp8 x s is exact in bf16 only for a "
                      "power-of-two s; the unit scale is one",
    "head_counts": "FlashMLA's sm_90 sparse decode: h_q 64 or 128 ('Unsupported h_q', "
                   "csrc/api/sparse_decode.h:328-334)",
    "layouts": "the kernel reads only its own 656-byte V3.2 token, a page's tokens contiguous "
               "(KU_CHECK_SHAPE(kv, ..., bytes_per_token) and 'The whole block must be "
               "contiguous', csrc/api/sparse_decode.h:299-301); it is built page for page from "
               "a linear pool",
}

# The dense decode (csrc/api/dense_decode.h): 16-bit q and a cache of q's dtype, read through a
# block / row / head stride with a contiguous last dimension.
DECODE_REASONS = {
    "q_formats": "FlashMLA's sm_90 dense decode takes bf16 / fp16 q ('TORCH_CHECK(q_dtype == "
                 "kBFloat16 || q_dtype == kHalf)', csrc/api/dense_decode.h:33)",
    "kv_formats": "FlashMLA's sm_90 dense decode: the cache has q's 16-bit dtype ('query and key "
                  "must have the same dtype', csrc/api/dense_decode.h:35)",
    "format_pairs": "FlashMLA's sm_90 dense decode: the cache has q's 16-bit dtype ('query and "
                    "key must have the same dtype', csrc/api/dense_decode.h:33-35)",
    "layouts": "FlashMLA's dense decode reads k_cache [num_blocks, page_block_size, num_heads_k, "
               "head_size] through its block / row / head strides with a contiguous last "
               "dimension (csrc/api/dense_decode.h:49, :81, :146-153); CK's vectorized pages "
               "interleave tokens inside each 16-byte channel group, which no such strides "
               "describe",
}

# The MHA-form prefill ops: kernel limits, read in FlashMLA's sources (9241ae3).
BINDINGS = ("its bindings are sparse_decode_fwd, dense_decode_fwd, sparse_prefill_fwd, "
            "dense_prefill_fwd / _bwd: csrc/api/api.cpp:10-14")
PREFILL_REFUSALS = {
    Op.PREFILL: "FlashMLA's dense prefill (dense_prefill_fwd = FMHACutlassSM100FwdRun, "
                "csrc/api/api.cpp:13; csrc/sm100/prefill/dense) is sm_100 only: no sm_90 kernel",
    Op.PAGED_PREFILL: f"FlashMLA has no paged MHA prefill ({BINDINGS}; the dense prefill is "
                      "sm_100's varlen, the sparse one flash_mla_sparse_fwd)",
}
# The DeepSeek-V3.2 indexer side of the sparse path: no FlashMLA kernel at all (DeepGEMM has the
# logits; the top-k and the positions -> slots conversion are the serving engine's).
NO_KERNEL_OPS = {
    Op.MQA_LOGITS: "the indexer logits", Op.PAGED_MQA_LOGITS: "the paged indexer logits",
    Op.TOPK: "a top-k selection", Op.INDEX_CONVERSION: "a positions -> slots conversion",
    Op.SPARSE_PIPELINE: "the indexer stages of the sparse pipeline",
}
NO_KERNEL_REFUSALS = {op: f"FlashMLA has no kernel for {what} ({BINDINGS})"
                      for op, what in NO_KERNEL_OPS.items()}


def load() -> Loaded | str:
    """Import flash_mla and check the installed signatures; a one-line reason otherwise."""
    return load_library(MODULE, distributions=DISTRIBUTIONS, install_hint=INSTALL_HINT,
                        called=CALLED_PARAMETERS)


class FlashMLABackend(LibraryAdapter):
    """FlashMLA's dense and sparse FP8 decode behind the backend contract."""

    def __init__(self, name: str = "flashmla") -> None:
        self.name = name

    def import_library(self) -> Loaded | str:
        return load()

    def machine_refusal(self) -> str | None:
        return cuda_refusal("FlashMLA", 9, "this adapter runs FlashMLA's sm_90 decode kernels "
                                           "(H100/H200) only")

    def capabilities(self) -> dict[str, Capability]:
        got = self.loaded()
        if isinstance(got, str):
            return {Op.DECODE: Capability(refusal=got),
                    Op.SPARSE_DECODE: Capability(refusal=got),
                    Op.SPARSE_PREFILL: Capability(refusal=got)}
        problem = got.first_problem(DECODE_FUNCTIONS)
        return {
            **{op: Capability(refusal=why)
               for op, why in {**PREFILL_REFUSALS, **NO_KERNEL_REFUSALS}.items()},
            Op.DECODE: Capability(
                q_formats=FORMATS, kv_formats=FORMATS,
                format_pairs=frozenset((f, f) for f in FORMATS), empty_requests=True,
                layouts=(layouts.LINEAR.name,),  # FlashMLA's cache: linear pages only
                causal=(True,), lse=True, devices=("cuda",), refusal=problem,
                reasons=DECODE_REASONS,
                notes="flash_mla_with_kvcache dense decode, persistent tile scheduler; LSE "
                      "natural log. Pages other than 64 run repacked into a page-64 pool; a "
                      "batch of mixed q_len runs as one call per q_len (empty requests left "
                      "out)"),
            Op.SPARSE_DECODE: Capability(
                q_formats=(SPARSE_Q,), kv_formats=(SPARSE_KV,),
                format_pairs=frozenset({(SPARSE_Q, SPARSE_KV)}), scale_policies=("unit",),
                head_counts=SPARSE_HEADS, empty_requests=True, layouts=(layouts.LINEAR.name,),
                lse=True, devices=("cuda",), refusal=problem, rules=(_v32_dims,),
                reasons=SPARSE_REASONS,
                notes="flash_mla_with_kvcache sparse FP8 decode (indices=, is_fp8_kvcache=True, "
                      "causal=False) over the 656-byte V3.2 cache built exactly from the pool "
                      "(per-token x 128-channel power-of-two scales); indices = global slots, "
                      "-1 padded; any page size; LSE natural log, +inf of rows without a valid "
                      "index read as -inf; one call per q_len"),
            Op.SPARSE_PREFILL: Capability(
                q_formats=("bf16",), kv_formats=("bf16",), head_counts=SPARSE_PREFILL_HEADS,
                empty_requests=True, devices=("cuda",), reasons=SPARSE_PREFILL_REASONS,
                refusal=got.first_problem(("flash_mla_sparse_fwd",)),
                rules=(_v32_dims,),
                notes="flash_mla_sparse_fwd over the flat latent KV; (out, max_logits, lse): "
                      "LSE natural log, +inf (and max_logits -inf) of rows without a valid "
                      "index read as -inf; a topk that is no multiple of 128 goes in padded "
                      "with -1 (invalid) indices"),
        }

    def run(self, case: Case, inputs: Inputs) -> Output:
        got = self.loaded()
        if isinstance(got, str):
            raise RuntimeError(got)
        if case.op == Op.SPARSE_PREFILL:
            return self._sparse_prefill(got, case, inputs)  # type: ignore[arg-type]
        assert isinstance(inputs, DecodeInputs)
        if case.op == Op.SPARSE_DECODE:
            return self._sparse(got, case, inputs)  # type: ignore[arg-type]
        dev, heads, dv = inputs.device, case.num_heads, case.dims.kv_lora_rank
        pool = inputs.pool
        repacked = pool.table.page_size if _needs_repage(pool) else None
        if repacked is not None:
            pool = repaged(pool, PAGE_SIZE, case.placement.tail_poison, generator(case, REPAGE_SALT))
        block_table, seqlens = pool.table.to_vllm()
        block_table, seqlens = block_table.to(dev), seqlens.to(dev)
        out = torch.zeros(case.total_q, heads, dv, dtype=inputs.q.stored.dtype, device=dev)
        lse = torch.zeros(case.total_q, heads, dtype=torch.float32, device=dev)
        sm_parts = []
        for rows, tokens, s_q in _uniform_groups(case, inputs.qo_indptr):
            q = inputs.q.stored[tokens.to(dev)].view(len(rows), s_q, heads, case.dims.latent)
            sched, _ = got.module.get_mla_metadata()
            o, l = got.module.flash_mla_with_kvcache(
                q=q, k_cache=pool.data, block_table=block_table[rows.to(dev)],
                cache_seqlens=seqlens[rows.to(dev)], head_dim_v=dv,
                tile_scheduler_metadata=sched, softmax_scale=case.softmax_scale, causal=True)
            out[tokens.to(dev)] = o.reshape(-1, heads, dv)
            lse[tokens.to(dev)] = lse_tokens_heads(lse_natural(l), len(tokens), heads)  # [b, H, s_q]
            sm_parts.append(_sm_parts(sched))
        meta: dict[str, Any] = {"flashmla": {
            "version": got.version, "sm_parts": sm_parts, "calls": len(sm_parts),
            "repacked_from_page_size": repacked}}
        return Output(out, lse, metadata=meta)

    def _sparse(self, got: Loaded, case: SparseDecodeCase, inputs: DecodeInputs) -> Output:
        assert inputs.topk_indices is not None
        dev, heads, dv = inputs.device, case.num_heads, case.dims.kv_lora_rank
        cache = v32_cache(inputs.pool)
        slots = topk_to_global_slots(inputs.topk_indices, inputs.qo_indptr, inputs.table)
        topk = slots.shape[1]
        out = torch.zeros(case.total_q, heads, dv, dtype=torch.bfloat16, device=dev)
        lse = torch.zeros(case.total_q, heads, dtype=torch.float32, device=dev)
        sm_parts = []
        for rows, tokens, s_q in _uniform_groups(case, inputs.qo_indptr):
            tok = tokens.to(dev)
            b = len(rows)
            q = inputs.q.stored[tok].view(b, s_q, heads, case.dims.latent)
            sched, _ = got.module.get_mla_metadata()
            o, l = got.module.flash_mla_with_kvcache(
                q=q, k_cache=cache.data, block_table=None, cache_seqlens=None, head_dim_v=dv,
                tile_scheduler_metadata=sched, softmax_scale=case.softmax_scale, causal=False,
                is_fp8_kvcache=True, indices=slots[tok].view(b, s_q, topk))
            if tuple(l.shape) != (b, heads, s_q):  # the docstring's [b, h_q, s_q] (a transposed
                raise ValueError(  # view of the [b, s_q, h_q] sparse_decode.h allocates)
                    f"FlashMLA sparse LSE of shape {tuple(l.shape)}, expected [batch {b}, "
                    f"heads {heads}, q_len {s_q}]")
            out[tok] = o.reshape(-1, heads, dv)
            lse[tok] = lse_tokens_heads(lse_natural(l), len(tokens), heads)
            sm_parts.append(_sm_parts(sched))
        lse = lse_empty_rows(lse, (inputs.topk_indices < 0).all(dim=1))  # FlashMLA: +inf there
        meta: dict[str, Any] = {"flashmla": {
            "version": got.version, "sm_parts": sm_parts, "calls": len(sm_parts),
            "v32_cache": {"tile_scales": "per token x 128 channels, power of two",
                          "pow2_shift_min": cache.shift_min, "pow2_shift_max": cache.shift_max,
                          "tiles_kept": cache.tiles_kept}}}
        return Output(out, lse, metadata=meta)


    def _sparse_prefill(self, got: Loaded, case: SparsePrefillCase,
                        inputs: SparsePrefillInputs) -> Output:
        """flash_mla_sparse_fwd(q [T, H, 576], kv [N, 1, 576], indices [T, 1, topk] global rows,
        -1 padded) -> (out [T, H, 512], max_logits [T, H], lse [T, H]): its own buffers,
        copied into the guarded output."""
        indices = padded_topk(inputs.indices, SPARSE_PREFILL_TOPK_MULTIPLE)
        out, max_logits, lse = got.module.flash_mla_sparse_fwd(
            q=inputs.q.stored.contiguous(), kv=inputs.kv.stored.contiguous(),
            indices=indices, sm_scale=case.softmax_scale, d_v=case.dims.kv_lora_rank)
        target = inputs.out.out
        if tuple(out.shape) != tuple(target.shape):
            raise ValueError(f"flash_mla_sparse_fwd returned out {tuple(out.shape)}, expected "
                             f"{tuple(target.shape)}")
        target.copy_(out)
        empty = inputs.empty_rows
        lse = lse_empty_rows(lse_tokens_heads(lse_natural(lse), case.total_q, case.num_heads),
                             empty)
        meta: dict[str, Any] = {"flashmla": {
            "version": got.version, "op": "flash_mla_sparse_fwd",
            "indices_padded_to": indices.shape[-1] if indices.shape[-1] != case.topk else None}}
        return Output(target, lse, metadata=meta, wrote_into_guarded=True,
                      extra={"max_logits": lse_tokens_heads(max_logits.float(), case.total_q,
                                                            case.num_heads)})


@dataclass
class V32Cache:
    """FlashMLA's V3.2 sparse cache [pages, page_size, 1, 656] (float8_e4m3fn bytes) and what
    the conversion did: the smallest / largest power-of-two shift k of a scaled tile (tile
    scale = s * 2^-k; None when no tile was scaled) and how many tiles were kept as stored
    (NaN or all zero: scale s)."""

    data: torch.Tensor
    shift_min: int | None
    shift_max: int | None
    tiles_kept: int


def v32_cache(pool: KVPool) -> V32Cache:
    """mlacheck's fp8_e4m3fn latent pool (per-tensor scale s) as FlashMLA's V3.2 cache, exactly.

    Per token: 512 float8_e4m3fn NoPE values, 4 float32 scales (scale i dequantises NoPE
    channels 128i..128i+127), 64 bfloat16 RoPE values. Pages, page ids and page size stay.

    Why exact (s must be a power of two, else ValueError):
    - NoPE, per token and 128-channel tile with stored values v: k >= 0 is the largest with
      amax|v| * 2^k <= 448; the tile stores v * 2^k (a power-of-two multiple of an e4m3
      value that stays <= 448 is an e4m3 value: checked) and scale s * 2^-k (a power of two:
      exact in fp32, and in the bf16 the kernel converts it to). So the kernel's
      (v * 2^k) * (s * 2^-k) is v * s, the golden's value, with no rounding anywhere.
      Tiles holding NaN (mlacheck's poisoned free pages and tails) or only zeros keep
      their bytes and scale s: a kernel that reads a poisoned slot still shows it.
    - RoPE: v * s in bf16, exact for a power-of-two s (checked).
    """
    if pool.fmt != SPARSE_KV or pool.layout != layouts.LINEAR.name:
        raise ValueError(f"the V3.2 cache is built from a linear {SPARSE_KV} pool, not a "
                         f"{pool.layout} {pool.fmt} one")
    if pool.scale.numel() != 1:
        raise ValueError("the V3.2 cache is built from a per-tensor KV scale")
    s = float(pool.scale)
    if not (math.isfinite(s) and s > 0 and math.frexp(s)[0] == 0.5):
        raise ValueError(f"KV scale {s!r} is not a power of two: {SPARSE_REASONS['scale_policies']}")
    pages, ps, heads, dim = pool.data.shape
    if heads != 1 or dim != V32_NOPE + V32_ROPE:
        raise ValueError(f"the V3.2 cache holds one 576-wide latent head, not {heads} x {dim}")
    flat = pool.data.reshape(-1, dim)
    out = torch.empty(flat.shape[0], V32_TOKEN_BYTES, dtype=torch.uint8, device=flat.device)
    lo, hi, kept = None, None, 0
    for start in range(0, flat.shape[0], CONVERT_TOKENS):
        tokens, shift_lo, shift_hi, tiles_kept = _v32_tokens(flat[start:start + CONVERT_TOKENS], s)
        out[start:start + CONVERT_TOKENS] = tokens
        if shift_lo is not None:
            lo = shift_lo if lo is None else min(lo, shift_lo)
            hi = shift_hi if hi is None else max(hi, shift_hi)
        kept += tiles_kept
    data = out.view(torch.float8_e4m3fn).view(pages, ps, 1, V32_TOKEN_BYTES)
    return V32Cache(data, lo, hi, kept)


def _v32_tokens(x: torch.Tensor, s: float
                ) -> tuple[torch.Tensor, int | None, int | None, int]:
    """[n, 576] float8_e4m3fn tokens -> ([n, 656] uint8, min shift, max shift, tiles kept)."""
    n = x.shape[0]
    raw = x.view(torch.uint8)
    v = x[:, :V32_NOPE].float().view(n, V32_TILES, V32_TILE)
    amax = v.abs().amax(dim=-1)  # NaN where the tile holds a NaN
    keep = torch.isnan(amax) | (amax == 0)
    a = torch.where(keep, torch.full_like(amax, E4M3_MAX), amax)
    k = torch.floor(torch.log2(E4M3_MAX / a)).clamp(min=0)
    k = torch.where(a * torch.exp2(k + 1) <= E4M3_MAX, k + 1, k)  # the float log2 corrected
    k = torch.where(a * torch.exp2(k) > E4M3_MAX, k - 1, k)  # at powers of two, exactly
    k = k.masked_fill(keep, 0)
    scaled = v * torch.exp2(k)[..., None]
    nope = scaled.to(torch.float8_e4m3fn)
    if not bool(((nope.float() == scaled) | keep[..., None]).all()):
        raise AssertionError("a scaled NoPE tile is not exact in float8_e4m3fn")
    nope_bytes = torch.where(keep[..., None], raw[:, :V32_NOPE].view(n, V32_TILES, V32_TILE),
                             nope.view(torch.uint8))
    scales = torch.full_like(amax, s) * torch.exp2(-k)  # fp32 powers of two
    if bool((scales < torch.finfo(torch.float32).tiny).any()):
        raise ValueError("a tile scale below the smallest normal float (bf16 would round it)")
    want = x[:, V32_NOPE:].float() * s
    rope = want.to(torch.bfloat16)
    if not bool(((rope.float() == want) | torch.isnan(want)).all()):
        raise AssertionError("a RoPE value x s is not exact in bf16")
    tokens = torch.cat([nope_bytes.reshape(n, V32_NOPE), scales.view(torch.uint8),
                        rope.view(torch.uint8)], dim=1)
    shifted = k[~keep]
    if shifted.numel() == 0:
        return tokens, None, None, int(keep.sum())
    return tokens, int(shifted.min()), int(shifted.max()), int(keep.sum())


def _v32_dims(case: Case) -> str | None:
    d = case.dims
    if (d.kv_lora_rank, d.qk_rope) != (V32_NOPE, V32_ROPE):
        return (f"the V3.2 cache is 512 NoPE + 64 RoPE channels, not {d.kv_lora_rank} + "
                f"{d.qk_rope} (FlashMLA's sparse kernels take d_qk 576 = V3.2 or 512 = MODEL1, "
                "d_v 512: csrc/api/sparse_decode.h:235-236, :290-297; sparse_fwd.h:131-132)")
    return None


def padded_topk(indices: torch.Tensor, multiple: int) -> torch.Tensor:
    """[T, 1, topk] indices widened to a multiple of `multiple` with -1 (no key), contiguous.

    FlashMLA's sm_90 sparse prefill takes the indices' width in multiples of 128
    ('KU_ASSERT(params.topk % (2*B_TOPK) == 0)', B_TOPK 64: csrc/sm90/prefill/sparse/
    phase1.cuh:577, config.h:27) and skips -1 ("Invalid indices should be set to -1",
    flash_mla/flash_mla_interface.py:191): the padded call attends to the same keys."""
    pad = -indices.shape[-1] % multiple
    if not pad:
        return indices.contiguous()
    return torch.nn.functional.pad(indices, (0, pad), value=-1).contiguous()


def _needs_repage(pool: KVPool) -> bool:
    return pool.table.page_size != PAGE_SIZE or pool.layout != layouts.LINEAR.name


def _uniform_groups(
    case: DecodeCase | SparseDecodeCase, qo_indptr: torch.Tensor,
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(request rows, their token rows, q_len) per distinct non-zero q_len, in first-seen order.

    FlashMLA takes q as [batch, q_len, heads, 576]: a mixed batch runs as one call per q_len;
    empty requests (q_len 0) have no tokens and are left out of every call.
    """
    starts = qo_indptr.tolist()
    groups: dict[int, list[int]] = {}
    for r, req in enumerate(case.requests):
        if req.q_len:
            groups.setdefault(req.q_len, []).append(r)
    return [(torch.tensor(rows), torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows]),
             s_q) for s_q, rows in groups.items()]


def _sm_parts(sched: Any) -> int | None:
    """How many SM partitions the tile scheduler split the batch over (for the record)."""
    meta = getattr(sched, "tile_scheduler_metadata", None)
    return int(meta.shape[0]) if isinstance(meta, torch.Tensor) else None


def factory() -> FlashMLABackend:
    return FlashMLABackend()
