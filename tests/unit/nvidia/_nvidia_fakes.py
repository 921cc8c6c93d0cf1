"""Executable fakes of `flash_mla` and `flashinfer` for the adapter tests on a CPU.

Each fake computes attention in fp32 from the arguments *as the real library reads them*
(FlashMLA: [batch, s_q, heads, 576] q, block_table + cache_seqlens, LSE [b, h, s_q] natural;
FlashMLA sparse: the 656-byte V3.2 cache decoded as the sm_90 kernel does, global-slot
indices with -1 masked, LSE +inf for a row without a valid index;
FlashInfer: qo/kv indptr + kv_indices + kv_len_arr, ckv/kpe as separate strided tensors,
bottom-right causal ragged prefill, LSE base 2; 0.7.2's MLA plan / run from MLAPlanMetadata and
query= / kv_cache= pairs), with the signatures of the real functions (FlashMLA main,
flashinfer-python 0.2.14.post1 and 0.7.2.post1). A `bug=` argument plants one fault, so the tests
prove the suite catches it through the adapter.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from mlacheck.backends.base import Capability


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
           soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [s, h, d], k [n, h|1, d], v [n, h|1, dv] -> out [s, h, dv], natural LSE [s, h].

    Causal is bottom-right aligned: query i sees keys j <= i + n - s.
    """
    s, n = q.shape[0], k.shape[0]
    logits = torch.einsum("shd,nhd->hsn", q.float(), k.float().expand(n, q.shape[1], -1)) * scale
    if soft_cap:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    if causal:
        i = torch.arange(s)[:, None]
        j = torch.arange(n)[None, :]
        logits = logits.masked_fill(j > i + n - s, float("-inf"))
    lse = torch.logsumexp(logits, -1)  # [h, s]
    p = torch.exp(logits - lse[..., None])
    out = torch.einsum("hsn,nhd->shd", p, v.float().expand(n, q.shape[1], -1))
    return out, lse.transpose(0, 1)


# --------------------------------------------------------------------------- flash_mla


FLASH_MLA_SPARSE_BUGS = ("ignores-tile-scales", "tile0-scale-for-all", "minus-one-reads-token-0")
# Planted in flash_mla_sparse_fwd (sparse prefill).
FLASH_MLA_SPARSE_PREFILL_BUGS = ("minus-one-reads-token-0", "max-logits-unscaled")
V32_BYTES = 656  # 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE (flash_mla_interface.py)


def v32_decode(k_cache: torch.Tensor, bug: str = "") -> torch.Tensor:
    """[blocks, block_size, 1, 656] V3.2 cache -> [blocks * block_size, 576] fp32, as the sm_90
    kernel dequantises it: the fp32 scale converted to bf16, (fp8 -> bf16) x scale in bf16,
    RoPE read as bf16 (FlashMLA's tests/quant.py `dequantize_k_cache`, in the kernel's
    dtypes). `bug` plants a scale fault."""
    raw = k_cache.view(torch.uint8).reshape(-1, V32_BYTES)
    nope = raw[:, :512].view(torch.float8_e4m3fn).to(torch.bfloat16).view(-1, 4, 128)
    scales = raw[:, 512:528].contiguous().view(torch.float32).to(torch.bfloat16)  # [n, 4]
    if bug == "ignores-tile-scales":
        scales = torch.ones_like(scales)
    elif bug == "tile0-scale-for-all":
        scales = scales[:, :1].expand(-1, 4)
    rope = raw[:, 528:].contiguous().view(torch.bfloat16)
    return torch.cat([(nope * scales[..., None]).reshape(-1, 512), rope], dim=1).float()


def fake_flash_mla(bug: str = "") -> types.ModuleType:
    mod = types.ModuleType("flash_mla")
    mod.__version__ = "1.0.0+fake"

    def get_mla_metadata(*args: Any, **kwargs: Any) -> tuple[Any, None]:
        return types.SimpleNamespace(tile_scheduler_metadata=None, config=None), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,  # noqa: ANN001, ANN202
                               tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                               causal=False, is_fp8_kvcache=False, indices=None,
                               attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                               topk_length=None, extra_topk_length=None):
        sched = tile_scheduler_metadata
        config = (tuple(q.shape[:3]), tuple(k_cache.shape[1:3]), causal, is_fp8_kvcache,
                  None if indices is None else indices.shape[-1])
        assert sched.config in (None, config), "sched_meta reused with other arguments"
        sched.config = config
        if indices is not None:
            assert not causal, "causal must be False when sparse attention is enabled"
            assert is_fp8_kvcache, "is_fp8_kvcache must be True when sparse attention is enabled"
            return sparse_decode(q, k_cache, indices, topk_length, head_dim_v, softmax_scale)
        assert k_cache.shape[1] == 64, "page_block_size must be 64"
        b, s_q, h, _ = q.shape
        out = torch.empty(b, s_q, h, head_dim_v, dtype=q.dtype)
        lse = torch.empty(b, h, s_q, dtype=torch.float32)
        for r in range(b):
            n = int(cache_seqlens[r])
            pages = block_table[r, : -(-n // 64)]
            kv = k_cache[pages].reshape(-1, 1, k_cache.shape[-1])
            kv = kv if bug == "reads-whole-last-page" else kv[:n]
            o, l = attend(q[r], kv, kv[..., :head_dim_v], softmax_scale, causal)
            out[r], lse[r] = o.to(q.dtype), l.transpose(0, 1)
        return out, lse

    def sparse_decode(q, k_cache, indices, topk_length, head_dim_v, softmax_scale):  # noqa: ANN001, ANN202
        """csrc/api/sparse_decode.h's checks, then the V3.2 sparse decode in fp32."""
        assert q.dim() == 4 and k_cache.dim() == 4 and indices.dim() == 3
        b, s_q, h, d = q.shape
        assert q.dtype == torch.bfloat16, "q must be bf16"
        assert h in (64, 128), f"Unsupported h_q: {h}"
        assert d == 576 and head_dim_v == 512, "V3.2: head_size_k 576, head_size_v 512"
        assert k_cache.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8), \
            "key must have dtype fp8_e4m3fn, int8 or uint8"
        assert k_cache.shape[2:] == (1, V32_BYTES), f"kv shape {tuple(k_cache.shape)}"
        assert k_cache.stride(1) == V32_BYTES, "The whole block must be contiguous"
        assert indices.dtype == torch.int32 and indices.shape == (b, s_q, indices.shape[2])
        assert indices.stride(-1) == 1 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
        assert topk_length is None, "the adapter pads with -1, it passes no topk_length"
        kv = v32_decode(k_cache, bug)  # [blocks * block_size, 576]
        idx = indices.long().reshape(b * s_q, -1)
        if bug == "minus-one-reads-token-0":
            idx = idx.masked_fill(idx == -1, 0)
        valid = idx != -1  # the V3.2 kernel masks index -1 (is_index_valid: index != -1)
        assert bool((idx[valid] >= 0).all() and (idx[valid] < kv.shape[0]).all()), \
            "index outside the cache (the kernel would read out of bounds)"
        keys = torch.where(valid[..., None], kv[idx.clamp(min=0)], 0.0)  # -1: zeroed, unread
        logits = torch.einsum("thd,tkd->thk", q.float().reshape(b * s_q, h, d), keys)
        logits = (logits * softmax_scale).masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(logits, -1)  # [t, h]
        lonely = torch.isneginf(lse)
        p = torch.exp(logits - lse.masked_fill(lonely, 0.0)[..., None])
        out = torch.einsum("thk,tkd->thd", p, keys[..., :head_dim_v])
        out = out.masked_fill(lonely[..., None], 0.0)
        lse = lse.masked_fill(lonely, float("inf"))
        # sparse_decode.h allocates lse {b, s_q, h_q} and returns lse.transpose(1, 2)
        return (out.to(torch.bfloat16).reshape(b, s_q, h, head_dim_v),
                lse.reshape(b, s_q, h).transpose(1, 2))

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None,  # noqa: ANN001, ANN202
                             topk_length=None):
        """csrc/api/sparse_fwd.h's sm_90 checks, then sparse prefill in fp32: (out bf16
        [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q]); a row without a valid index
        gets out 0, lse +inf, max_logits -inf (FlashMLA's tests/ref.py)."""
        s_q, h, d = q.shape
        assert q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16, "bf16 q and kv"
        assert h in (64, 128), f"Unsupported h_q: {h}"
        assert kv.dim() == 3 and kv.shape[1] == 1 and kv.shape[2] == d == 576
        assert indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1)
        assert indices.shape[2] % 128 == 0, "topk must be a multiple of 128"
        keys_all = kv[:, 0].float()
        idx = indices[:, 0].long()
        if bug == "minus-one-reads-token-0":
            idx = idx.masked_fill(idx == -1, 0)
        valid = (idx >= 0) & (idx < kv.shape[0])  # -1 or >= s_kv: invalid
        keys = torch.where(valid[..., None], keys_all[idx.clamp(0, kv.shape[0] - 1)], 0.0)
        logits = torch.einsum("thd,tkd->thk", q.float(), keys) * sm_scale
        if bug == "max-logits-unscaled":
            raw_max = (logits / sm_scale).masked_fill(~valid[:, None, :], float("-inf")).amax(-1)
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        mx = logits.amax(-1) if bug != "max-logits-unscaled" else raw_max
        lse = torch.logsumexp(logits, -1)
        lonely = torch.isneginf(lse)
        p = torch.exp(logits - lse.masked_fill(lonely, 0.0)[..., None])
        out = torch.einsum("thk,tkd->thd", p, keys[..., :d_v]).masked_fill(lonely[..., None], 0.0)
        return out.to(torch.bfloat16), mx, lse.masked_fill(lonely, float("inf"))

    mod.get_mla_metadata = get_mla_metadata
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    mod.flash_mla_sparse_fwd = flash_mla_sparse_fwd
    return mod


# --------------------------------------------------------------------------- flashinfer


def fake_flashinfer(bug: str = "", version: str = "0.2.14", topk_prebuilt: bool = True,
                    topk_loads: bool = True) -> dict[str, types.ModuleType | None]:
    """FlashInfer's MLA wrapper and ragged / paged prefill wrappers with the signatures of
    `version`: "0.2.14" (flashinfer-python 0.2.14.post1: no FP8 MLA; the fa2 paged prefill
    refuses K/V caches of different strides, as csrc/batch_prefill.cu does) or "0.7"
    (0.7.2.post1: the MLA wrapper's structural API, `mla.MLAPlanMetadata` and
    StructuralBatchMLAPagedAttentionWrapper, whose deprecated flat / separate-tensor calls
    fail here; `plan(scale_mode=)` and `run(ckv_scale=, kpe_scale=)` for an fp8_e4m3fn KV
    cache under bf16 q; unequal K/V strides taken; the prefills' `run(k_scale=, v_scale=)` for
    FP8 K/V under a 16-bit q, as flashinfer/prefill.py applies them: k_scale into sm_scale, the
    output times v_scale after the kernel; FP8 q refused by fa2's JIT generator; the ragged
    top-k, whose JIT module `topk` is installed as a prebuilt (AOT) module unless
    `topk_prebuilt=False`; `topk_loads=False`: the file is there but FlashInfer's try_load
    cannot load it)."""
    root, mla, prefill = (types.ModuleType(n) for n in
                          ("flashinfer", "flashinfer.mla", "flashinfer.prefill"))
    root.__version__ = f"{version}+fake"
    root.mla, root.prefill = mla, prefill
    log2e = 1 / math.log(2)
    new_api = version.startswith("0.7")

    class BatchMLAPagedAttentionWrapper:
        """0.2.14.post1's wrapper: flat plan metadata, separate q / cache tensors in run."""

        def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,  # noqa: ANN001
                     kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
            self.plan_args: dict[str, Any] = {}
            self.backend = backend

        def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,  # noqa: ANN001, ANN201
                 head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
                 use_profiler=False, **new):
            assert set(new) <= ({"scale_mode"} if new_api else set()), new
            self._plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, page_size,
                       causal, sm_scale, q_data_type, kv_data_type,
                       new.get("scale_mode", "default"))

        def _plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, page_size,  # noqa: ANN001, ANN202
                  causal, sm_scale, q_data_type, kv_data_type, scale_mode):
            if kv_data_type == torch.float8_e4m3fn:  # _fa_common.py's checks (0.7)
                assert q_data_type == torch.bfloat16 and scale_mode == "kv-per-tensor"
            else:
                assert kv_data_type == q_data_type and scale_mode == "default"
            if new_api and causal:
                fa_common._validate_fa_causal_tile_bound(
                    qo_indptr.diff().tolist(), kv_len_arr.tolist(), num_heads, self.backend,
                    kv_data_type)
            self.plan_args = dict(qo=qo_indptr.tolist(), kvp=kv_indptr.tolist(),
                                  kvi=kv_indices, lens=kv_len_arr.tolist(), ps=page_size,
                                  causal=causal, scale=sm_scale, kv_dtype=kv_data_type)

        def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None,  # noqa: ANN001, ANN201
                return_lse=False, profiler_buffer=None, kv_len=None, page_table=None,
                return_lse_base_on_e=False, **new):
            fp8 = ckv_cache.dtype == torch.float8_e4m3fn
            assert set(new) == ({"ckv_scale", "kpe_scale"} if fp8 else set()), new
            return self._attend(q_nope, q_pe, ckv_cache, kpe_cache, out, return_lse,
                                new.get("ckv_scale", 1.0), new.get("kpe_scale", 1.0))

        def _attend(self, q_nope, q_pe, ckv_cache, kpe_cache, out, return_lse, ckv_s, kpe_s):  # noqa: ANN001, ANN202
            a = self.plan_args
            assert ckv_cache.shape[1] == a["ps"] and ckv_cache.dtype == a["kv_dtype"]
            ckv_s = 1.0 if bug == "ignores-kv-scale" else ckv_s
            q = torch.cat([q_nope, q_pe], -1)
            out = torch.empty(*q_nope.shape, dtype=q.dtype) if out is None else out
            lse_out = torch.empty(q.shape[:2], dtype=torch.float32)
            for r, n in enumerate(a["lens"]):
                lo, hi = a["qo"][r], a["qo"][r + 1]
                if hi == lo:
                    continue
                if n == 0:  # mla.cuh: m stays at -math::inf = -5e4 (finite); output 0; the
                    # H100 (0.2.14.post1) wrote LSE -49999 (fa2) / -49998 (fa3)
                    out[lo:hi], lse_out[lo:hi] = 0, (-49999.0 if self.backend == "fa2" else -49998.0)
                    continue
                pages = a["kvi"][a["kvp"][r]: a["kvp"][r + 1]]
                kv = torch.cat([_take(ckv_cache, pages).float() * ckv_s,
                                _take(kpe_cache, pages).float() * kpe_s], -1)
                kv = kv.reshape(-1, 1, kv.shape[-1])[:n]
                o, l = attend(q[lo:hi], kv, kv[..., : q_nope.shape[-1]], a["scale"], a["causal"])
                out[lo:hi] = o.to(out.dtype)
                lse_out[lo:hi] = l if bug == "lse-natural" else l * log2e
            return (out, lse_out) if return_lse else out

    class StructuralBatchMLAPagedAttentionWrapper(BatchMLAPagedAttentionWrapper):
        """0.7.2.post1's wrapper (mla/_batch_mla/_wrapper.py): plan() and run() with the real
        signatures (:410-442, :852-876), whose flat / separate-tensor keywords, positional
        arguments and run-time LSE of a flat plan are deprecated there (DeprecationWarning,
        "will be removed"): here they fail. plan(metadata=MLAPlanMetadata) declares the run
        contract (layouts, lse_mode, scale_mode) that run() is held to (_contracts.py:138-212)
        and checks the CSR metadata strictly (_planning.py:84-148)."""

        @_keywords_only
        def plan(self, qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None,  # noqa: ANN001, ANN201
                 num_heads=None, head_dim_ckv=None, head_dim_kpe=None, page_size=None,
                 causal=None, sm_scale=None, q_data_type=None, kv_data_type=None,
                 use_profiler=False, *, metadata=None, cum_seq_lens_q=None, block_tables=None,
                 seq_lens=None, max_q_len=None, query_layout=None, kv_cache_layout=None,
                 lse_mode="none", output_dtype=None, output_scale="none",
                 scale_mode="default", skip_softmax=False, enable_pdl=None, use_sinks=False):
            flat = {n for n, v in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                                   ("kv_indices", kv_indices), ("kv_len_arr", kv_len_arr),
                                   ("cum_seq_lens_q", cum_seq_lens_q),
                                   ("block_tables", block_tables), ("seq_lens", seq_lens),
                                   ("max_q_len", max_q_len)) if v is not None}
            assert not flat, f"flat plan metadata is deprecated in 0.7.2 (_wrapper.py:597): {flat}"
            assert isinstance(metadata, MLAPlanMetadata), metadata
            required = (num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
                        q_data_type, kv_data_type)
            if any(v is None for v in required):
                raise TypeError("plan() missing required arguments")  # _wrapper.py:612-614
            assert (output_dtype, output_scale, skip_softmax, use_sinks) == (
                None, "none", False, False)
            csr = _strict_csr(metadata, page_size)
            self.contract = dict(query=query_layout or "packed",
                                 kv_cache=kv_cache_layout or "packed", lse_mode=lse_mode,
                                 scale_mode=scale_mode, widths=(head_dim_ckv, head_dim_kpe))
            self._plan(*csr, num_heads, page_size, causal, sm_scale, q_data_type, kv_data_type,
                       scale_mode)

        @_keywords_only
        def run(self, q_nope=None, q_pe=None, ckv_cache=None, kpe_cache=None, out=None,  # noqa: ANN001, ANN201
                lse=None, return_lse=False, profiler_buffer=None, kv_len=None,
                page_table=None, return_lse_base_on_e=False, o_scale=None, *, query=None,
                kv_cache=None, ckv_scale=None, ckv_scale_arr=None, kpe_scale=None, sinks=None,
                skip_softmax_threshold_scale_factor=None, bmm1_scale=None, bmm2_scale=None):
            legacy = {n for n, v in (("q_nope", q_nope), ("q_pe", q_pe),
                                     ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache))
                      if v is not None}
            assert not legacy, f"deprecated in 0.7.2 (_wrapper.py:986-987): {legacy}"
            assert query is not None and kv_cache is not None
            c = self.contract
            asked = ("none" if not (return_lse or lse is not None or return_lse_base_on_e)
                     else "basee" if return_lse_base_on_e else "base2")
            if asked != c["lse_mode"]:  # _contracts.py:138-142
                raise ValueError(f"MLA planned run argument LSE mode mismatch: planned "
                                 f"{c['lse_mode']!r}, got {asked!r}; re-plan with the needed "
                                 "arguments.")
            if (c["scale_mode"] == "kv-per-tensor") != (
                    ckv_scale is not None and kpe_scale is not None):  # _contracts.py:200-212
                raise ValueError("ckv_scale / kpe_scale go with scale_mode='kv-per-tensor'")
            assert lse is None and ckv_scale_arr is None and o_scale is None and sinks is None
            q_parts = _structural(query, c["query"], c["widths"], "query")
            kv_parts = _structural(kv_cache, c["kv_cache"], c["widths"], "KV cache")
            return self._attend(*q_parts, *kv_parts, out, return_lse,
                                1.0 if ckv_scale is None else ckv_scale,
                                1.0 if kpe_scale is None else kpe_scale)

    def check_dtypes(backend: str, q_data_type: Any, kv_data_type: Any) -> None:
        """What 0.7.2.post1's plan meets: fa2's generator asserts on FP8 q
        (jit/attention/modules.py:1042); 0.2.14 has no FP8 prefill at all."""
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        if q_data_type in fp8 or (kv_data_type in fp8 and not new_api):
            raise AssertionError("fp8 tensor core is not supported in fa2 backend")

    def kv_scales(backend: str, q: torch.Tensor, k: torch.Tensor, k_scale: Any,
                  v_scale: Any) -> tuple[float, float]:
        """(score factor, output factor): prefill.py's `apply_kv_scales` (fa2 / fa3, FP8 K/V
        under a 16-bit q); `bug="ignores-kv-scale"` drops them."""
        if bug == "ignores-kv-scale" or k.element_size() != 1 or q.element_size() == 1:
            return 1.0, 1.0
        return (1.0 if k_scale is None else k_scale), (1.0 if v_scale is None else v_scale)

    def k_as_loaded(backend: str, k: torch.Tensor) -> torch.Tensor:
        """`bug="k-rows-past-128-unread"`: 0.7.2's fa2 loads a 1-byte K row in 128-element
        column groups only (include/flashinfer/attention/prefill.cuh:565 / :637 / :729), so
        MLA's elements 128-191 are never loaded; they read as 0 here (unwritten shared memory
        on the GPU, whatever it holds)."""
        if (bug != "k-rows-past-128-unread" or backend != "fa2" or k.element_size() != 1
                or k.shape[-1] % 128 == 0):
            return k
        k = k.float()
        k[..., k.shape[-1] // 128 * 128:] = 0
        return k

    class BatchPrefillWithRaggedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,  # noqa: ANN001
                     qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None,
                     mask_indptr_buf=None, backend="auto", jit_args=None):
            self.plan_args: dict[str, Any] = {}
            self.backend = backend

        def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk,  # noqa: ANN001, ANN201
                 head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False, window_left=-1,
                 logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
                 q_data_type="float16", kv_data_type=None, non_blocking=True,
                 prefix_len_ptr=None, token_pos_in_items_ptr=None,
                 token_pos_in_items_len=0, max_item_len_ptr=None, **new):
            assert set(new) <= ({"o_data_type"} if new_api else set()), new
            check_dtypes(self.backend, q_data_type, kv_data_type)
            self.plan_args = dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), causal=causal,
                                  cap=logits_soft_cap or 0.0, scale=sm_scale,
                                  dtypes=(q_data_type, kv_data_type))

        def run(self, q, k, v, *args, out=None, lse=None, return_lse=False, enable_pdl=None,  # noqa: ANN001, ANN201
                **new):
            assert set(new) <= ({"q_scale", "k_scale", "v_scale", "o_scale"} if new_api else set())
            a = self.plan_args
            assert (q.dtype, k.dtype) == a["dtypes"]  # _check_cached_qkv_data_type
            s_k, s_v = kv_scales(self.backend, q, k, new.get("k_scale"), new.get("v_scale"))
            out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype) if out is None else out
            lse_out = torch.empty(q.shape[:2], dtype=torch.float32)
            for r in range(len(a["qo"]) - 1):
                (qlo, qhi), (klo, khi) = a["qo"][r:r + 2], a["kv"][r:r + 2]
                if qhi == qlo:
                    continue
                causal = a["causal"] and bug != "ignores-causal"
                o, l = attend(q[qlo:qhi], k_as_loaded(self.backend, k[klo:khi]), v[klo:khi],
                              a["scale"] * s_k, causal, a["cap"])
                out[qlo:qhi] = o.to(out.dtype)
                lse_out[qlo:qhi] = l * log2e
            if s_v != 1.0:  # after the kernel, in the output's dtype (prefill.py:6469)
                out *= s_v
            return (out, lse_out) if return_lse else out

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,  # noqa: ANN001
                     qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                     paged_kv_last_page_len_buf=None, custom_mask_buf=None,
                     mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
            assert kv_layout == "NHD"
            self.backend = backend
            self.plan_args: dict[str, Any] = {}

        def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,  # noqa: ANN001, ANN201
                 num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
                 custom_mask=None, packed_custom_mask=None, causal=False,
                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
                 window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
                 q_data_type="float16", kv_data_type=None, non_blocking=True,
                 prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
                 max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
                 max_token_per_sequence=None, max_sequence_kv=None, **new):
            assert set(new) <= ({"o_data_type"} if new_api else set()), new
            check_dtypes(self.backend, q_data_type, kv_data_type)
            indptr = paged_kv_indptr.tolist()
            last = paged_kv_last_page_len.tolist()
            lens = [(indptr[r + 1] - indptr[r] - 1) * page_size + last[r]
                    for r in range(len(last))]
            self.plan_args = dict(qo=qo_indptr.tolist(), kvp=indptr, kvi=paged_kv_indices,
                                  lens=lens, ps=page_size, causal=causal,
                                  cap=logits_soft_cap or 0.0, scale=sm_scale,
                                  dims=(head_dim_qk, head_dim_vo))

        def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,  # noqa: ANN001, ANN201
                out=None, lse=None, return_lse=False, enable_pdl=None, window_left=None,
                sinks=None):
            a = self.plan_args
            k_cache, v_cache = paged_kv_cache
            if self.backend == "fa2" and not new_api:  # csrc/batch_prefill.cu (0.2.14)
                assert k_cache.stride() == v_cache.stride(), "k/v strides must be identical"
            if self.backend == "fa3" and a["dims"][0] != a["dims"][1]:  # hopper/prefill_sm90.cuh
                raise RuntimeError("BatchPrefillWithPagedKVCacheSM90Run failed with error: "
                                   "operation not supported")
            assert (k_cache.shape[-1], v_cache.shape[-1]) == a["dims"]
            s_k, s_v = kv_scales(self.backend, q, k_cache, k_scale, v_scale)
            out = torch.empty(*q.shape[:2], v_cache.shape[-1], dtype=q.dtype) if out is None else out
            lse_out = torch.empty(q.shape[:2], dtype=torch.float32)
            for r, n in enumerate(a["lens"]):
                lo, hi = a["qo"][r], a["qo"][r + 1]
                if hi == lo:
                    continue
                pages = a["kvi"][a["kvp"][r]: a["kvp"][r + 1]]
                whole = n if bug != "reads-whole-last-page" else len(pages) * a["ps"]
                k = k_as_loaded(self.backend,
                                _take(k_cache, pages).reshape(-1, *k_cache.shape[2:])[:whole])
                v = _take(v_cache, pages).reshape(-1, *v_cache.shape[2:])[:whole]
                o, l = attend(q[lo:hi], k, v, a["scale"] * s_k, a["causal"], a["cap"])
                out[lo:hi] = o.to(out.dtype)
                lse_out[lo:hi] = l * log2e
            if s_v != 1.0:  # prefill.py:4631
                out *= s_v
            return (out, lse_out) if return_lse else out

    class _BackendPlanUnsupportedError(ValueError):
        pass

    def _validate_fa_causal_tile_bound(q_lens: list[int], kv_lens: list[int], num_heads: int,
                                       backend: str, kv_data_type: Any) -> None:
        """0.7.2.post1's plan-time refusal (mla/_batch_mla/_backends/_fa_common.py:325-357), said
        token by token: a token whose q rows a tile end cuts, and whose last visible key opens a
        KV tile, is refused. The KV tile is an H100's (fa2 16-bit: 64 by its shared memory)."""
        tile_q = 64 * (2 if sum(q_lens) * num_heads // len(q_lens) > 64 else 1)
        tile_kv = 32 if backend == "fa2" and kv_data_type == torch.float8_e4m3fn else 64
        for request, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            for token in range(q_len):
                first, last = token * num_heads, (token + 1) * num_heads  # its rows [first, last)
                cut = (first // tile_q + 1) * tile_q < last
                key = kv_len - q_len + token
                if cut and 0 <= key < kv_len and key % tile_kv == 0:
                    raise _BackendPlanUnsupportedError(
                        f"{backend} MLA causal tile boundary is unsupported: request {request}, "
                        f"num_heads={num_heads}, query={token}, key={key}, native KV tile="
                        f"{tile_kv}; native execution would omit a visible key.")

    fa_common = types.ModuleType("flashinfer.mla._batch_mla._backends._fa_common")
    fa_common._validate_fa_causal_tile_bound = _validate_fa_causal_tile_bound
    fa_common._BackendPlanUnsupportedError = _BackendPlanUnsupportedError
    mla.BatchMLAPagedAttentionWrapper = (StructuralBatchMLAPagedAttentionWrapper if new_api
                                         else BatchMLAPagedAttentionWrapper)
    if new_api:
        mla.MLAPlanMetadata = MLAPlanMetadata
    prefill.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    prefill.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    # what inspect.signature shows: 0.7's keyword-only FP8 parameters, none in 0.2.14
    _add_keywords(BatchMLAPagedAttentionWrapper.plan, ())
    _add_keywords(BatchMLAPagedAttentionWrapper.run, ())
    _add_keywords(BatchPrefillWithRaggedKVCacheWrapper.run,
                  ("q_scale", "k_scale", "v_scale", "o_scale") if new_api else ())
    for wrapper in (BatchPrefillWithRaggedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper):
        _add_keywords(wrapper.plan, ("o_data_type",) if new_api else ())
    modules = {"flashinfer": root, "flashinfer.mla": mla, "flashinfer.prefill": prefill}
    private = ("flashinfer.mla._batch_mla", "flashinfer.mla._batch_mla._backends",
               "flashinfer.mla._batch_mla._backends._fa_common")
    if not new_api:  # None in sys.modules: importing it fails, whatever a 0.7 fake left there
        return {**modules, "flashinfer.dense_mqa": None, "flashinfer.jit": None,
                "flashinfer.jit.topk": None, **dict.fromkeys(private)}
    # 0.7's sparse-path entry points (never called by the adapter: no sm_90 kernel) and the
    # private module whose causal check the adapter mirrors
    dense_mqa = types.ModuleType("flashinfer.dense_mqa")
    for holder, name in ((dense_mqa, "fp8_mqa_logits"), (root, "fp8_paged_mqa_logits"),
                         (root, "top_k"), (root, "top_k_page_table_transform")):
        setattr(holder, name, _not_called(name))
    root.dense_mqa = dense_mqa
    # the top-k's JIT module (jit/topk.py:21): an existing file stands for its installed .so
    aot = Path(__file__) if topk_prebuilt else Path(__file__).parent / "no-aot/topk/topk.so"
    jit, jit_topk = types.ModuleType("flashinfer.jit"), types.ModuleType("flashinfer.jit.topk")
    jit_topk.gen_topk_module = lambda: types.SimpleNamespace(
        name="topk", aot_path=aot, try_load=lambda: object() if topk_loads else None)
    root.jit, jit.topk = jit, jit_topk

    def top_k_ragged_transform(input, offsets, lengths, k, deterministic=False, tie_break=0,  # noqa: A002, ANN001, ANN202
                               dsa_graph_safe=False, row_starts=None):
        """topk.py:1330 (0.7.2.post1): per row the top k of input[i, start : start + length],
        positions relative to start, plus offsets[i]; -1 past the length; int32 [rows, k], in
        no particular order (here: the window's last first). `bug="topk-absolute-positions"`
        returns the column instead of the position relative to row_starts. Without the
        prebuilt module the real one first builds it (minutes): here that fails the test."""
        assert topk_prebuilt, "the adapter called the top-k without its prebuilt module"
        assert input.is_contiguous() and lengths.dtype == offsets.dtype == torch.int32
        out = torch.full((input.shape[0], k), -1, dtype=torch.int32)
        for i in range(input.shape[0]):
            start = 0 if row_starts is None else int(row_starts[i])
            window = input[i, start: start + int(lengths[i])]
            picked = torch.topk(window, min(k, window.numel())).indices.flip(0)
            if bug == "topk-absolute-positions":
                picked = picked + start
            out[i, : picked.numel()] = (picked + int(offsets[i])).to(torch.int32)
        return out

    root.top_k_ragged_transform = top_k_ragged_transform
    return {**modules, "flashinfer.dense_mqa": dense_mqa, "flashinfer.jit": jit,
            "flashinfer.jit.topk": jit_topk,
            **{name: types.ModuleType(name) for name in private[:-1]}, private[-1]: fa_common}


def _not_called(name: str) -> Any:
    def function(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"the adapter called flashinfer.{name}, which it does not wire")
    return function


def _take(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t[rows] for any dtype (CPU indexing has no fp8 kernels: index the bytes)."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8)[rows.long()].view(t.dtype)
    return t[rows.long()]


@dataclass(frozen=True)
class MLAPlanMetadata:
    """0.7.2.post1's canonical MLA plan metadata (mla/_batch_mla/_contracts.py:37-102)."""

    qo_indptr: torch.Tensor | None = None
    kv_indptr: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    kv_len_arr: torch.Tensor | None = None
    cum_seq_lens_q: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    max_q_len: int | None = None

    @classmethod
    def csr(cls, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_len_arr: torch.Tensor) -> MLAPlanMetadata:
        return cls(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   kv_len_arr=kv_len_arr)

    @classmethod
    def dense(cls, cum_seq_lens_q: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, max_q_len: int | None = None) -> MLAPlanMetadata:
        return cls(cum_seq_lens_q=cum_seq_lens_q, block_tables=block_tables, seq_lens=seq_lens,
                   max_q_len=max_q_len)


def _strict_csr(m: MLAPlanMetadata, page_size: int) -> tuple[torch.Tensor, ...]:
    """The CSR form as 0.7.2's canonical (strict) plan checks it (_planning.py:84-148): int32,
    rank 1, contiguous; one batch size throughout; ceil(kv_len / page_size) pages per request.
    The fake takes the CSR form only (FA2 / FA3 consume it natively)."""
    csr = (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_len_arr)
    assert all(isinstance(t, torch.Tensor) for t in csr), "the fake plans from CSR metadata"
    for t in csr:
        assert t.dtype == torch.int32 and t.ndim == 1 and t.is_contiguous(), t
    qo, kvp, kvi, lens = (t.long() for t in csr)
    assert qo[0] == 0 and kvp[0] == 0 and len(kvp) == len(qo) == len(lens) + 1
    assert int(kvp[-1]) <= len(kvi)
    assert torch.equal(kvp.diff(), (lens + page_size - 1) // page_size), "pages per request"
    return csr


def _structural(value: Any, layout: str, widths: tuple[int, int],
                name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A structural query= / kv_cache= value as the fa2 / fa3 backend gets it, (no-PE, PE)
    (_contracts.py:437-484): a packed rank-3 tensor is split along its last axis; a split pair
    (an exact 2-tuple of rank-3 tensors) must be what the plan declared."""
    if isinstance(value, torch.Tensor):
        assert value.ndim == 3 and value.shape[-1] == sum(widths), (name, value.shape)
        return value[..., : widths[0]], value[..., widths[0]:]
    assert type(value) is tuple and len(value) == 2, f"{name}: a tensor or an exact 2-tuple"
    assert layout == "split", f"{name}: split values need a split plan here"
    left, right = value
    assert left.ndim == right.ndim == 3 and left.shape[:-1] == right.shape[:-1], name
    assert (left.shape[-1], right.shape[-1]) == widths and left.dtype == right.dtype, name
    return left, right


def _keywords_only(method: Any) -> Any:
    """0.7.2 warns on positional plan() / run() arguments (_wrapper.py:150-159): here they
    fail. The signature stays the real one (functools.wraps, as there)."""
    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        assert not args, "positional MLA arguments are deprecated in 0.7.2"
        return method(self, **kwargs)
    return wrapped


def record_calls(cls: type, method: str, seen: list[dict[str, Any]]) -> None:
    """Record the keywords of each call of cls.method; its signature is kept, so the
    adapter's signature checks see the fake's."""
    real = getattr(cls, method)

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(self, *args, **kwargs)
    spy.__signature__ = inspect.signature(real)  # type: ignore[attr-defined]
    setattr(cls, method, spy)


def _add_keywords(fn: Any, names: tuple[str, ...]) -> None:
    """Give fn (which takes **kwargs) a signature that names `names` as keyword-only."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in names]
    fn.__signature__ = sig.replace(parameters=params)


def install(monkeypatch: pytest.MonkeyPatch, modules: dict[str, types.ModuleType | None]) -> None:
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)


def on_cpu(backend: Any) -> Any:
    """The adapter as is, allowed to run on the CPU (the fakes compute there)."""
    real_caps = backend.capabilities

    def capabilities() -> dict[str, Capability]:
        return {op: replace(c, devices=("cpu", "cuda")) for op, c in real_caps().items()}

    backend.capabilities = capabilities
    backend.unavailable = lambda: None
    return backend


# --------------------------------------------------------------------------- deep_gemm

DEEP_GEMM_BUGS = ("no-relu", "scale-of-next-key")


def fake_deep_gemm(bug: str = "") -> types.ModuleType:
    """DeepGEMM 54e2261's indexer API (csrc/apis/attention.hpp: sm_90's asserts, keyword
    names), computed in fp32: fp8_mqa_logits (clean_logits writes -inf outside each window),
    get_paged_mqa_logits_metadata, fp8_paged_mqa_logits (2-D context lens; columns past a
    row's length hold garbage: NaN here)."""
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = "2.6.1+fake"

    def logits(q, k, s, w):  # noqa: ANN001, ANN202
        scores = torch.einsum("thd,sd->ths", q.float(), k.float()) * s.float()
        if bug != "no-relu":
            scores = scores.clamp(min=0)
        return torch.einsum("ths,th->ts", scores, w.float())

    def check_q(q: torch.Tensor) -> None:
        assert q.dtype == torch.float8_e4m3fn and q.is_contiguous()
        assert q.shape[-2] in (32, 64), "sm_90: num_heads 32 or 64"
        assert q.shape[-1] in (32, 64, 128)

    def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,  # noqa: ANN001, ANN202
                       clean_logits=True, max_seqlen_k=0):
        check_q(q)
        k, sf = kv
        assert k.dtype == torch.float8_e4m3fn and sf.dtype == torch.float32
        assert weights.dtype == torch.float32 and weights.stride(1) == 1
        assert cu_seq_len_k_start.dtype == cu_seq_len_k_end.dtype == torch.int32
        if bug == "scale-of-next-key":
            sf = sf.roll(-1)
        out = logits(q, k, sf, weights)
        col = torch.arange(k.shape[0])[None, :]
        inside = (col >= cu_seq_len_k_start.long()[:, None]) & (col < cu_seq_len_k_end.long()[:, None])
        return out.masked_fill(~inside, float("-inf") if clean_logits else float("nan"))

    def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=None):  # noqa: ANN001, ANN202
        assert context_lens.dim() == 2 and context_lens.dtype == torch.int32
        assert block_kv == 64, "sm_90: block_kv 64"
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,  # noqa: ANN001, ANN202
                             max_context_len, clean_logits=False, indices=None):
        check_q(q)
        b, nn, h, d = q.shape
        pages, ps, one, width = kv_cache.shape
        assert ps == 64 and one == 1 and width == d + 4 and kv_cache.dtype == torch.uint8
        assert context_lens.shape == (b, nn) and context_lens.dtype == torch.int32
        assert block_table.dtype == torch.int32 and schedule_meta.dtype == torch.int32
        assert not clean_logits, "clean_logits needs 1-D context lens"
        flat = kv_cache.reshape(pages, -1)
        values = flat[:, : ps * d].contiguous().view(torch.float8_e4m3fn).view(pages, ps, d)
        scales = flat[:, ps * d:].contiguous().view(torch.float32).view(pages, ps)
        out = torch.full((b * nn, max_context_len), float("nan"))
        for r in range(b):
            for j in range(nn):
                n = int(context_lens[r, j])
                pg = block_table[r, : -(-n // ps)].long()
                k = values[pg].reshape(-1, d)[:n]
                s = scales[pg].reshape(-1)[:n]
                if bug == "scale-of-next-key":
                    s = scales[pg].reshape(-1).roll(-1)[:n]
                out[r * nn + j, :n] = logits(q[r, j:j + 1], k, s, weights[r * nn + j:r * nn + j + 1])[0]
        return out

    mod.fp8_mqa_logits = fp8_mqa_logits
    mod.get_paged_mqa_logits_metadata = get_paged_mqa_logits_metadata
    mod.fp8_paged_mqa_logits = fp8_paged_mqa_logits
    return mod
