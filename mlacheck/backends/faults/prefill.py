"""Prefill faults: bug classes (mlacheck/bugclasses.py) 4 and 8.

multiseg-as-one (class 4): a multi-segment varlen batch (several prefill requests packed in
    one forward by chunked prefill) handled as ONE segment: cu_seqlens collapsed to
    [0, total], so every query attends across its neighbours' tokens. Right for one segment.
multiseg-first-only (class 4): only the first segment is computed; the other segments'
    output rows keep what the buffer held (and their LSE is never written).
context-chunk-lse (class 8): chunked prefill computed as a context chunk (non-causal, over the
    cached tokens) plus the segment's own chunk (causal), merged by LSE, where the context
    kernel returns its LSE in base 2: the merge weights are wrong, so the output is wrong
    exactly when a segment has context (context_len > 0).
"""

from __future__ import annotations

import math

import torch

from mlacheck.backends.base import Capability, Output
from mlacheck.backends.faults._base import (
    Wrapper,
    output_window,
    replace_inputs,
    resolve_inner,
    restrict,
    torch_only,
)
from mlacheck.backends.numerics import flash_attend, merge_partials, p_format_for
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.inputs import Inputs, PrefillInputs
from mlacheck.spec import Case, Op, Segment

UNPAGED = (Op.PREFILL,)
PREFILL_OPS = (Op.PREFILL, Op.PAGED_PREFILL)


class MultiSegmentAsOne(Wrapper):
    """Class 4: cu_seqlens_q / cu_seqlens_k collapsed to one segment."""

    ops = UNPAGED

    def run(self, case: Case, inputs: Inputs) -> Output:
        assert isinstance(inputs, PrefillInputs)
        tq, tk = case.total_q, case.total_kv
        one = case.with_units((Segment(tq, tk - tq),))
        dev = inputs.device
        seen = replace_inputs(inputs, case=one,
                              cu_seqlens_q=torch.tensor([0, tq], dtype=torch.int32, device=dev),
                              cu_seqlens_k=torch.tensor([0, tk], dtype=torch.int32, device=dev))
        res = self.inner.run(one, seen)
        res.metadata["fault"] = f"{len(case.units)} segments run as one"
        return res


class MultiSegmentFirstOnly(Wrapper):
    """Class 4: only the first segment is launched."""

    ops = UNPAGED

    def run(self, case: Case, inputs: Inputs) -> Output:
        assert isinstance(inputs, PrefillInputs)
        n = case.q_lengths[0]
        # the LSE buffer's other rows are never written
        lse = torch.full((case.total_q, case.num_heads), float("nan"), device=inputs.device)
        if n == 0:  # an empty first segment: the one launch has no rows, nothing is written
            return Output(inputs.out.out, lse, wrote_into_guarded=True)
        first = case.with_units(case.units[:1])
        seen = replace_inputs(inputs, case=first, cu_seqlens_q=inputs.cu_seqlens_q[:2],
                              cu_seqlens_k=inputs.cu_seqlens_k[:2],
                              out=output_window(inputs.out, 0, n))
        res = self.inner.run(first, seen)
        if res.lse is None:
            return Output(inputs.out.out, None, metadata=res.metadata, wrote_into_guarded=True)
        lse[:n] = res.lse
        return Output(inputs.out.out, lse, metadata=res.metadata, wrote_into_guarded=True)


class ContextChunkLseBase2(TorchBackend):
    """Class 8: context chunk (non-causal) + own chunk (causal) merged by LSE, with the context
    kernel's LSE in base 2."""

    def capabilities(self) -> dict[str, Capability]:
        return restrict(super().capabilities(), PREFILL_OPS)

    def _prefill(self, inputs: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor]:
        from mlacheck.golden.prefill import kv_tensors

        case = inputs.case
        ks, vs = kv_tensors(inputs, "exact")
        q = inputs.q.dequant()
        qc = inputs.cu_seqlens_q.tolist()
        pf = p_format_for(case.quant.kv, self.numerics)
        scale, nm, cap = case.softmax_scale, self.numerics, case.soft_cap
        outs, lses = [], []
        for i, seg in enumerate(case.segments):
            qi, ctx = q[qc[i] : qc[i + 1]], seg.context_len
            own = flash_attend(qi, ks[i][ctx:], vs[i][ctx:], scale, case.causal, pf, nm, cap)
            if ctx == 0:
                outs.append(own[0])
                lses.append(own[1])
                continue
            o_ctx, lse_ctx = flash_attend(qi, ks[i][:ctx], vs[i][:ctx], scale, False, pf, nm, cap)
            lse_ctx = lse_ctx / math.log(2.0)  # the bug: the context kernel's LSE is log2
            o, lse = merge_partials(torch.stack([o_ctx, own[0]]), torch.stack([lse_ctx, own[1]]))
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


def multiseg_as_one(inner: str = "torch") -> MultiSegmentAsOne:
    return MultiSegmentAsOne(resolve_inner(inner), "fault:multiseg-as-one")


def multiseg_first_only(inner: str = "torch") -> MultiSegmentFirstOnly:
    return MultiSegmentFirstOnly(resolve_inner(inner), "fault:multiseg-first-only")


def context_chunk_lse(inner: str = "torch") -> ContextChunkLseBase2:
    torch_only(inner, "context-chunk-lse")
    return ContextChunkLseBase2(name="fault:context-chunk-lse")
