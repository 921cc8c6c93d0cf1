"""Executable fakes of `flash_mla` and `flashinfer` for the adapter tests on a CPU.

Each fake computes attention in fp32 from the arguments *as the real library reads them*
(FlashMLA: [batch, s_q, heads, 576] q, block_table + cache_seqlens, LSE [b, h, s_q] natural;
FlashInfer: qo/kv indptr + kv_indices + kv_len_arr, ckv/kpe as separate strided tensors,
bottom-right causal ragged prefill, LSE base 2), with the signatures of the real functions
(FlashMLA main, flashinfer-python 0.2.14). A `bug=` argument plants one fault, so the tests
prove the suite catches it through the adapter.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import replace
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


def fake_flash_mla(bug: str = "") -> types.ModuleType:
    mod = types.ModuleType("flash_mla")
    mod.__version__ = "1.0.0+fake"

    def get_mla_metadata(*args: Any, **kwargs: Any) -> tuple[Any, None]:
        return types.SimpleNamespace(tile_scheduler_metadata=None), None

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,  # noqa: ANN001, ANN202
                               tile_scheduler_metadata, num_splits=None, softmax_scale=None,
                               causal=False, is_fp8_kvcache=False, indices=None,
                               attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                               topk_length=None, extra_topk_length=None):
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

    mod.get_mla_metadata = get_mla_metadata
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    return mod


# --------------------------------------------------------------------------- flashinfer


def fake_flashinfer(bug: str = "") -> dict[str, types.ModuleType]:
    root, mla, prefill = (types.ModuleType(n) for n in
                          ("flashinfer", "flashinfer.mla", "flashinfer.prefill"))
    root.__version__ = "0.2.14+fake"
    root.mla, root.prefill = mla, prefill
    log2e = 1 / math.log(2)

    class BatchMLAPagedAttentionWrapper:
        def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,  # noqa: ANN001
                     kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
            self.plan_args: dict[str, Any] = {}

        def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,  # noqa: ANN001, ANN201
                 head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
                 use_profiler=False):
            self.plan_args = dict(qo=qo_indptr.tolist(), kvp=kv_indptr.tolist(),
                                  kvi=kv_indices, lens=kv_len_arr.tolist(), ps=page_size,
                                  causal=causal, scale=sm_scale)

        def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None,  # noqa: ANN001, ANN201
                return_lse=False, profiler_buffer=None, kv_len=None, page_table=None,
                return_lse_base_on_e=False):
            a = self.plan_args
            q = torch.cat([q_nope, q_pe], -1)
            out = torch.empty(*q_nope.shape, dtype=q.dtype) if out is None else out
            lse_out = torch.empty(q.shape[:2], dtype=torch.float32)
            for r, n in enumerate(a["lens"]):
                lo, hi = a["qo"][r], a["qo"][r + 1]
                if hi == lo:
                    continue
                pages = a["kvi"][a["kvp"][r]: a["kvp"][r + 1]]
                kv = torch.cat([ckv_cache[pages], kpe_cache[pages]], -1)
                kv = kv.reshape(-1, 1, kv.shape[-1])[:n]
                o, l = attend(q[lo:hi], kv, kv[..., : q_nope.shape[-1]], a["scale"], a["causal"])
                out[lo:hi] = o.to(out.dtype)
                lse_out[lo:hi] = l if bug == "lse-natural" else l * log2e
            return (out, lse_out) if return_lse else out

    class BatchPrefillWithRaggedKVCacheWrapper:
        def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,  # noqa: ANN001
                     qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None,
                     mask_indptr_buf=None, backend="auto", jit_args=None):
            self.plan_args: dict[str, Any] = {}

        def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk,  # noqa: ANN001, ANN201
                 head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False, window_left=-1,
                 logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
                 q_data_type="float16", kv_data_type=None, non_blocking=True,
                 prefix_len_ptr=None, token_pos_in_items_ptr=None,
                 token_pos_in_items_len=0, max_item_len_ptr=None):
            self.plan_args = dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), causal=causal,
                                  cap=logits_soft_cap or 0.0, scale=sm_scale)

        def run(self, q, k, v, *args, out=None, lse=None, return_lse=False, enable_pdl=None):  # noqa: ANN001, ANN201
            a = self.plan_args
            out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype) if out is None else out
            lse_out = torch.empty(q.shape[:2], dtype=torch.float32)
            for r in range(len(a["qo"]) - 1):
                (qlo, qhi), (klo, khi) = a["qo"][r:r + 2], a["kv"][r:r + 2]
                if qhi == qlo:
                    continue
                causal = a["causal"] and bug != "ignores-causal"
                o, l = attend(q[qlo:qhi], k[klo:khi], v[klo:khi], a["scale"], causal, a["cap"])
                out[qlo:qhi] = o.to(out.dtype)
                lse_out[qlo:qhi] = l * log2e
            return (out, lse_out) if return_lse else out

    mla.BatchMLAPagedAttentionWrapper = BatchMLAPagedAttentionWrapper
    prefill.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    return {"flashinfer": root, "flashinfer.mla": mla, "flashinfer.prefill": prefill}


def install(monkeypatch: pytest.MonkeyPatch, modules: dict[str, types.ModuleType]) -> None:
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
