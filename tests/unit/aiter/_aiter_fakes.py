"""Fake `aiter`-shaped modules for the adapter tests: stubs with AITER main's signatures
(e4048607: TARGET_COMMIT in mlacheck/backends/aiter/api.py), installable under any module
name, one function replaceable to simulate another AITER version. The stubs are never
called."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from mlacheck.backends.aiter.api import FP8_MQA_LOGITS, PAGED_MQA_LOGITS
from mlacheck.backends.aiter_conversion import KERNEL_MODULE, KERNELS
from mlacheck.backends.aiter_model import _topk as _model_topk
from mlacheck.backends.aiter_model.ops.triton._triton_kernels.attention import (
    sparse_attention_dsv4 as _model_dsv4,
)
from mlacheck.backends.aiter_model.ops.triton.attention import fp8_mqa_logits as _model_mqa
from mlacheck.backends.aiter_model.ops.triton.attention import pa_mqa_logits as _model_pa


def get_mla_metadata_info_v1(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype,  # noqa: ANN001, ANN201
                             is_sparse, fast_mode=True, num_kv_splits=32,
                             intra_batch_mode=False, max_split_per_batch=-1):
    raise NotImplementedError


def get_mla_metadata_v1(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens,  # noqa: ANN001, ANN201
                        num_heads_per_head_k, num_heads_k, is_causal, work_metadata_ptrs,
                        work_info_set, work_indptr, reduce_indptr, reduce_final_map,
                        reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1,
                        uni_seqlen_qo=-1, fast_mode=True, topk=-1, max_split_per_batch=-1,
                        intra_batch_mode=False, is_cp_round_robin=False, mla_version=0,
                        dtype_q_nope=None, dtype_q_rope=None, dtype_kv_nope=None,
                        dtype_kv_rope=None, dtype_q=None, dtype_kv=None):
    raise NotImplementedError


def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,  # noqa: ANN001, ANN201
                   max_seqlen_q, page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0,
                   num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
                   work_indptr=None, work_info_set=None, reduce_indptr=None,
                   reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None,
                   intra_batch_mode=False, return_logits=False, return_lse=False,
                   g_kv_indptr=None, cp_world_size=1, cp_rank=0, causal=True):
    raise NotImplementedError


def get_ps_metadata_info_v1(batch_size, num_head_k, max_qlen, qlen_granularity=256):  # noqa: ANN001, ANN201
    raise NotImplementedError


def get_ps_metadata_v1(seqlens_qo_indptr, pages_kv_indptr, context_lens, gqa_ratio,  # noqa: ANN001, ANN201
                       num_heads_k, work_metadata_ptrs, work_indptr, work_info, reduce_indptr,
                       reduce_final_map, reduce_partial_map, qhead_granularity=1,
                       qlen_granularity=256, kvlen_granularity=16, block_size=16,
                       is_causal=True):
    raise NotImplementedError


def mla_prefill_ps_fwd(Q, K, V, output, qo_indptr, kv_indptr, kv_page_indices, work_indptr,  # noqa: ANN001, ANN201, N803
                       work_info_set, max_seqlen_q, is_causal, reduce_indptr=None,
                       reduce_final_map=None, reduce_partial_map=None, softmax_scale=None,
                       q_scale=None, k_scale=None, v_scale=None):
    raise NotImplementedError


def mha_batch_prefill_func(q, k, v, cu_seqlens_q, kv_indptr, kv_page_indices, max_seqlen_q,  # noqa: ANN001, ANN201
                           max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                           logits_soft_cap=0.0, causal=False, window_size=(-1, -1),
                           alibi_slopes=None, deterministic=False, return_lse=False,
                           return_attn_probs=False, out=None, kv_last_page_lens=None,
                           block_table=None, seqlen_k=None, q_descale=None, k_descale=None,
                           v_descale=None, kv_block_descale=None, sink_ptr=None,
                           sink_size: int = 0):
    raise NotImplementedError


# AITER 0.1.7.post2.dev18 generation (docs/aiter.md, 'Versions'): no page_size / nhead_kv, sm_scale
# 9th; metadata without kv_last_page_lens / page_size / dtypes, work_indptr before work_info.
def mla_decode_fwd_0_1_7(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,  # noqa: ANN001, ANN201
                         max_seqlen_q, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
                         num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None,
                         work_info_set=None, reduce_indptr=None, reduce_final_map=None,
                         reduce_partial_map=None, q_scale=None, kv_scale=None):
    raise NotImplementedError


def get_mla_metadata_v1_0_1_7(seqlens_qo_indptr, seqlens_kv_indptr, num_heads_per_head_k,  # noqa: ANN001, ANN201
                              num_heads_k, is_causal, work_metadata_ptrs, work_indptr,
                              work_info, reduce_indptr, reduce_final_map, reduce_partial_map,
                              kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1,
                              fast_mode=True, topk=-1, max_split_per_batch=-1):
    raise NotImplementedError


HEAD_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "get_mla_metadata_info_v1": get_mla_metadata_info_v1,
    "get_mla_metadata_v1": get_mla_metadata_v1,
    "mla.mla_decode_fwd": mla_decode_fwd,
    "get_ps_metadata_info_v1": get_ps_metadata_info_v1,
    "get_ps_metadata_v1": get_ps_metadata_v1,
    "mla.mla_prefill_ps_fwd": mla_prefill_ps_fwd,
    "mha_batch_prefill_func": mha_batch_prefill_func,
    # the sparse path's entry points as AITER's head has them (the AITER model's, same keywords)
    "top_k_per_row_prefill": _model_topk.top_k_per_row_prefill,
    "top_k_per_row_decode": _model_topk.top_k_per_row_decode,
    FP8_MQA_LOGITS: _model_mqa.fp8_mqa_logits,
    PAGED_MQA_LOGITS: _model_pa.deepgemm_fp8_paged_mqa_logits,
    # index_conversion: head has the two kernels and no entry point (aiter_conversion)
    **{f"{KERNEL_MODULE}.{k}": getattr(_model_dsv4, k) for k in KERNELS},
}

FP8_OF_CHIP = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}


def install_fake_aiter(monkeypatch: pytest.MonkeyPatch, name: str, gfx: str = "gfx950",
                       replace: dict[str, Callable[..., Any] | None] | None = None) -> str:
    """Register a fake AITER package `name` (and its submodules) in sys.modules.

    `replace` maps a qualname ("mla.mla_decode_fwd", "get_mla_metadata_v1", ...) to another
    function, or to None to leave it out. Returns `name`.
    """
    funcs = dict(HEAD_FUNCTIONS)
    funcs.update(replace or {})
    root = types.ModuleType(name)
    mla = types.ModuleType(f"{name}.mla")
    dtypes = types.ModuleType(f"{name}.dtypes")
    jit = types.ModuleType(f"{name}.jit")
    utils = types.ModuleType(f"{name}.jit.utils")
    chip_info = types.ModuleType(f"{name}.jit.utils.chip_info")
    dtypes.fp8 = FP8_OF_CHIP.get(gfx, torch.float8_e4m3fn)  # type: ignore[attr-defined]
    chip_info.get_gfx = lambda: gfx  # type: ignore[attr-defined]
    chip_info.get_cu_num = lambda: 80  # type: ignore[attr-defined]
    # the sparse-path entry points (issue 29) live in submodules: ops.triton.attention.<mod>
    submodules: dict[str, types.ModuleType] = {}
    for qualname, fn in funcs.items():
        if fn is None:
            continue
        owner, _, attr = qualname.rpartition(".")
        if owner.startswith("ops."):
            parent = root
            for depth, part in enumerate(owner.split(".")):
                path = ".".join(owner.split(".")[: depth + 1])
                if path not in submodules:
                    submodules[path] = types.ModuleType(f"{name}.{path}")
                    setattr(parent, part, submodules[path])
                parent = submodules[path]
            setattr(parent, attr, fn)
            continue
        setattr(mla if owner == "mla" else root, attr, fn)
    root.mla, root.dtypes, root.jit = mla, dtypes, jit  # type: ignore[attr-defined]
    jit.utils, utils.chip_info = utils, chip_info  # type: ignore[attr-defined]
    for mod in (root, mla, dtypes, jit, utils, chip_info, *submodules.values()):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return name
