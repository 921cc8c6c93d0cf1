"""The AITER model's call surface and its documented corner behaviours.

Also home of `ModelBackend`, the small mlacheck backend the other test_model_* files use to
drive the model through mlacheck.harness (inputs -> model -> golden -> judge).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any

import pytest
import torch

import mlacheck.backends.aiter_model as aiter
from mlacheck import fp8
from mlacheck.backends.aiter.api import pinned_environment
from mlacheck.backends.aiter.metadata import validate_mla_metadata, validate_ps_metadata
from mlacheck.backends.aiter_model import _kernels, mla
from mlacheck.backends.base import Capability, Output
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs
from mlacheck.spec import Case, PrefillCase, SparseDecodeCase

GFX_ENV, CU_ENV, REV_ENV = "MLACHECK_AITER_MODEL_GFX", "CU_NUM", "MLACHECK_AITER_MODEL_REVISION"
MAX_SPLIT_PER_BATCH = 32  # what AITER's op tests pass
PS_TILE_Q = 256  # the FP8 prefill kernel's query tile
PS_KVLEN_GRANULARITY = 128
NONPERSISTENT_SPLITS = 4  # > 1 so the split-KV merge runs and writes the LSE


def model_env(gfx: str, cu: int = 8, revision: str = "head") -> contextlib.AbstractContextManager[None]:
    """Select the modelled chip / CU count / revision for the duration of a call."""
    return pinned_environment({GFX_ENV: gfx, CU_ENV: str(cu), REV_ENV: revision})


def scale1(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1).float()


def alloc(sizes: Any, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    names = ("work_metadata_ptrs", "work_indptr", "work_info_set", "reduce_indptr",
             "reduce_final_map", "reduce_partial_map")
    return {n: torch.empty(s, dtype=d, device=device) for n, (s, d) in zip(names, sizes,
                                                                          strict=True)}


class ModelBackend:
    """Drives the AITER model the way a caller of AITER would (a test double of the adapter).

    It records the schedule it used and runs mlacheck.backends.aiter.metadata on it; any validator message
    fails the case through Output.metadata["validation"].
    """

    def __init__(self, gfx: str = "gfx942", persistent: bool = True, cu: int = 8,
                 revision: str = "head", lse: bool = True, kv_granularity: int | None = None
                 ) -> None:
        self.gfx, self.persistent, self.cu, self.revision, self.lse = (
            gfx, persistent, cu, revision, lse)
        self.kv_granularity = kv_granularity  # None: AITER's tests' max(page_size, 16)
        self.name = f"aiter-model-{gfx}" + ("" if persistent else "-np")
        self.last_schedule: dict[str, Any] = {}

    def unavailable(self) -> str | None:
        return None

    def capabilities(self) -> dict[str, Capability]:
        chip = fp8.chip_fp8_format(self.gfx)
        fmts = ("bf16", chip)
        return {
            "mla_decode": Capability(q_formats=fmts, kv_formats=fmts, causal=(True,)),
            "mla_sparse_decode": Capability(q_formats=fmts, kv_formats=fmts, causal=(True,)),
            "mla_prefill": Capability(q_formats=(chip,), kv_formats=(chip,)),
            "paged_prefill": Capability(soft_cap=True),
        }

    def run(self, case: Case, inputs: Inputs) -> Output:
        with model_env(self.gfx, self.cu, self.revision):
            if isinstance(inputs, PrefillInputs):
                assert isinstance(case, PrefillCase)
                if case.paging is not None:
                    return self._paged_prefill(case, inputs)
                return self._ps_prefill(case, inputs)
            if isinstance(case, SparseDecodeCase):
                return self._sparse(case, inputs)
            return self._decode(case, inputs)

    # -- decode
    def _lse_supported(self, q: torch.Tensor, kv: torch.Tensor, heads: int, q_len: int) -> bool:
        try:
            _kernels.decode_kernel(_kernels.type_name(q.dtype), _kernels.type_name(kv.dtype),
                                   heads, q_len, True, True, True)
        except RuntimeError:
            return False
        return True

    def _decode(self, case: Case, inputs: DecodeInputs) -> Output:
        q = inputs.q.stored.contiguous()
        kv = inputs.pool.data
        ps = inputs.pool.table.page_size
        kv_indptr, kv_indices, last = inputs.table.to_aiter()
        qo = inputs.qo_indptr.to(torch.int32)
        q_lens = (qo[1:] - qo[:-1]).tolist()
        max_q, heads, batch = max(q_lens), q.shape[1], len(q_lens)
        out = inputs.out.out
        scales = dict(q_scale=scale1(inputs.q.scale), kv_scale=scale1(inputs.pool.scale))
        meta: dict[str, Any] = {}
        if not self.persistent:
            _, lse = mla.mla_decode_fwd(q, kv, out, qo, kv_indptr, kv_indices, last, max_q,
                                        page_size=ps, sm_scale=case.softmax_scale,
                                        num_kv_splits=NONPERSISTENT_SPLITS, return_lse=True,
                                        **scales)
            lse = lse if lse is not None and bool(torch.isfinite(lse).all()) else None
            return Output(out, lse, wrote_into_guarded=True)
        uni = max_q if len(set(q_lens)) == 1 else -1
        info = aiter.get_mla_metadata_info_v1(batch, max_q, heads, q.dtype, kv.dtype,
                                              is_sparse=False,
                                              max_split_per_batch=MAX_SPLIT_PER_BATCH)
        bufs = alloc(info, q.device)
        gran = self.kv_granularity or max(ps, 16)
        aiter.get_mla_metadata_v1(
            qo, kv_indptr, last, heads, 1, True, bufs["work_metadata_ptrs"],
            bufs["work_info_set"], bufs["work_indptr"], bufs["reduce_indptr"],
            bufs["reduce_final_map"], bufs["reduce_partial_map"], page_size=ps,
            kv_granularity=gran, max_seqlen_qo=max_q, uni_seqlen_qo=uni,
            max_split_per_batch=MAX_SPLIT_PER_BATCH, dtype_q_nope=q.dtype, dtype_kv_nope=kv.dtype)
        want_lse = self.lse and self._lse_supported(q, kv, 16 if heads > 16 else heads, max_q)
        _, lse = mla.mla_decode_fwd(
            q, kv, out, qo, kv_indptr, kv_indices, last, max_q, page_size=ps,
            sm_scale=case.softmax_scale, num_kv_splits=MAX_SPLIT_PER_BATCH,
            work_meta_data=bufs["work_metadata_ptrs"], work_indptr=bufs["work_indptr"],
            work_info_set=bufs["work_info_set"], reduce_indptr=bufs["reduce_indptr"],
            reduce_final_map=bufs["reduce_final_map"],
            reduce_partial_map=bufs["reduce_partial_map"], return_lse=want_lse, **scales)
        meta["validation"] = validate_mla_metadata(
            **bufs, qo_indptr=qo, kv_indptr=kv_indptr, kv_last_page_lens=last, page_size=ps,
            num_heads=heads, max_seqlen_qo=max_q, info_sizes=info, gfx=self.gfx,
            q_dtype=q.dtype, kv_dtype=kv.dtype, kv_granularity=gran, uni_seqlen_qo=uni)
        self.last_schedule = bufs
        return Output(out, lse, metadata=meta, wrote_into_guarded=True)

    def _sparse(self, case: SparseDecodeCase, inputs: DecodeInputs) -> Output:
        """Pool viewed as tokens (page size 1), top-k positions turned into global slots."""
        table = inputs.table
        q = inputs.q.stored.contiguous()
        kv = inputs.pool.data
        tokens = kv.view(-1, 1, 1, kv.shape[-1])
        qo = inputs.qo_indptr.to(torch.int32)
        q_lens = (qo[1:] - qo[:-1]).tolist()
        assert inputs.topk_indices is not None
        idx = inputs.topk_indices.long().cpu()
        slots = torch.full_like(idx, -1)
        t = 0
        for r, n in enumerate(q_lens):
            req_slots = table.slots_of(r)
            for _ in range(n):
                ok = idx[t] >= 0
                slots[t, ok] = req_slots[idx[t, ok]]
                t += 1
        kv_indices = slots.to(torch.int32).reshape(-1).to(q.device)
        lens = table.kv_lens.to(torch.int32)
        kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(lens, 0)
        ones = torch.ones(len(lens), dtype=torch.int32)
        heads, batch = q.shape[1], len(q_lens)
        info = aiter.get_mla_metadata_info_v1(batch, max(q_lens), heads, q.dtype, kv.dtype,
                                              is_sparse=True,
                                              max_split_per_batch=MAX_SPLIT_PER_BATCH)
        bufs = alloc(info, q.device)
        aiter.get_mla_metadata_v1(
            qo, kv_indptr, ones, heads, 1, True, bufs["work_metadata_ptrs"],
            bufs["work_info_set"], bufs["work_indptr"], bufs["reduce_indptr"],
            bufs["reduce_final_map"], bufs["reduce_partial_map"], page_size=1,
            kv_granularity=16, max_seqlen_qo=1, uni_seqlen_qo=1, topk=case.topk,
            max_split_per_batch=MAX_SPLIT_PER_BATCH, dtype_q_nope=q.dtype, dtype_kv_nope=kv.dtype)
        out = inputs.out.out
        mla.mla_decode_fwd(
            q, tokens, out, qo, kv_indptr, kv_indices, ones, 1, page_size=1,
            sm_scale=case.softmax_scale, num_kv_splits=MAX_SPLIT_PER_BATCH,
            work_meta_data=bufs["work_metadata_ptrs"], work_indptr=bufs["work_indptr"],
            work_info_set=bufs["work_info_set"], reduce_indptr=bufs["reduce_indptr"],
            reduce_final_map=bufs["reduce_final_map"],
            reduce_partial_map=bufs["reduce_partial_map"], q_scale=scale1(inputs.q.scale),
            kv_scale=scale1(inputs.pool.scale))
        problems = validate_mla_metadata(
            **bufs, qo_indptr=qo, kv_indptr=kv_indptr, kv_last_page_lens=ones, page_size=1,
            num_heads=heads, max_seqlen_qo=1, topk=case.topk, info_sizes=info, gfx=self.gfx,
            q_dtype=q.dtype, kv_dtype=kv.dtype, kv_indices_len=kv_indices.numel())
        self.last_schedule = bufs
        return Output(out, None, metadata={"validation": problems}, wrote_into_guarded=True)

    # -- prefill
    def _ps_prefill(self, case: PrefillCase, inputs: PrefillInputs) -> Output:
        qo = inputs.cu_seqlens_q.cpu().to(torch.int32)
        kvp = inputs.cu_seqlens_k.cpu().to(torch.int32)
        ctx = (kvp[1:] - kvp[:-1]).contiguous()
        heads = case.num_heads
        max_q = max(s.q_len for s in case.segments)
        info = aiter.get_ps_metadata_info_v1(batch_size=len(case.segments), num_head_k=heads,
                                             max_qlen=max_q, qlen_granularity=PS_TILE_Q)
        bufs = alloc(info)
        aiter.get_ps_metadata_v1(
            qo, kvp, ctx, 1, heads, bufs["work_metadata_ptrs"], bufs["work_indptr"],
            bufs["work_info_set"], bufs["reduce_indptr"], bufs["reduce_final_map"],
            bufs["reduce_partial_map"], qhead_granularity=1, qlen_granularity=PS_TILE_Q,
            kvlen_granularity=PS_KVLEN_GRANULARITY, block_size=1, is_causal=case.causal)
        out = inputs.out.out
        _, lse = mla.mla_prefill_ps_fwd(
            inputs.q.stored, inputs.k.stored, inputs.v.stored, out, qo, kvp,
            torch.arange(int(kvp[-1]), dtype=torch.int32), bufs["work_indptr"],
            bufs["work_info_set"], max_q, case.causal, bufs["reduce_indptr"],
            bufs["reduce_final_map"], bufs["reduce_partial_map"], case.softmax_scale,
            scale1(inputs.q.scale), scale1(inputs.k.scale), scale1(inputs.v.scale))
        fixed = self.revision == "pr3606"
        problems = validate_ps_metadata(
            bufs["work_indptr"], bufs["reduce_indptr"], bufs["reduce_final_map"],
            bufs["reduce_partial_map"], qo, kvp, ctx, heads, work_info_set=bufs["work_info_set"],
            is_causal=case.causal, info_sizes=info, reduce_single_partials=fixed)
        self.last_schedule = {**bufs, "lse": lse}
        meta: dict[str, Any] = {"validation": problems}
        if not fixed:  # as the adapter says it (mlacheck/backends/aiter/adapter.py)
            meta["lse"] = "AITER main returns the partial-LSE buffer: LSE not checked"
        return Output(out, lse if fixed else None, metadata=meta, wrote_into_guarded=True)

    def _paged_prefill(self, case: PrefillCase, inputs: PrefillInputs) -> Output:
        assert inputs.k_pool is not None and inputs.v_pool is not None
        kv_indptr, pages, last = inputs.k_pool.table.to_aiter()
        out = inputs.out.out
        kwargs: dict[str, Any] = {}
        if fp8.fmt(case.quant.q).is_fp8:
            kwargs = dict(q_descale=scale1(inputs.q.scale), k_descale=scale1(inputs.k_pool.scale),
                          v_descale=scale1(inputs.v_pool.scale))
        got, lse = aiter.mha_batch_prefill_func(
            inputs.q.stored, inputs.k_pool.data, inputs.v_pool.data,
            inputs.cu_seqlens_q.to(torch.int32), kv_indptr, pages,
            max(s.q_len for s in case.segments), max(s.kv_len for s in case.segments),
            softmax_scale=case.softmax_scale, logits_soft_cap=case.soft_cap, causal=case.causal,
            return_lse=True, out=out, kv_last_page_lens=last, **kwargs)
        assert got.data_ptr() == out.data_ptr()
        return Output(out, lse.transpose(0, 1), wrote_into_guarded=True)


# --------------------------------------------------------------------------- surface

# AITER main's parameter names, in order (the adapter calls by keyword; order still matters
# to callers that pass positionally, e.g. AITER's own tests).
SIGNATURES = {
    "get_mla_metadata_info_v1": ["batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype",
                                 "kv_dtype", "is_sparse", "fast_mode", "num_kv_splits",
                                 "intra_batch_mode", "max_split_per_batch"],
    "get_mla_metadata_v1": [
        "seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k",
        "num_heads_k", "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr",
        "reduce_indptr", "reduce_final_map", "reduce_partial_map", "page_size",
        "kv_granularity", "max_seqlen_qo", "uni_seqlen_qo", "fast_mode", "topk",
        "max_split_per_batch", "intra_batch_mode", "is_cp_round_robin", "mla_version",
        "dtype_q_nope", "dtype_q_rope", "dtype_kv_nope", "dtype_kv_rope", "dtype_q", "dtype_kv"],
    "mla_reduce_v1": ["partial_output", "partial_lse", "reduce_indptr", "reduce_final_map",
                      "reduce_partial_map", "max_seqlen_q", "num_kv_splits", "final_output",
                      "final_lse"],
    "get_ps_metadata_v1": [
        "seqlens_qo_indptr", "pages_kv_indptr", "context_lens", "gqa_ratio", "num_heads_k",
        "work_metadata_ptrs", "work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map", "qhead_granularity", "qlen_granularity", "kvlen_granularity",
        "block_size", "is_causal"],
    "mla_prefill_ps_asm_fwd": [
        "Q", "K", "V", "qo_indptr", "kv_indptr", "kv_page_indices", "work_indptr",
        "work_info_set", "max_seqlen_q", "softmax_scale", "is_causal", "splitData", "splitLse",
        "output", "q_scale", "k_scale", "v_scale"],
    "mha_batch_prefill_func": [
        "q", "k", "v", "cu_seqlens_q", "kv_indptr", "kv_page_indices", "max_seqlen_q",
        "max_seqlen_k", "dropout_p", "softmax_scale", "logits_soft_cap", "causal",
        "window_size", "alibi_slopes", "deterministic", "return_lse", "return_attn_probs", "out",
        "kv_last_page_lens", "block_table", "seqlen_k", "q_descale", "k_descale", "v_descale",
        "kv_block_descale", "sink_ptr", "sink_size"],
    "mla.mla_decode_fwd": [
        "q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
        "max_seqlen_q", "page_size", "nhead_kv", "sm_scale", "logit_cap", "num_kv_splits",
        "num_kv_splits_indptr", "work_meta_data", "work_indptr", "work_info_set",
        "reduce_indptr", "reduce_final_map", "reduce_partial_map", "q_scale", "kv_scale",
        "intra_batch_mode", "return_logits", "return_lse", "g_kv_indptr", "cp_world_size",
        "cp_rank", "causal"],
    "mla.mla_prefill_ps_fwd": [
        "Q", "K", "V", "output", "qo_indptr", "kv_indptr", "kv_page_indices", "work_indptr",
        "work_info_set", "max_seqlen_q", "is_causal", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map", "softmax_scale", "q_scale", "k_scale", "v_scale"],
}


def _resolve(name: str) -> Any:
    obj: Any = aiter
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_match_aiter_main(name: str) -> None:
    assert list(inspect.signature(_resolve(name)).parameters) == SIGNATURES[name]


def test_ps_info_signature_follows_the_modelled_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REV_ENV, "head")
    head = list(inspect.signature(aiter.get_ps_metadata_info_v1).parameters)
    assert head == ["batch_size", "num_head_k", "max_qlen", "qlen_granularity"]
    monkeypatch.setenv(REV_ENV, "pr3606")
    assert "max_kvlen" in inspect.signature(aiter.get_ps_metadata_info_v1).parameters


def test_chip_dtypes_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GFX_ENV, raising=False)
    monkeypatch.delenv(CU_ENV, raising=False)
    assert aiter.chip_info.get_gfx() == "gfx942" and aiter.dtypes.fp8 == torch.float8_e4m3fnuz
    assert aiter.chip_info.get_cu_num() == 8
    monkeypatch.setenv(GFX_ENV, "gfx950")
    monkeypatch.setenv(CU_ENV, "256")
    assert aiter.dtypes.fp8 == torch.float8_e4m3fn and aiter.chip_info.get_cu_num() == 256
    assert aiter.IS_MLACHECK_MODEL and aiter.AITER_COMMIT in aiter.VERSION_MARKER
    assert "mlacheck.model" in aiter.__version__
    monkeypatch.setenv(GFX_ENV, "gfx1100")
    with pytest.raises(RuntimeError, match="gfx1100"):
        aiter.chip_info.get_gfx()


# --------------------------------------------------------------------------- sizes


def test_info_sizes_follow_aiter_formulas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GFX_ENV, "gfx942")
    monkeypatch.setenv(CU_ENV, "8")
    bf16, fnuz = torch.bfloat16, torch.float8_e4m3fnuz
    info = aiter.get_mla_metadata_info_v1(4, 1, 16, bf16, bf16, False)
    # 16 heads: ceil(16/128) = 1 tile; fast mode: (4 + 8 - 1) works, min(11, 14) split tiles
    assert [s for s, _ in info] == [2, 9, (11, 8), 5, (4, 2), 11]
    info = aiter.get_mla_metadata_info_v1(4, 1, 16, bf16, bf16, False, max_split_per_batch=32)
    assert info[5][0] == 4 + min(8, 32 * 4)  # tiles + min(max_splits, cap x batch)
    info = aiter.get_mla_metadata_info_v1(3, 4, 128, fnuz, fnuz, False)  # ceil(512/128) tiles
    assert info[3][0] == 3 * 4 + 1 and info[2][0] == ((3 + 7) * 4, 8)
    info = aiter.get_mla_metadata_info_v1(3, 1, 48, bf16, bf16, False)  # folded: ceil(48/16)
    assert info[3][0] == 3 * 3 + 1
    info = aiter.get_mla_metadata_info_v1(3, 4, 16, bf16, bf16, True)  # sparse: B x q_len batches
    assert info[3][0] == 12 + 1 and info[2][0] == (12 + 7, 8)
    info = aiter.get_mla_metadata_info_v1(4, 1, 16, bf16, bf16, False, fast_mode=False)
    assert info[2][0] == (4 * 8, 8) and info[5][0] == 4 * 8
    with pytest.raises(AssertionError):
        aiter.get_mla_metadata_info_v1(4, 1, 12, bf16, bf16, False)  # heads % 8 != 0


def test_ps_info_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CU_ENV, "48")
    monkeypatch.setenv(REV_ENV, "head")
    info = aiter.get_ps_metadata_info_v1(3, 16, 600)
    qsplit, cus = math.ceil(600 / 256), 48 // math.gcd(16, 48)  # 3 q tiles, 3 CUs per cluster
    assert [s for s, _ in info] == [2, 49, ((3 + cus - 1) * qsplit * 16, 8), 3 * qsplit + 1,
                                    (3 * qsplit, 2), min(3 + cus - 1, (cus - 1) * 2) * qsplit]
    monkeypatch.setenv(REV_ENV, "pr3606")
    info = aiter.get_ps_metadata_info_v1(3, 16, 600, max_kvlen=1000)
    per_cluster = 3 * qsplit * (math.ceil(1000 / 128) + cus)
    assert info[2][0] == (16 * per_cluster, 8) and info[5][0] == per_cluster


# --------------------------------------------------------------------------- errors


def _tiny_decode(heads: int, q_len: int = 1, dtype: torch.dtype = torch.bfloat16,
                 page_size: int = 1) -> dict[str, Any]:
    kv_len = 40
    pages = math.ceil(kv_len / page_size)
    return dict(
        q=torch.randn(q_len, heads, 576).to(dtype),
        kv_buffer=torch.randn(pages, page_size, 1, 576).to(dtype),
        o=torch.empty(q_len, heads, 512, dtype=torch.bfloat16),
        qo_indptr=torch.tensor([0, q_len], dtype=torch.int32),
        kv_indptr=torch.tensor([0, pages], dtype=torch.int32),
        kv_indices=torch.arange(pages, dtype=torch.int32),
        kv_last_page_lens=torch.tensor([kv_len - (pages - 1) * page_size], dtype=torch.int32),
        max_seqlen_q=q_len, page_size=page_size, sm_scale=0.1)


def _persistent_args(args: dict[str, Any], heads: int) -> dict[str, Any]:
    q_len = args["max_seqlen_q"]
    info = aiter.get_mla_metadata_info_v1(1, q_len, heads, args["q"].dtype,
                                          args["kv_buffer"].dtype, False)
    bufs = alloc(info)
    aiter.get_mla_metadata_v1(args["qo_indptr"], args["kv_indptr"], args["kv_last_page_lens"],
                              heads, 1, True, bufs["work_metadata_ptrs"], bufs["work_info_set"],
                              bufs["work_indptr"], bufs["reduce_indptr"], bufs["reduce_final_map"],
                              bufs["reduce_partial_map"], page_size=args["page_size"],
                              max_seqlen_qo=q_len, uni_seqlen_qo=q_len,
                              dtype_q_nope=args["q"].dtype, dtype_kv_nope=args["kv_buffer"].dtype)
    return dict(work_meta_data=bufs["work_metadata_ptrs"], work_indptr=bufs["work_indptr"],
                work_info_set=bufs["work_info_set"], reduce_indptr=bufs["reduce_indptr"],
                reduce_final_map=bufs["reduce_final_map"],
                reduce_partial_map=bufs["reduce_partial_map"])


def test_unsupported_heads_fail_like_aiter(monkeypatch: pytest.MonkeyPatch) -> None:
    """AITER pads nothing: 12 heads assert in the persistent path (after the metadata planner
    refused them), 8 heads on gfx942 bf16 q_len 1 too; split-KV finds no kernel for 12."""
    monkeypatch.setenv(GFX_ENV, "gfx942")
    args = _tiny_decode(16)
    meta = _persistent_args(args, 16)
    for heads in (12, 8):
        bad = _tiny_decode(heads)
        with pytest.raises(AssertionError, match=f"nhead={heads} and max_seqlen_q=1 not supported"):
            mla.mla_decode_fwd(**bad, num_kv_splits=8, **meta)
    with pytest.raises(RuntimeError, match="only supports #heads in"):
        _persistent_args(_tiny_decode(8), 8)
    with pytest.raises(RuntimeError, match="cannot get heuristic kernel"):
        mla.mla_decode_fwd(**_tiny_decode(12))
    mla.mla_decode_fwd(**_tiny_decode(8))  # the split-KV bf16 8-head kernel exists


def test_kernel_availability_quirks(monkeypatch: pytest.MonkeyPatch) -> None:
    """gfx942 has persistent LSE kernels only for fp8 64 heads q_len 1; fp8 Q needs both
    scales; the FP8 prefill kernel does not exist on gfx942."""
    monkeypatch.setenv(GFX_ENV, "gfx942")
    args = _tiny_decode(16)
    with pytest.raises(RuntimeError, match="cannot get heuristic kernel.*lse:1"):
        mla.mla_decode_fwd(**args, num_kv_splits=8, return_lse=True, **_persistent_args(args, 16))
    f8 = _tiny_decode(16, dtype=torch.float8_e4m3fnuz)
    with pytest.raises(RuntimeError, match="fp8 Q requires q_scale and kv_scale"):
        mla.mla_decode_fwd(**f8)
    with pytest.raises(RuntimeError, match="not supported on gfx942"):
        _kernels.prefill_ps_kernel(torch.float8_e4m3fnuz, torch.float8_e4m3fnuz, 1, True)
    monkeypatch.setenv(GFX_ENV, "gfx950")
    assert _kernels.prefill_ps_kernel(torch.float8_e4m3fn, torch.float8_e4m3fn, 1, False)
    with pytest.raises(RuntimeError, match="gqa:16"):
        _kernels.prefill_ps_kernel(torch.float8_e4m3fn, torch.float8_e4m3fn, 16, True)


def test_metadata_overflow_raises_instead_of_corrupting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers sized for q_len 1 with 128 fp8 heads, filled for q_len 4: AITER would write
    past reduce_indptr (4 tiles per request instead of 1); the model names the overflow."""
    monkeypatch.setenv(GFX_ENV, "gfx942")
    fnuz = torch.float8_e4m3fnuz
    info = aiter.get_mla_metadata_info_v1(2, 1, 128, fnuz, fnuz, False)
    bufs = alloc(info)
    qo = torch.tensor([0, 4, 8], dtype=torch.int32)
    kv = torch.tensor([0, 100, 200], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="reduce_indptr but the buffer holds 3"):
        aiter.get_mla_metadata_v1(qo, kv, torch.ones(2, dtype=torch.int32), 128, 1, True,
                                  bufs["work_metadata_ptrs"], bufs["work_info_set"],
                                  bufs["work_indptr"], bufs["reduce_indptr"],
                                  bufs["reduce_final_map"], bufs["reduce_partial_map"],
                                  max_seqlen_qo=4, uni_seqlen_qo=4, dtype_q_nope=fnuz,
                                  dtype_kv_nope=fnuz)


# --------------------------------------------------------------------------- reduce


def _reduce_case(single: bool) -> dict[str, Any]:
    heads, dv = 16, 512
    part = torch.randn(6, heads, dv)
    lse = torch.randn(6, heads)
    # tile 0: rows 0-1 <- partials at 0 and 2 (two rows each); tile 1: rows 2-3 <- partial 4
    return dict(partial_output=part, partial_lse=lse,
                reduce_indptr=torch.tensor([0, 2, 3 if single else 2], dtype=torch.int32),
                reduce_final_map=torch.tensor([[0, 2], [2, 4]], dtype=torch.int32),
                reduce_partial_map=torch.tensor([0, 2, 4], dtype=torch.int32),
                max_seqlen_q=2, num_kv_splits=0,
                final_output=torch.full((4, heads, dv), -7.0, dtype=torch.bfloat16),
                final_lse=torch.full((4, heads), -7.0))


def test_reduce_merges_and_skips_single_partials_at_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REV_ENV, "head")
    c = _reduce_case(single=True)
    aiter.mla_reduce_v1(**c)
    p, l_ = c["partial_output"], c["partial_lse"]
    m = torch.logsumexp(torch.stack([l_[0:2], l_[2:4]]), 0)
    want = torch.exp(l_[0:2] - m)[..., None] * p[0:2] + torch.exp(l_[2:4] - m)[..., None] * p[2:4]
    torch.testing.assert_close(c["final_output"][:2].float(), want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(c["final_lse"][:2], m)
    assert bool((c["final_output"][2:] == -7).all()) and bool((c["final_lse"][2:] == -7).all())
    monkeypatch.setenv(REV_ENV, "pr3606")  # ROCm/aiter#3606: one-partial tiles reduced too
    c = _reduce_case(single=True)
    aiter.mla_reduce_v1(**c)
    torch.testing.assert_close(c["final_lse"][2:], c["partial_lse"][4:6])


def test_reduce_nan_and_empty_partials() -> None:
    c = _reduce_case(single=False)
    c["partial_lse"][2:4] = float("nan")  # NaN LSE counts as -inf: tile 0 = partial 0 alone
    c["partial_output"][2:4] = float("nan")
    aiter.mla_reduce_v1(**c)
    torch.testing.assert_close(c["final_output"][:2].float(), c["partial_output"][:2],
                               atol=2e-2, rtol=1e-2)
    c = _reduce_case(single=False)
    c["partial_lse"][:4] = float("-inf")  # nothing seen: output 0, LSE +inf (kernel's INFINITY)
    aiter.mla_reduce_v1(**c)
    assert bool((c["final_output"][:2] == 0).all()) and bool(torch.isposinf(c["final_lse"][:2]).all())


def test_reduce_without_final_map_and_strided_output() -> None:
    c = _reduce_case(single=False)
    c["reduce_final_map"] = None  # rows [t * len, (t + 1) * len), len = p1 - p0 = 2
    big = torch.zeros(4, 32, 512, dtype=torch.bfloat16)
    c["final_output"] = big[:, ::2]  # every other head: the output's strides are honoured
    aiter.mla_reduce_v1(**c)
    assert bool((big[:2, 1::2] == 0).all()) and bool((big[:2, ::2] != 0).any())


def test_fold_mtp_repoints_output_like_aiter(monkeypatch: pytest.MonkeyPatch) -> None:
    """32 bf16 heads on gfx942 are folded; with q_len 2 AITER's mla_decode_fwd returns the
    unfolded result by Tensor.set_ on the caller's `o`: the memory passed in keeps the
    folded layout, the tensor object sees the right values."""
    monkeypatch.setenv(GFX_ENV, "gfx942")
    args = _tiny_decode(32, q_len=2)
    backing = torch.zeros(2, 32, 512, dtype=torch.bfloat16)
    args["o"] = backing[:]
    o = args["o"]
    mla.mla_decode_fwd(**args, num_kv_splits=8, **_persistent_args(args, 32))
    assert o.data_ptr() != backing.data_ptr()
    folded = backing.view(2, 2, 16, 512)  # [group][token] per request
    torch.testing.assert_close(o[1, 16:], folded[1, 1])  # token 1, heads 16-31 <- group 1 row 1


def test_persistent_gate_and_stale_pointers(monkeypatch: pytest.MonkeyPatch) -> None:
    """gfx950 bf16 16-head q_len-1 decode at batch >= 32 drops the metadata (split-KV
    instead) unless num_kv_splits is passed; work_meta_data must point at the buffers."""
    monkeypatch.setenv(GFX_ENV, "gfx950")
    monkeypatch.delenv("AITER_MLA_DECODE_PERSISTENT_MAX_BATCH", raising=False)
    batch, kv_len = 32, 8
    args = dict(q=torch.randn(batch, 16, 576).bfloat16(),
                kv_buffer=torch.randn(batch * kv_len, 1, 1, 576).bfloat16(),
                o=torch.empty(batch, 16, 512, dtype=torch.bfloat16),
                qo_indptr=torch.arange(batch + 1, dtype=torch.int32),
                kv_indptr=torch.arange(0, (batch + 1) * kv_len, kv_len, dtype=torch.int32),
                kv_indices=torch.arange(batch * kv_len, dtype=torch.int32),
                kv_last_page_lens=torch.ones(batch, dtype=torch.int32), max_seqlen_q=1,
                sm_scale=0.1)
    info = aiter.get_mla_metadata_info_v1(batch, 1, 16, torch.bfloat16, torch.bfloat16, False)
    bufs = alloc(info)
    aiter.get_mla_metadata_v1(args["qo_indptr"], args["kv_indptr"], args["kv_last_page_lens"],
                              16, 1, True, bufs["work_metadata_ptrs"], bufs["work_info_set"],
                              bufs["work_indptr"], bufs["reduce_indptr"], bufs["reduce_final_map"],
                              bufs["reduce_partial_map"], max_seqlen_qo=1, uni_seqlen_qo=1)
    meta = dict(work_meta_data=bufs["work_metadata_ptrs"], work_indptr=bufs["work_indptr"],
                work_info_set=bufs["work_info_set"], reduce_indptr=bufs["reduce_indptr"],
                reduce_final_map=bufs["reduce_final_map"],
                reduce_partial_map=bufs["reduce_partial_map"])
    logits, _ = mla.mla_decode_fwd(**args, **meta)
    assert logits.shape[0] == batch  # split-KV partials [T, splits, H, Dv]: metadata dropped
    logits, _ = mla.mla_decode_fwd(**args, num_kv_splits=8, **meta)
    assert logits.shape[0] == bufs["reduce_partial_map"].numel()  # persistent partial rows
    stale = {**meta, "work_info_set": bufs["work_info_set"].clone()}
    with pytest.raises(RuntimeError, match="does not point at work_indptr / work_info_set"):
        mla.mla_decode_fwd(**args, num_kv_splits=8, **stale)
