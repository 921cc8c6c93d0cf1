"""Prefill reference (MHA form): ragged segments, each attending to its context plus itself."""

from __future__ import annotations

import torch

from mlacheck.golden.core import Result, attend
from mlacheck.inputs import PrefillInputs


def kv_tensors(inputs: PrefillInputs, variant: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per segment K [kv_len, H, 192] and V [kv_len, H, 128] in fp32.

    exact: dequantised from what the kernel received (through the paged pools and their
    page table when paged); ideal: the unquantised originals.
    """
    segs = inputs.case.segments
    cuts = inputs.cu_seqlens_k.tolist()
    if variant == "ideal":
        src_k, src_v = inputs.k.ideal, inputs.v.ideal
    elif inputs.k_pool is not None and inputs.v_pool is not None:
        return (
            [inputs.k_pool.gather(i) for i in range(len(segs))],
            [inputs.v_pool.gather(i) for i in range(len(segs))],
        )
    else:
        src_k, src_v = inputs.k.dequant(), inputs.v.dequant()
    ks = [src_k[cuts[i] : cuts[i + 1]] for i in range(len(segs))]
    vs = [src_v[cuts[i] : cuts[i + 1]] for i in range(len(segs))]
    return ks, vs


def reference(inputs: PrefillInputs, variant: str = "exact", dtype: torch.dtype = torch.float32) -> Result:
    case = inputs.case
    q_all = inputs.q.ideal if variant == "ideal" else inputs.q.dequant()
    ks, vs = kv_tensors(inputs, variant)
    qc = inputs.cu_seqlens_q.tolist()
    outs, lses = [], []
    for i, _seg in enumerate(case.segments):
        r = attend(
            q_all[qc[i] : qc[i + 1]].to(dtype), ks[i].to(dtype), vs[i].to(dtype),
            case.softmax_scale, case.causal, case.soft_cap,
        )
        outs.append(r.out)
        lses.append(r.lse)
    return Result(torch.cat(outs), torch.cat(lses))
