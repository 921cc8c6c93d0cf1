"""Decode-path faults: bug classes (mlacheck/bugclasses.py) 1 and 9.

decode-num-actual-tokens (class 1): in a mixed prefill + decode batch the decode kernel is
    launched over `num_actual_tokens` (prefill + decode) instead of the decode tokens. The
    rows past the decode tokens take their kv pages from the part of the index buffer this
    batch never wrote (page ids left there from before: free, poisoned pages) and their
    outputs land in the rows after the decode output (here: the guard rows).
mtp-metadata-qlen1 (class 9): multi-token (MTP) decode whose persistent metadata is sized and
    planned for q_len 1 (max_seqlen_qo = uni_seqlen_qo = 1, the plain-decode values) while
    the kernel runs the real q_len: right for q_len 1, wrong for q_len 2..4.
"""

from __future__ import annotations

from typing import Any

import torch

from mlacheck.backends.base import Backend, Output
from mlacheck.backends.faults._base import (
    AdapterFault,
    Wrapper,
    adapter,
    output_window,
    replace_inputs,
    resolve_inner,
    with_table,
)
from mlacheck.inputs import DecodeInputs, Inputs, Quantised, cu_seqlens
from mlacheck.kvcache import GUARD_ROWS, PageTable, free_pages
from mlacheck.spec import Case, Op, Request


class DecodeOverActualTokens(Wrapper):
    """Class 1: the decode kernel runs over the decode tokens plus `prefill_tokens` more."""

    ops = (Op.DECODE,)

    def __init__(self, inner: Backend, name: str, prefill_tokens: int = GUARD_ROWS) -> None:
        super().__init__(inner, name)
        self.prefill_tokens = prefill_tokens

    def run(self, case: Case, inputs: Inputs) -> Output:
        assert isinstance(inputs, DecodeInputs)
        n, extra = case.total_q, self.prefill_tokens
        pool, table = inputs.pool, inputs.table
        # Index entries this batch never wrote: what the buffer held before, page ids of pages
        # now free (poisoned); with no free page, the first live ones.
        stale = free_pages(pool)
        if stale.numel() == 0:
            stale = table.indices
        stale = stale.repeat(-(-extra // stale.numel()))[:extra]
        ps = table.page_size
        ext = PageTable(
            ps, torch.cat([table.indptr, table.indptr[-1] + torch.arange(1, extra + 1)]),
            torch.cat([table.indices, stale]),
            torch.cat([table.kv_lens, torch.full((extra,), ps, dtype=torch.int64)]))
        # the query rows after the decode tokens hold the prefill tokens' queries (finite)
        rows = torch.arange(extra) % n
        q = inputs.q
        scale = q.scale
        if scale.dim() and scale.shape[0] == n:  # per-token scales
            scale = torch.cat([scale, scale[rows.to(scale.device)]])
        q_ext = Quantised(torch.cat([q.stored, q.stored[rows.to(q.stored.device)]]), scale,
                          q.fmt, torch.cat([q.ideal, q.ideal[rows.to(q.ideal.device)]]))
        case_ext = case.with_units(case.units + (Request(1, ps),) * extra)
        seen = replace_inputs(
            inputs, case=case_ext, q=q_ext, pool=with_table(pool, ext),
            qo_indptr=cu_seqlens(list(case_ext.q_lengths)).to(inputs.device),
            out=output_window(inputs.out, 0, n + extra))
        res = self.inner.run(case_ext, seen)
        lse = None if res.lse is None else res.lse[:n]
        return Output(inputs.out.out, lse, metadata=res.metadata, wrote_into_guarded=True)


class MtpMetadataForQlen1(AdapterFault):
    """Class 9: get_mla_metadata_info_v1 / get_mla_metadata_v1 called with the q_len-1
    values (max_seqlen_qo = 1, uni_seqlen_qo = 1) for an MTP batch."""

    fault_ops = (Op.DECODE,)

    def rewrite(self, qualname: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        if qualname in ("get_mla_metadata_info_v1", "get_mla_metadata_v1"):
            kwargs["max_seqlen_qo"] = 1
        if qualname == "get_mla_metadata_v1":
            kwargs["uni_seqlen_qo"] = 1
        return kwargs


def decode_num_actual_tokens(inner: str = "aiter-model") -> DecodeOverActualTokens:
    return DecodeOverActualTokens(resolve_inner(inner), "fault:decode-num-actual-tokens")


def mtp_metadata_qlen1(inner: str = "aiter-model") -> AdapterFault:
    return adapter(MtpMetadataForQlen1, "fault:mtp-metadata-qlen1", inner)  # type: ignore[return-value]
