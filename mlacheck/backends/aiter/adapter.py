"""The AITER adapter: AMD's MLA kernels (persistent / non-persistent decode, sparse top-k decode,
FP8 persistent-scheduling ASM prefill, CK paged batch prefill) behind the backend contract.

One adapter class serves the real `aiter` package (the PyPI distribution `amd-aiter`) and
mlacheck's torch model of its API (`mlacheck.backends.aiter_model`). It calls everything BY
KEYWORD, never positionally, because AITER reorders arguments between releases
(`get_mla_metadata_v1` takes `work_info_set` before `work_indptr` while
`get_mla_metadata_info_v1` returns them the other way round, and the 9th positional argument
of `mla_decode_fwd` is `sm_scale` in 0.1.7.x but `page_size` at main). Nothing here has been
run on ROCm hardware: it is verified only against the torch model.
"""


from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlacheck import fp8, layouts
from mlacheck.backends.aiter import pipeline as aiter_pipeline
from mlacheck.backends.aiter.api import (
    AITER_ENV_CONTROLS,
    CALLED_PARAMETERS,
    EXACT_SIZE_BUFFERS,
    METADATA_BUFFER_NAMES,
    MODEL_GFX_ENV,
    MODEL_MODULE,
    OP_FUNCTIONS,
    REAL_MODULE,
    AdapterError,
    AiterApi,
    load_api,
    pinned_environment,
)
from mlacheck.backends.aiter.capability import (
    DECODE_REASONS,
    DEFAULT_MAX_SPLIT_PER_BATCH,
    DEFAULT_NONPERSISTENT_KV_SPLITS,
    MAX_DECODE_HEADS,
    NO_KERNEL_MESSAGE,
    PAGE_SIZES_POW2,
    PAGED_PREFILL_REASONS,
    PREFILL_PS_HEADS,
    PREFILL_PS_KVLEN_GRANULARITY,
    PREFILL_PS_REASONS,
    PREFILL_PS_TILE_Q,
    HeadPadding,
    aiter_folds_heads,
    folded_heads_need_uniform_q_len,
    head_padding,
    nonpersistent_fp8_heads,
    nonpersistent_head_targets,
)
from mlacheck.backends.base import Capability, CaseRule, Output, Range
from mlacheck.backends.toolkit import lse_natural, lse_tokens_heads, nonempty_units
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs, cu_seqlens
from mlacheck.kvcache import PageTable, page_indptr
from mlacheck.spec import PIPELINE_OPS, Case, DecodeCase, Op, PrefillCase, SparseDecodeCase

# --------------------------------------------------------------------------- metadata cache


@dataclass
class MetadataBuffers:
    """Persistent-schedule buffers kept across calls, as a serving engine keeps them.

    Storage only grows: a buffer is reallocated when get_mla_metadata_info_v1 asks for more
    than it holds (or another dtype / device); otherwise the same memory is refilled on
    every call. `fills` counts get_mla_metadata_v1 calls, `allocations` reallocations.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    allocations: int = 0
    fills: int = 0
    last_fill_key: tuple[Any, ...] | None = None

    def ensure(self, sizes: Sequence[tuple[Any, torch.dtype]],
               device: torch.device) -> tuple[dict[str, torch.Tensor], bool]:
        """Buffers at least as large as `sizes` (work_indptr exactly: its length is the
        persistent kernel's grid); True if any was (re)allocated."""
        grew = False
        for name, (shape, dtype) in zip(METADATA_BUFFER_NAMES, sizes, strict=True):
            want = _as_shape(shape)
            cur = self.tensors.get(name)
            exact = name in EXACT_SIZE_BUFFERS
            if (cur is not None and cur.dtype == dtype and cur.device == device
                    and cur.dim() == len(want)
                    and all(c == w if exact else c >= w
                            for c, w in zip(cur.shape, want, strict=True))):
                continue
            if cur is not None and not exact and cur.dtype == dtype and cur.dim() == len(want):
                want = tuple(max(c, w) for c, w in zip(cur.shape, want, strict=True))
            self.tensors[name] = torch.empty(want, dtype=dtype, device=device)
            self.allocations += 1
            grew = True
        return dict(self.tensors), grew


@dataclass(frozen=True)
class DecodeSchedule:
    """Everything one decode call hands AITER besides q / kv / o."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_lens: torch.Tensor
    page_size: int
    max_seqlen_q: int
    kv_buffer: torch.Tensor
    topk: int = -1  # >= 0: sparse (each query token its own pseudo-batch)


# --------------------------------------------------------------------------- the planner's arguments
#
# One derivation of what a persistent decode hands AITER's metadata planner, for the adapter's
# call and for finding 2's rule (folded_kv_offsets_wrong), so the rule plans what the adapter
# plans. A copy of it in the rule drifted once: the adapter left empty requests out of its
# calls, the rule still planned them all, and a nightly run went red on an unlabelled FAIL.


@dataclass(frozen=True)
class PlannerIndex:
    """What AITER's decode planner is given of a batch besides heads and dtypes: the index
    arrays (int32) of the requests handed over and the sizes. A DecodeSchedule has the same
    fields (on the call's device); this holds them without a KV buffer (finding 2's rule)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_lens: torch.Tensor
    page_size: int
    max_seqlen_q: int
    topk: int = -1


def decode_page_table(case: DecodeCase | SparseDecodeCase, table: PageTable
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AITER's page table (page-level kv_indptr, physical page ids, last-page lengths; CPU
    int32) of the requests a dense decode hands over: the non-empty ones, the empty ones left
    out of the call."""
    return table.of_requests(nonempty_units(case.q_lengths)).to_aiter()


def dense_decode_index(case: DecodeCase | SparseDecodeCase,
                       page_table: Sequence[torch.Tensor]) -> PlannerIndex:
    """A dense decode's index arrays (CPU): the kept (non-empty) requests' qo_indptr with
    `page_table`, their (kv_indptr, kv_indices, kv_last_page_lens) of decode_page_table."""
    kv_indptr, _, last = page_table
    kept = [case.q_lengths[r] for r in nonempty_units(case.q_lengths)]
    return PlannerIndex(qo_indptr=cu_seqlens(kept).to(torch.int32), kv_indptr=kv_indptr,
                        kv_last_page_lens=last, page_size=case.page_size,
                        max_seqlen_q=case.max_q_len)


def metadata_split_cap(max_split_per_batch: int, heads: int, batch: int,
                       cu_num: int | None) -> int:
    """max_split_per_batch: AITER's tests use 32, clamped to ceil(cu / batch) for >= 128
    heads (as vLLM does)."""
    cap = max_split_per_batch
    if heads >= 128 and cu_num:
        cap = min(cap, max(1, math.ceil(cu_num / max(1, batch))))
    return cap


def planner_args(index: PlannerIndex | DecodeSchedule, heads: int, q_dtype: torch.dtype,
                 kv_dtype: torch.dtype, split_cap: int) -> dict[str, Any]:
    """get_mla_metadata_v1's keywords besides the six buffers, for `heads` (padded) query heads
    over one KV head."""
    lens = (index.qo_indptr[1:] - index.qo_indptr[:-1]).tolist()
    uniform = lens[0] if lens and all(n == lens[0] for n in lens) else -1
    is_fp8_pair = q_dtype.itemsize == 1 and kv_dtype.itemsize == 1
    granularity = max(index.page_size, 32 if (heads == 64 and is_fp8_pair) else 16)
    return dict(
        seqlens_qo_indptr=index.qo_indptr, seqlens_kv_indptr=index.kv_indptr,
        kv_last_page_lens=index.kv_last_page_lens, num_heads_per_head_k=heads,
        num_heads_k=1, is_causal=True, page_size=index.page_size,
        kv_granularity=granularity, max_seqlen_qo=index.max_seqlen_q,
        uni_seqlen_qo=uniform, fast_mode=True, topk=index.topk,
        max_split_per_batch=split_cap, intra_batch_mode=False, dtype_q_nope=q_dtype,
        dtype_kv_nope=kv_dtype)


def case_planner_args(case: DecodeCase, cu_num: int | None,
                      max_split_per_batch: int = DEFAULT_MAX_SPLIT_PER_BATCH) -> dict[str, Any]:
    """What the persistent dense decode hands get_mla_metadata_v1 for `case` on a chip of
    `cu_num` CUs (besides the buffers), from the case alone: the functions AiterAdapter._decode
    calls, with what it takes from its inputs taken from the case (the page table's counts, the
    persistent head padding, the formats' storage dtypes). CPU index arrays only."""
    lens = torch.tensor(case.kv_lengths, dtype=torch.int64)
    indptr = page_indptr(lens, case.page_size)
    table = PageTable(case.page_size, indptr, torch.arange(int(indptr[-1])), lens)
    index = dense_decode_index(case, decode_page_table(case, table))
    heads = head_padding(case.num_heads).padded
    split_cap = metadata_split_cap(max_split_per_batch, heads, index.qo_indptr.numel() - 1,
                                   cu_num)
    return planner_args(index, heads, fp8.fmt(case.quant.q).dtype,
                        fp8.fmt(case.quant.kv).dtype, split_cap)


# --------------------------------------------------------------------------- the adapter


class AiterAdapter:
    """AITER behind the backend contract (see the module docstring and docs/aiter.md)."""

    def __init__(
        self,
        api_module_name: str = REAL_MODULE,
        *,
        persistent: bool = True,
        name: str | None = None,
        devices: Collection[str] = ("cuda",),
        max_split_per_batch: int = DEFAULT_MAX_SPLIT_PER_BATCH,
        nonpersistent_kv_splits: int = DEFAULT_NONPERSISTENT_KV_SPLITS,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.api_module_name = api_module_name
        self.persistent = persistent
        self.name = name or ("aiter" if persistent else "aiter-nonpersistent")
        self.devices = tuple(devices)
        self.max_split_per_batch = max_split_per_batch
        self.nonpersistent_kv_splits = max(2, nonpersistent_kv_splits)
        self.env = dict(AITER_ENV_CONTROLS if env is None else env)
        self.metadata_buffers: dict[str, MetadataBuffers] = {}
        self._loaded: AiterApi | str | None = None

    def version(self) -> str:
        api = self._load()
        return api if isinstance(api, str) else api.version

    # -- contract
    def unavailable(self) -> str | None:
        """Why this backend cannot run here: the module cannot be imported or probed, or the
        decode API (the adapter's core) does not fit. A problem in a prefill function SKIPs
        only that op (see capabilities)."""
        api = self._load()
        if isinstance(api, str):
            return api
        if self.persistent:
            return api.op_problem(Op.DECODE)
        return api.problems.get("mla.mla_decode_fwd")

    def capabilities(self) -> dict[str, Capability]:
        api = self._load()
        if isinstance(api, str):
            return {op: Capability(refusal=api) for op in OP_FUNCTIONS}
        chip_fp8 = api.fp8_format
        fp8_pair = (chip_fp8, chip_fp8)
        decode_pairs = {("bf16", "bf16"), fp8_pair}
        if self.persistent:
            decode_pairs.add(("bf16", chip_fp8))  # a16w8: persistent kernels only
        decode_common: dict[str, Any] = dict(
            q_formats=("bf16", chip_fp8), kv_formats=("bf16", chip_fp8),
            format_pairs=frozenset(decode_pairs), scale_policies=("unit", "amax"),
            head_counts=Range(1, MAX_DECODE_HEADS), empty_requests=True,  # left out of the call
            q_len=Range(1, 4), causal=(True,), devices=self.devices,
            # kv_buffer is the pool's memory as is: [pages, page_size, 1, 576]
            layouts=(layouts.LINEAR.name,), reasons=DECODE_REASONS,
        )
        decode_rules: tuple[CaseRule, ...] = (
            (folded_heads_need_uniform_q_len(api.gfx),) if self.persistent
            else (nonpersistent_fp8_heads,))
        path = "persistent" if self.persistent else "non-persistent"
        decode_refusal = (api.op_problem(Op.DECODE) if self.persistent
                          else api.problems.get("mla.mla_decode_fwd"))
        caps: dict[str, Capability] = {
            Op.DECODE: Capability(
                **decode_common, page_sizes=PAGE_SIZES_POW2, rules=decode_rules,
                refusal=decode_refusal,
                notes=f"{path} decode; heads padded to 16 (vLLM-style repeat for divisors of "
                      "16, zero heads otherwise); LSE only where the chip has an LSE kernel"),
            Op.SPARSE_DECODE: Capability(
                **decode_common, rules=decode_rules, refusal=decode_refusal,
                notes=f"{path} sparse decode over a page-size-1 view of the pool (global slots)"),
            Op.PAGED_PREFILL: Capability(
                q_formats=("bf16", "fp16", chip_fp8), kv_formats=("bf16", "fp16", chip_fp8),
                format_pairs=frozenset({("bf16", "bf16"), ("fp16", "fp16"), fp8_pair}),
                scale_policies=("unit", "amax"),
                layouts=(layouts.LINEAR.name, layouts.VECTORIZED.name),  # CK's two
                soft_cap=True, empty_requests=True, devices=self.devices,
                refusal=api.op_problem(Op.PAGED_PREFILL),
                reasons=PAGED_PREFILL_REASONS,
                notes="CK mha_batch_prefill_func, sglang-style page table"),
        }
        caps.update(aiter_pipeline.capabilities(self, api, decode_common, decode_rules))
        prefill_refusal = api.op_problem(Op.PREFILL)
        if api.gfx == "gfx942":
            prefill_refusal = ("AITER refuses FP8 persistent MLA prefill on gfx942 "
                               "('fp8 mla persistent prefill is not supported on gfx942', "
                               "csrc/py_itfs_cu/asm_mla.cu:1159-1160); gfx950 only")
        caps[Op.PREFILL] = Capability(
            q_formats=(chip_fp8,), kv_formats=(chip_fp8,), scale_policies=("unit", "amax"),
            head_counts=PREFILL_PS_HEADS, empty_requests=True, devices=self.devices,
            refusal=prefill_refusal,
            reasons=PREFILL_PS_REASONS,
            notes="FP8 ASM persistent-scheduling prefill (mla_prefill_ps_fwd), gfx950; "
                  "LSE checked only with ROCm/aiter#3606")
        return caps

    def run(self, case: Case, inputs: Inputs) -> Output:
        api = self._load()
        if isinstance(api, str):
            raise AdapterError(api)
        pipeline = functools.partial(aiter_pipeline.run, self)  # the V3.2 sparse path
        op_run = {Op.PREFILL: self._prefill_ps, Op.PAGED_PREFILL: self._paged_prefill,
                  Op.DECODE: self._decode, Op.SPARSE_DECODE: self._decode,
                  **dict.fromkeys(PIPELINE_OPS, pipeline)}[case.op]
        with pinned_environment(self.env):
            out = op_run(api, case, inputs)  # type: ignore[operator]
        out.metadata.setdefault("aiter", {}).update(
            version=api.version, gfx=api.gfx, module=self.api_module_name,
            env=dict(self.env))
        return out

    # -- loading
    def _load(self) -> AiterApi | str:
        if self._loaded is None:
            with pinned_environment(self.env):  # the model reads its chip from the environment
                self._loaded = load_api(self.api_module_name)
        return self._loaded

    def _call(self, api: AiterApi, qualname: str, **kwargs: Any) -> Any:
        """Call an installed function by keyword, with only keywords the signature check saw."""
        unchecked = set(kwargs) - set(CALLED_PARAMETERS[qualname])
        if unchecked:
            raise AdapterError(f"adapter bug: {qualname} called with unchecked {sorted(unchecked)}")
        return api.function(qualname)(**kwargs)

    # -- decode (dense and sparse)
    def head_padding_for(self, api: AiterApi, case: DecodeCase | SparseDecodeCase
                         ) -> HeadPadding:
        """Persistent: pad to a multiple of 16 (AITER folds 32..128). Non-persistent: to the
        smallest head count a non-persistent kernel exists for."""
        if self.persistent:
            return head_padding(case.num_heads)
        max_q = 1 if case.sparse else case.max_q_len  # sparse: each token a pseudo-request
        return head_padding(case.num_heads, nonpersistent_head_targets(
            api.gfx, fp8.fmt(case.quant.q).is_fp8, max_q))

    def page_table_for_decode(self, inputs: DecodeInputs
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """AITER's page table of the non-empty requests (the empty ones are left out of the
        call): page-level kv_indptr, physical page ids, last-page lengths."""
        return decode_page_table(inputs.case, inputs.table)

    def decode_schedule(self, case: DecodeCase | SparseDecodeCase,
                        inputs: DecodeInputs) -> DecodeSchedule:
        dev = inputs.device
        if case.sparse:
            return self.sparse_schedule(case, inputs)  # type: ignore[arg-type]
        page_table = self.page_table_for_decode(inputs)
        index = dense_decode_index(case, page_table)
        return DecodeSchedule(
            qo_indptr=index.qo_indptr.to(dev), kv_indptr=index.kv_indptr.to(dev),
            kv_indices=page_table[1].to(dev), kv_last_page_lens=index.kv_last_page_lens.to(dev),
            page_size=index.page_size, max_seqlen_q=index.max_seqlen_q,
            kv_buffer=inputs.pool.data)

    def sparse_schedule(self, case: SparseDecodeCase, inputs: DecodeInputs) -> DecodeSchedule:
        """Sparse top-k through the page table, each query token its own pseudo-request.

        AITER reads `min(kv_len, topk)` entries per pseudo-batch and allows -1 only beyond
        them, so valid entries go first (stable) and each token is a request of kv length =
        its own valid count (vLLM's sparse backend does the same). Entries are GLOBAL slots
        (page * page_size + offset) into a page-size-1 view of the pool, as in AITER's
        sparse test and vLLM. Persistent: kv_indices is the row-major [T, topk] table (the
        metadata advances each pseudo-batch by topk); non-persistent: the valid entries
        concatenated (ragged, indexed by kv_indptr).
        """
        assert inputs.topk_indices is not None
        dev = inputs.device
        total_q, topk = inputs.topk_indices.shape
        slots, counts = aiter_pipeline.global_slots(inputs.topk_indices, inputs.qo_indptr,
                                                    inputs.table)
        kv_indptr = torch.zeros(total_q + 1, dtype=torch.int64)
        kv_indptr[1:] = torch.cumsum(counts, 0)
        if self.persistent:
            kv_indices = slots.reshape(-1)
        else:
            kv_indices = slots[slots >= 0] if bool((slots >= 0).any()) else slots.new_zeros(1)
        i32 = torch.int32
        return DecodeSchedule(
            qo_indptr=torch.arange(total_q + 1, dtype=i32, device=dev),
            kv_indptr=kv_indptr.to(device=dev, dtype=i32),
            kv_indices=kv_indices.to(device=dev, dtype=i32).contiguous(),
            kv_last_page_lens=torch.ones(total_q, dtype=i32, device=dev),
            page_size=1, max_seqlen_q=1,
            kv_buffer=inputs.pool.data.view(-1, 1, *inputs.pool.data.shape[2:]),
            topk=topk)

    def _decode(self, api: AiterApi, case: DecodeCase | SparseDecodeCase,
                inputs: DecodeInputs) -> Output:
        sched = self.decode_schedule(case, inputs)
        padding = self.head_padding_for(api, case)
        q = padding.pad(inputs.q.stored)
        total_q = q.shape[0]
        target = inputs.out.out
        # A separate tensor object even when it is the guarded memory itself: for folded
        # MTP heads AITER repoints `o` at an unfolded copy (`o.set_(...)`), leaving the
        # memory it was given in the folded layout; the result is read from `o` afterwards.
        o = target.view(target.shape) if padding.identity else torch.empty(
            (total_q, padding.padded, target.shape[-1]), dtype=target.dtype, device=target.device)
        kwargs: dict[str, Any] = dict(
            q=q, kv_buffer=sched.kv_buffer, o=o, qo_indptr=sched.qo_indptr,
            kv_indptr=sched.kv_indptr, kv_indices=sched.kv_indices,
            kv_last_page_lens=sched.kv_last_page_lens, max_seqlen_q=sched.max_seqlen_q,
            page_size=sched.page_size, nhead_kv=1, sm_scale=case.softmax_scale, logit_cap=0.0,
            causal=True, return_lse=True)
        if fp8.fmt(case.quant.q).is_fp8:
            kwargs["q_scale"] = _scale_tensor(inputs.q.scale)
        if fp8.fmt(case.quant.kv).is_fp8:
            kwargs["kv_scale"] = _scale_tensor(inputs.pool.scale)
        meta: dict[str, Any] = {"head_padding": f"{padding.heads}->{padding.padded}"
                                + (f" (repeat x{padding.repeat})" if padding.repeat > 1 else "")}
        if case.has_empty and not case.sparse:  # sparse: every token its own pseudo-request
            meta["left_out"] = (f"{case.q_lengths.count(0)} empty requests (their qo_indptr "
                                "entries and pages)")
        if self.persistent:
            record = self.persistent_metadata(api, sched, padding.padded, q.dtype,
                                              sched.kv_buffer.dtype)
            bufs = record["buffers"]
            split_cap = record["max_split_per_batch"]
            kwargs.update(
                work_meta_data=bufs["work_metadata_ptrs"], work_indptr=bufs["work_indptr"],
                work_info_set=bufs["work_info_set"], reduce_indptr=bufs["reduce_indptr"],
                reduce_final_map=bufs["reduce_final_map"],
                reduce_partial_map=bufs["reduce_partial_map"],
                # explicit: AITER's persistent gate (bs >= 32 on gfx950 bf16 16 heads qlen 1)
                # only runs when num_kv_splits is None; here it is the reduce sizing hint.
                num_kv_splits=split_cap)
            meta["persistent"] = self._metadata_record(api, record, sched)
            meta["validation"], note = validate_persistent_metadata(meta["persistent"])
            if note:
                meta["validation_note"] = note
        else:
            splits = self.nonpersistent_kv_splits
            batch = sched.qo_indptr.numel() - 1
            kwargs.update(
                num_kv_splits=splits,
                # given with num_kv_splits so AITER's fp8 heuristic cannot cut it to 1 split
                num_kv_splits_indptr=torch.arange(0, (batch + 1) * splits, splits,
                                                  dtype=torch.int32, device=q.device))
            meta["path"] = f"non-persistent, {splits} kv splits"
        result = self._decode_call(api, kwargs, meta)
        lse = _decode_lse(result, total_q, padding.padded)
        if not padding.identity:
            target.copy_(padding.unpad(o))
        elif o.data_ptr() != target.data_ptr():  # repointed by AITER (folded MTP heads)
            meta["output_repointed"] = True
            target.copy_(o)
        if lse is not None:
            lse = padding.unpad(lse)
        return Output(target, lse, metadata=meta, wrote_into_guarded=True)

    def _decode_call(self, api: AiterApi, kwargs: dict[str, Any], meta: dict[str, Any]) -> Any:
        """mla_decode_fwd with return_lse=True; where the chip has no LSE variant of the
        selected kernel (AITER: 'cannot get heuristic kernel ... lse:1'), once more without
        LSE, noting it (the judge then reports the LSE as not checked)."""
        try:
            return self._call(api, "mla.mla_decode_fwd", **kwargs)
        except RuntimeError as e:
            text = str(e).replace(" ", "")
            if NO_KERNEL_MESSAGE.replace(" ", "") not in text or "lse:1" not in text:
                raise
            meta["lse"] = f"no LSE kernel for this configuration on {api.gfx}: LSE not checked"
            kwargs = {**kwargs, "return_lse": False}
            return self._call(api, "mla.mla_decode_fwd", **kwargs)

    # -- persistent metadata
    def metadata_split_cap(self, heads: int, batch: int, api: AiterApi) -> int:
        """max_split_per_batch for this adapter on the api's chip (metadata_split_cap)."""
        return metadata_split_cap(self.max_split_per_batch, heads, batch, api.cu_num)

    def persistent_metadata(self, api: AiterApi, sched: DecodeSchedule, heads: int,
                            q_dtype: torch.dtype, kv_dtype: torch.dtype) -> dict[str, Any]:
        """Size (info), (re)allocate if they must grow, and refill the six buffers."""
        sparse = sched.topk >= 0
        batch = sched.qo_indptr.numel() - 1
        split_cap = self.metadata_split_cap(heads, batch, api)
        sizes = self._call(
            api, "get_mla_metadata_info_v1", batch_size=batch, max_seqlen_qo=sched.max_seqlen_q,
            num_head_qo=heads, q_dtype=q_dtype, kv_dtype=kv_dtype, is_sparse=sparse,
            fast_mode=True, num_kv_splits=split_cap, intra_batch_mode=False,
            max_split_per_batch=split_cap)
        cache = self.metadata_buffers.setdefault("sparse" if sparse else "dense",
                                                 MetadataBuffers())
        bufs, grew = cache.ensure(list(sizes), sched.qo_indptr.device)
        fill_args = planner_args(sched, heads, q_dtype, kv_dtype, split_cap)
        self.fill_metadata(api, cache, bufs, grew, fill_args)
        return {"buffers": bufs, "sizes": [(tuple(_as_shape(s)), d) for s, d in sizes],
                "fill_args": fill_args, "max_split_per_batch": split_cap,
                "allocations": cache.allocations, "fills": cache.fills}

    def fill_metadata(self, api: AiterApi, cache: MetadataBuffers,
                      bufs: dict[str, torch.Tensor], grew: bool,
                      fill_args: dict[str, Any]) -> None:
        """get_mla_metadata_v1 into the cached buffers, on EVERY call (a reused buffer holds
        the previous batch's schedule: bug class 10). Note the keyword order trap:
        AITER's wrapper takes work_info_set BEFORE work_indptr."""
        self._call(api, "get_mla_metadata_v1", work_metadata_ptrs=bufs["work_metadata_ptrs"],
                   work_info_set=bufs["work_info_set"], work_indptr=bufs["work_indptr"],
                   reduce_indptr=bufs["reduce_indptr"], reduce_final_map=bufs["reduce_final_map"],
                   reduce_partial_map=bufs["reduce_partial_map"], **fill_args)
        cache.fills += 1

    def _metadata_record(self, api: AiterApi, record: dict[str, Any],
                         sched: DecodeSchedule) -> dict[str, Any]:
        """What the schedule validator (mlacheck.metadata) and the report get: CPU copies of
        the six buffers and of every input the schedule was computed from."""
        args = record["fill_args"]
        cpu: dict[str, Any] = {n: t.detach().cpu().clone() for n, t in record["buffers"].items()}
        cpu.update(
            qo_indptr=sched.qo_indptr.cpu(), kv_indptr=sched.kv_indptr.cpu(),
            kv_last_page_lens=sched.kv_last_page_lens.cpu(),
            kv_indices_len=int(sched.kv_indices.numel()), page_size=sched.page_size,
            kv_granularity=args["kv_granularity"], num_heads=args["num_heads_per_head_k"],
            num_heads_k=1, max_seqlen_qo=sched.max_seqlen_q, uni_seqlen_qo=args["uni_seqlen_qo"],
            topk=sched.topk, is_causal=True, max_split_per_batch=record["max_split_per_batch"],
            q_dtype=args["dtype_q_nope"], kv_dtype=args["dtype_kv_nope"], gfx=api.gfx,
            cu_num=api.cu_num, info_sizes=record["sizes"], allocations=record["allocations"],
            fills=record["fills"], experimental=self.env.get("AITER_ENABLE_EXPERIMENTAL") == "1",
            # AITER main's mla_reduce_v1 skips one-partial tiles; ROCm/aiter#3606 merges them
            reduce_single_partials=api.prefill_lse_fixed)
        return cpu

    # -- FP8 ASM prefill (persistent scheduling)
    def _prefill_ps(self, api: AiterApi, case: PrefillCase, inputs: PrefillInputs) -> Output:
        dev = inputs.device
        heads = case.num_heads
        q, k, v = inputs.q.stored, inputs.k.stored, inputs.v.stored
        # the empty segments (q_len 0) left out: the kept ones' cu_seqlens, their K/V rows
        # named through kv_page_indices (block size 1: a row is a page; no copy)
        units = nonempty_units(case.q_lengths)
        kept = [case.segments[s] for s in units]
        starts = inputs.cu_seqlens_k.cpu().tolist()
        qo_cpu = cu_seqlens([s.q_len for s in kept])
        kv_cpu = cu_seqlens([s.kv_len for s in kept])
        kv_rows = torch.cat([torch.arange(starts[u], starts[u + 1])
                             for u in units]).to(torch.int32)
        kv_lens = (kv_cpu[1:] - kv_cpu[:-1]).contiguous()
        segments = len(kept)
        max_q = max(s.q_len for s in kept)
        sizes = self._call(api, "get_ps_metadata_info_v1", batch_size=segments, num_head_k=heads,
                           max_qlen=max_q, qlen_granularity=PREFILL_PS_TILE_Q)
        bufs = {n: torch.empty(_as_shape(s), dtype=d, device=dev)
                for n, (s, d) in zip(METADATA_BUFFER_NAMES, sizes, strict=True)}
        # host-side planner: CPU int32 inputs (as vLLM and AITER's test pass them); K/V are
        # per-token "pages" (block size 1) and the segments' kv are contiguous in K / V.
        self._call(api, "get_ps_metadata_v1", seqlens_qo_indptr=qo_cpu, pages_kv_indptr=kv_cpu,
                   context_lens=kv_lens, gqa_ratio=1, num_heads_k=heads,
                   work_metadata_ptrs=bufs["work_metadata_ptrs"], work_indptr=bufs["work_indptr"],
                   work_info=bufs["work_info_set"], reduce_indptr=bufs["reduce_indptr"],
                   reduce_final_map=bufs["reduce_final_map"],
                   reduce_partial_map=bufs["reduce_partial_map"], qhead_granularity=1,
                   qlen_granularity=PREFILL_PS_TILE_Q,
                   kvlen_granularity=PREFILL_PS_KVLEN_GRANULARITY, block_size=1,
                   is_causal=case.causal)
        out = inputs.out.out
        result = self._call(
            api, "mla.mla_prefill_ps_fwd", Q=q.contiguous(), K=k.contiguous(), V=v.contiguous(),
            output=out, qo_indptr=qo_cpu.to(dev), kv_indptr=kv_cpu.to(dev),
            kv_page_indices=kv_rows.to(dev),
            work_indptr=bufs["work_indptr"], work_info_set=bufs["work_info_set"],
            max_seqlen_q=max_q, is_causal=case.causal, reduce_indptr=bufs["reduce_indptr"],
            reduce_final_map=bufs["reduce_final_map"],
            reduce_partial_map=bufs["reduce_partial_map"], softmax_scale=case.softmax_scale,
            q_scale=_scale_tensor(inputs.q.scale), k_scale=_scale_tensor(inputs.k.scale),
            v_scale=_scale_tensor(inputs.v.scale))
        record: dict[str, Any] = {n: t.detach().cpu().clone() for n, t in bufs.items()}
        record.update(
            qo_indptr=qo_cpu, kv_indptr=kv_cpu, context_lens=kv_lens, num_heads_k=heads,
            gqa_ratio=1, qhead_granularity=1, qlen_granularity=PREFILL_PS_TILE_Q, block_size=1,
            is_causal=case.causal, info_sizes=[(_as_shape(s), d) for s, d in sizes],
            kv_page_indices_len=int(kv_cpu[-1]), reduce_single_partials=api.prefill_lse_fixed)
        meta: dict[str, Any] = {"ps_prefill": record}
        if case.has_empty:
            meta["left_out"] = (f"{len(case.segments) - segments} empty segments: the kept "
                                "ones' cu_seqlens, their K/V rows as kv_page_indices")
        meta["validation"], note = validate_persistent_metadata(record, "validate_ps_metadata")
        if note:
            meta["validation_note"] = note
        lse = None
        if case.return_lse:
            returned = result[1] if isinstance(result, tuple) and len(result) > 1 else None
            if api.prefill_lse_fixed and returned is not None:
                lse = _normalise_lse(returned, out.shape[0], heads)
            else:
                meta["lse"] = ("mla_prefill_ps_fwd at AITER main returns the partial-LSE buffer "
                               "(ROCm/aiter#3606 not in this version): LSE not checked")
        return Output(out, lse, metadata=meta, wrote_into_guarded=True)

    # -- CK paged batch prefill
    def _paged_prefill(self, api: AiterApi, case: PrefillCase,
                       inputs: PrefillInputs) -> Output:
        assert inputs.k_pool is not None and inputs.v_pool is not None
        dev = inputs.device
        units = nonempty_units(case.q_lengths)  # the empty segments left out of the call
        kept = [case.segments[s] for s in units]
        # the K and V pools share one table
        kv_indptr, kv_pages, last = inputs.k_pool.table.of_requests(units).to_aiter()
        out = inputs.out.out
        kwargs: dict[str, Any] = dict(
            q=inputs.q.stored.contiguous(), k=inputs.k_pool.data, v=inputs.v_pool.data,
            cu_seqlens_q=cu_seqlens([s.q_len for s in kept]).to(device=dev),
            kv_indptr=kv_indptr.to(dev), kv_page_indices=kv_pages.to(dev),
            kv_last_page_lens=last.to(dev), max_seqlen_q=max(s.q_len for s in kept),
            max_seqlen_k=max(s.kv_len for s in kept), dropout_p=0.0,
            softmax_scale=case.softmax_scale, logits_soft_cap=float(case.soft_cap),
            causal=case.causal, window_size=(-1, -1), return_lse=case.return_lse, out=out)
        if fp8.fmt(case.quant.q).is_fp8:
            kwargs.update(q_descale=_scale_tensor(inputs.q.scale),
                          k_descale=_scale_tensor(inputs.k_pool.scale),
                          v_descale=_scale_tensor(inputs.v_pool.scale))
        result = self._call(api, "mha_batch_prefill_func", **kwargs)
        got, lse = (result[0], result[1]) if case.return_lse else (result, None)
        if got.data_ptr() != out.data_ptr():  # an implementation that ignored `out=`
            out.copy_(got)
        if lse is not None:  # CK returns [H, total_q]
            lse = _normalise_lse(lse, out.shape[0], case.num_heads, heads_first=True)
        meta = ({"left_out": f"{len(case.segments) - len(kept)} empty segments (their pages "
                             "and cu_seqlens entries)"} if case.has_empty else {})
        return Output(out, lse, metadata=meta, wrote_into_guarded=True)


# --------------------------------------------------------------------------- helpers


def _as_shape(shape: Any) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)


def _scale_tensor(scale: torch.Tensor) -> torch.Tensor:
    """A per-tensor dequantisation factor as AITER takes it: fp32 [1]."""
    if scale.numel() != 1:
        raise AdapterError("AITER takes per-tensor scales; got a scale of shape "
                           f"{tuple(scale.shape)}")
    return scale.reshape(1).to(torch.float32).contiguous()


def _normalise_lse(lse: torch.Tensor, total_q: int, heads: int, *,
                   heads_first: bool = False) -> torch.Tensor:
    """AITER's natural-log LSE as [T, H] fp32 (toolkit): decode and FP8 prefill return
    [T, H], [T, H, 1] or [T, 1, H, 1]; CK's batch prefill [H, T] (heads_first)."""
    try:
        return lse_tokens_heads(lse_natural(lse), total_q, heads, heads_first=heads_first)
    except ValueError as e:  # a shape the adapter does not know is the adapter's error
        raise AdapterError(f"AITER returned an unexpected LSE: {e}") from None


def _decode_lse(result: Any, total_q: int, heads: int) -> torch.Tensor | None:
    """mla_decode_fwd returns (logits, final_lse); final_lse None when not requested."""
    if not isinstance(result, tuple) or len(result) < 2 or result[1] is None:
        return None
    return _normalise_lse(result[1], total_q, heads)


def validate_persistent_metadata(record: Mapping[str, Any],
                                 validator_name: str = "validate_mla_metadata"
                                 ) -> tuple[list[str], str]:
    """(problems, note): what a schedule validator of mlacheck.backends.aiter.metadata (validate_mla_metadata
    for decode, validate_ps_metadata for the FP8 prefill) finds in the buffers AITER filled
    (the harness fails the case on any problem), and a note when no validator could be run
    (reported, not failed).

    The validator is called with the record entries its signature names, so the record may
    carry more than it needs.
    """
    try:
        from mlacheck.backends.aiter import metadata as metadata_module
    except ImportError:
        return [], "the schedule validators are not available: persistent schedule not validated"
    validator = getattr(metadata_module, validator_name, None)
    if validator is None:
        return [], f"no schedule validator {validator_name}: schedule not validated"
    params = inspect.signature(validator).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return list(validator(**record)), ""
    missing = [n for n, p in params.items()
               if p.default is inspect.Parameter.empty and n not in record
               and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    if missing:
        return [f"metadata validator needs {missing}, which the AITER adapter does not record"], ""
    return list(validator(**{n: record[n] for n in params if n in record})), ""


# --------------------------------------------------------------------------- factories


def factory() -> AiterAdapter:
    """`aiter`: the installed AITER, persistent decode."""
    return AiterAdapter(REAL_MODULE, persistent=True, name="aiter")


def nonpersistent_factory() -> AiterAdapter:
    """`aiter-nonpersistent`: the installed AITER, non-persistent (split-KV) decode."""
    return AiterAdapter(REAL_MODULE, persistent=False, name="aiter-nonpersistent")


def model_factory() -> AiterAdapter:
    """`aiter-model`: the same adapter over mlacheck's torch model of AITER's API (CPU), on
    the chip MLACHECK_AITER_MODEL_GFX names (gfx942 by default)."""
    return AiterAdapter(MODEL_MODULE, persistent=True, name="aiter-model",
                        devices=("cpu", "cuda"))


def _model_on(gfx: str) -> AiterAdapter:
    """The model pinned to one chip, whatever the environment says: gfx942 (MI300, fp8
    e4m3fnuz, no FP8 persistent prefill) and gfx950 (MI355, OCP e4m3fn, FP8 ASM prefill)
    cover different paths, so the embedded default runs both."""
    env = {**AITER_ENV_CONTROLS, MODEL_GFX_ENV: gfx}
    return AiterAdapter(MODEL_MODULE, persistent=True, name=f"aiter-model-{gfx}",
                        devices=("cpu", "cuda"), env=env)


def model_gfx942_factory() -> AiterAdapter:
    return _model_on("gfx942")


def model_gfx950_factory() -> AiterAdapter:
    return _model_on("gfx950")


def model_nonpersistent_factory() -> AiterAdapter:
    return AiterAdapter(MODEL_MODULE, persistent=False, name="aiter-model-nonpersistent",
                        devices=("cpu", "cuda"))


def folded_kv_offsets_wrong(case: DecodeCase, gfx: str | None = None) -> bool:
    """Whether the AITER model's v1.2 planner gives this case a split work whose kv_offset
    uses another request's last-page length (docs/gpu-results.md, finding 2). Plans what the
    adapter's persistent decode hands the planner (case_planner_args): no tensors beyond the
    index arrays. gfx None: the chip the environment selects."""
    from mlacheck.backends.aiter_model import chip_info, plan_decode_metadata

    if case.page_size == 1:
        return False
    # the environment the model's adapters pin for their calls (_model_on): AITER's controls
    # (AITER_ENABLE_EXPERIMENTAL changes the planner's head folding), then the chip
    env = {**AITER_ENV_CONTROLS, **({MODEL_GFX_ENV: gfx} if gfx else {})}
    with pinned_environment(env):
        chip = chip_info.get_gfx()
        chip_fp8 = fp8.fmt(fp8.chip_fp8_format(chip))
        q_fmt, kv_fmt = fp8.fmt(case.quant.q), fp8.fmt(case.quant.kv)
        if (q_fmt.is_fp8 and q_fmt.name != chip_fp8.name) or (
                kv_fmt.is_fp8 and kv_fmt.name != chip_fp8.name):
            return False  # the chip refuses the case: it never runs
        args = case_planner_args(case, chip_info.get_cu_num())
        heads, max_q = args["num_heads_per_head_k"], args["max_seqlen_qo"]
        if not aiter_folds_heads(chip, heads, max_q, q_fmt.is_fp8, kv_fmt.is_fp8):
            return False
        try:
            plan = plan_decode_metadata(
                args["seqlens_qo_indptr"], args["seqlens_kv_indptr"], args["kv_last_page_lens"],
                heads, args["num_heads_k"], args["is_causal"], page_size=args["page_size"],
                kv_granularity=args["kv_granularity"], max_seqlen_qo=max_q,
                uni_seqlen_qo=args["uni_seqlen_qo"], topk=args["topk"],
                max_split_per_batch=args["max_split_per_batch"], q_dtype=args["dtype_q_nope"],
                kv_dtype=args["dtype_kv_nope"])
        except Exception:  # a shape the planner refuses never runs: nothing to excuse
            return False
    page_ends = args["seqlens_kv_indptr"][1:].tolist()  # kv_indptr[r + 1], in pages
    last = args["kv_last_page_lens"].tolist()
    for row in plan.works:
        req, ke, koff = row[0] // plan.head_fold, row[5], row[6]
        end = page_ends[req]
        if ke != end and koff != (end - ke - 1) * case.page_size + last[req]:
            return True
    return False
