"""Sparse-pipeline faults (DeepSeek-V3.2: indexer logits, top-k, index conversion, sparse
prefill, the composed path): bug classes 13-15 of mlacheck/bugclasses.py and class 2 across
the path. Each is the torch backend's own implementation (mlacheck.backends.torch_pipeline)
with one mechanism changed, as it would be changed in a kernel or its integration:

indexer-key-scale-ignored   keys used as stored FP8 values: the per-token scale never applied
indexer-key-scale-neighbour each key's scale read one token on (page layout: t+1's 4 bytes)
indexer-q-scale-twice       the q scale folded into the weights a second time
indexer-relu-dropped        sum_h w * (q . k) instead of sum_h w * ReLU(q . k)
indexer-window-off-by-one   each row's window end one too far (ke + 1 / visible + 1)
indexer-page-tail-read      the paged form reads each request's last page whole: its
                            (poisoned) tail becomes visible positions
indexer-mtp-full-context    MTP: every one of a request's next_n rows sees the whole context
                            (1-D context lens where the kernel needs [B, next_n])
topk-masked-chosen          rows that see fewer than k positions are filled with masked ones
                            (torch.topk over -inf) instead of -1
topk-not-localised          the prefill form returns batch-wide positions, not relative to the
                            row's window start
conversion-minus1-to-slot   -1 padding converted as position 0 (a valid-looking slot)
conversion-contiguous-base  slot = the request's first slot + position: right only while a
                            request's pages are contiguous (row-major and ragged)
conversion-ragged-indptr    a ragged buffer published with row-major offsets (t * topk)
sparse-prefill-minus1-slot0 the sparse prefill reads index -1 as row 0
sparse-prefill-max-logits-unscaled  max_logits returned without the softmax scale
pipeline-ragged-rowmajor    the path's converted indices written ragged, read row-major by the
                            attention (class 2 across the composed path)
pipeline-local-as-global    the attention handed request-local positions as global slots
                            (the conversion skipped)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mlacheck import sparse_index
from mlacheck.backends import torch_pipeline as tp
from mlacheck.backends.base import Output
from mlacheck.backends.faults._base import Wrapper, torch_only
from mlacheck.backends.torch_ref import TorchBackend, _written
from mlacheck.indexer_cache import IndexerKeys
from mlacheck.ops import Op
from mlacheck.spec import Case

INDEXER = (Op.MQA_LOGITS, Op.PAGED_MQA_LOGITS)


class _Stage(Wrapper):
    """A fault planted in the torch backend's sparse-pipeline code."""

    def __init__(self, name: str) -> None:
        super().__init__(TorchBackend(), name)

    @property
    def torch(self) -> TorchBackend:
        return self.inner  # type: ignore[return-value]


# --------------------------------------------------------------------------- indexer


class _IndexerFault(_Stage):
    ops = INDEXER

    def run(self, case: Case, inputs: Any) -> Output:
        if case.op == Op.MQA_LOGITS:
            return _written(inputs, self.prefill(inputs))
        return _written(inputs, self.paged(inputs))

    def prefill(self, inputs: Any) -> torch.Tensor:
        return tp.mqa_logits(inputs)

    def paged(self, inputs: Any) -> torch.Tensor:
        return tp.paged_mqa_logits(inputs)


def _with_scales(inputs: Any, scales: torch.Tensor) -> Any:
    keys = IndexerKeys(inputs.keys.values, scales, inputs.keys.fmt)
    return dataclasses.replace(inputs, keys=keys)


class KeyScaleIgnored(_IndexerFault):
    def prefill(self, inputs: Any) -> torch.Tensor:
        return tp.mqa_logits(_with_scales(inputs, torch.ones_like(inputs.keys.scales)))

    def paged(self, inputs: Any) -> torch.Tensor:
        values, scales = inputs.pool.halves()
        return tp.paged_mqa_logits(inputs, halves=(values, torch.ones_like(scales)))


class KeyScaleNeighbour(_IndexerFault):
    def prefill(self, inputs: Any) -> torch.Tensor:
        return tp.mqa_logits(_with_scales(inputs, inputs.keys.scales.roll(-1)))

    def paged(self, inputs: Any) -> torch.Tensor:
        values, scales = inputs.pool.halves()
        return tp.paged_mqa_logits(inputs, halves=(values, scales.reshape(-1).roll(-1)
                                                   .reshape(scales.shape)))


class QScaleTwice(_IndexerFault):
    def _twice(self, inputs: Any) -> Any:
        q = inputs.query
        return dataclasses.replace(inputs, query=dataclasses.replace(
            q, weights=q.weights * q.q_scale))

    def prefill(self, inputs: Any) -> torch.Tensor:
        return tp.mqa_logits(self._twice(inputs))

    def paged(self, inputs: Any) -> torch.Tensor:
        return tp.paged_mqa_logits(self._twice(inputs))


class ReluDropped(_IndexerFault):
    def prefill(self, inputs: Any) -> torch.Tensor:
        return tp.mqa_logits(inputs, tp.IndexerMath(relu=False))

    def paged(self, inputs: Any) -> torch.Tensor:
        return tp.paged_mqa_logits(inputs, math=tp.IndexerMath(relu=False))


class WindowOffByOne(_IndexerFault):
    def prefill(self, inputs: Any) -> torch.Tensor:
        return tp.mqa_logits(dataclasses.replace(inputs, k_end=inputs.k_end + 1))

    def paged(self, inputs: Any) -> torch.Tensor:
        return tp.paged_mqa_logits(inputs, visible=inputs.row_visible + 1)


class PageTailRead(_IndexerFault):
    ops = (Op.PAGED_MQA_LOGITS,)

    def paged(self, inputs: Any) -> torch.Tensor:
        ps = inputs.pool.page_size
        kv = inputs.context_lens.long().cpu()[inputs.row_request]
        tail = (kv + ps - 1) // ps * ps - kv
        return tp.paged_mqa_logits(inputs, visible=inputs.row_visible + tail)


class MtpFullContext(_IndexerFault):
    ops = (Op.PAGED_MQA_LOGITS,)

    def paged(self, inputs: Any) -> torch.Tensor:
        kv = inputs.context_lens.long().cpu()[inputs.row_request]
        return tp.paged_mqa_logits(inputs, visible=kv)


# --------------------------------------------------------------------------- top-k


class TopkMaskedChosen(_Stage):
    ops = (Op.TOPK,)

    def run(self, case: Case, inputs: Any) -> Output:
        sel = tp.topk(inputs)
        short = sel < 0
        if bool(short.any()):  # torch.topk's picks past the valid ones: masked positions
            width = max(case.kv_lengths)  # type: ignore[union-attr]
            fill = (inputs.lengths.long()[:, None]
                    + torch.arange(sel.shape[1], device=sel.device)[None, :]
                    - (~short).sum(1, keepdim=True))
            sel = torch.where(short & (fill < width), fill.to(sel.dtype), sel)
        return _written(inputs, sel)


class TopkNotLocalised(_Stage):
    ops = (Op.TOPK,)

    def run(self, case: Case, inputs: Any) -> Output:
        sel = tp.topk(inputs)
        if case.form == "prefill":  # type: ignore[union-attr]
            sel = torch.where(sel >= 0, sel + inputs.k_start[:, None].to(sel.dtype), sel)
        return _written(inputs, sel)


# --------------------------------------------------------------------------- conversion


class ConversionMinus1ToSlot(_Stage):
    ops = (Op.INDEX_CONVERSION,)

    def run(self, case: Case, inputs: Any) -> Output:
        return self.torch.run(case, dataclasses.replace(inputs, local=inputs.local.clamp(min=0)))


class ConversionContiguousBase(_Stage):
    ops = (Op.INDEX_CONVERSION,)

    def run(self, case: Case, inputs: Any) -> Output:
        ps = case.page_size  # type: ignore[union-attr]
        qo = inputs.qo_indptr.long().cpu()
        req = torch.repeat_interleave(torch.arange(qo.numel() - 1), qo[1:] - qo[:-1])
        first = inputs.block_table.long().cpu()[req, 0] * ps
        local = inputs.local.long().cpu()
        slots = torch.where(local >= 0, first[:, None] + local, torch.full_like(local, -1))
        if case.index_layout == "row_major":  # type: ignore[union-attr]
            return _written(inputs, slots.to(torch.int32))
        # ragged (AITER's only form): the same wrong slots, packed as the torch backend packs
        # the right ones (the -1 entries, and so the indptr, are unchanged)
        res = self.torch.run(case, inputs)
        flat = sparse_index.to_ragged(slots).flat
        inputs.out.out[: flat.numel()] = flat.to(inputs.out.out.dtype).to(inputs.out.out.device)
        return res


class ConversionRaggedIndptr(_Stage):
    ops = (Op.INDEX_CONVERSION,)

    def run(self, case: Case, inputs: Any) -> Output:
        res = self.torch.run(case, inputs)
        if "indptr" in res.extra:
            t = res.extra["indptr"].numel() - 1
            res.extra["indptr"] = (torch.arange(t + 1) * case.topk).to(torch.int32)  # type: ignore[union-attr]
        return res


# --------------------------------------------------------------------------- sparse prefill


class SparsePrefillMinus1Slot0(_Stage):
    ops = (Op.SPARSE_PREFILL,)

    def run(self, case: Case, inputs: Any) -> Output:
        res = self.torch.run(case, dataclasses.replace(inputs, indices=inputs.indices.clamp(min=0)))
        return res


class SparsePrefillMaxLogitsUnscaled(_Stage):
    ops = (Op.SPARSE_PREFILL,)

    def run(self, case: Case, inputs: Any) -> Output:
        res = self.torch.run(case, inputs)
        res.extra["max_logits"] = res.extra["max_logits"] / case.softmax_scale
        return res


# --------------------------------------------------------------------------- composed path


class _PipelineFault(_Stage):
    ops = (Op.SPARSE_PIPELINE,)

    def run(self, case: Case, inputs: Any) -> Output:
        local, slots = tp.pipeline_selection(inputs)
        used = self.attended(inputs, local, slots)
        out, lse = tp.slots_attention(inputs, used, self.torch.numerics)
        res = _written(inputs, out)
        res.lse, res.extra["slots"] = lse, used
        return res

    def attended(self, inputs: Any, local: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return slots


class PipelineRaggedRowMajor(_PipelineFault):
    def attended(self, inputs: Any, local: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        flat = slots[slots >= 0]  # written ragged: each token's valid slots back to back
        buf = torch.full((slots.numel(),), -1, dtype=slots.dtype, device=slots.device)
        buf[: flat.numel()] = flat
        return buf.view(slots.shape)  # read row-major: token t at t * topk


class PipelineLocalAsGlobal(_PipelineFault):
    def attended(self, inputs: Any, local: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return local.to(slots.dtype).to(slots.device)


# --------------------------------------------------------------------------- factories


def _make(cls: type[_Stage], name: str, inner: str) -> _Stage:
    torch_only(inner, name)
    return cls(f"fault:{name}")


def indexer_key_scale_ignored(inner: str = "torch") -> _Stage:
    return _make(KeyScaleIgnored, "indexer-key-scale-ignored", inner)


def indexer_key_scale_neighbour(inner: str = "torch") -> _Stage:
    return _make(KeyScaleNeighbour, "indexer-key-scale-neighbour", inner)


def indexer_q_scale_twice(inner: str = "torch") -> _Stage:
    return _make(QScaleTwice, "indexer-q-scale-twice", inner)


def indexer_relu_dropped(inner: str = "torch") -> _Stage:
    return _make(ReluDropped, "indexer-relu-dropped", inner)


def indexer_window_off_by_one(inner: str = "torch") -> _Stage:
    return _make(WindowOffByOne, "indexer-window-off-by-one", inner)


def indexer_page_tail_read(inner: str = "torch") -> _Stage:
    return _make(PageTailRead, "indexer-page-tail-read", inner)


def indexer_mtp_full_context(inner: str = "torch") -> _Stage:
    return _make(MtpFullContext, "indexer-mtp-full-context", inner)


def topk_masked_chosen(inner: str = "torch") -> _Stage:
    return _make(TopkMaskedChosen, "topk-masked-chosen", inner)


def topk_not_localised(inner: str = "torch") -> _Stage:
    return _make(TopkNotLocalised, "topk-not-localised", inner)


def conversion_minus1_to_slot(inner: str = "torch") -> _Stage:
    return _make(ConversionMinus1ToSlot, "conversion-minus1-to-slot", inner)


def conversion_contiguous_base(inner: str = "torch") -> _Stage:
    return _make(ConversionContiguousBase, "conversion-contiguous-base", inner)


def conversion_ragged_indptr(inner: str = "torch") -> _Stage:
    return _make(ConversionRaggedIndptr, "conversion-ragged-indptr", inner)


def sparse_prefill_minus1_slot0(inner: str = "torch") -> _Stage:
    return _make(SparsePrefillMinus1Slot0, "sparse-prefill-minus1-slot0", inner)


def sparse_prefill_max_logits_unscaled(inner: str = "torch") -> _Stage:
    return _make(SparsePrefillMaxLogitsUnscaled, "sparse-prefill-max-logits-unscaled", inner)


def pipeline_ragged_rowmajor(inner: str = "torch") -> _Stage:
    return _make(PipelineRaggedRowMajor, "pipeline-ragged-rowmajor", inner)


def pipeline_local_as_global(inner: str = "torch") -> _Stage:
    return _make(PipelineLocalAsGlobal, "pipeline-local-as-global", inner)

