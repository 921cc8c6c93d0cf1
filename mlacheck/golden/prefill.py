"""Prefill reference (MHA form): ragged segments, each attending to its context plus itself."""

from __future__ import annotations

import torch

from mlacheck.golden.core import Operand, Result, attend_each, concat, per_tensor
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


def operands(inputs: PrefillInputs, variant: str) -> tuple[list[Operand], list[Operand], list[Operand]]:
    """Per segment q, K, V as stored + scale (converted block by block inside attend).

    exact: what the kernel received (through the paged pools and their page table when
    paged); ideal: the unquantised originals.
    """
    n = len(inputs.case.segments)
    qc, kc = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()

    def segs(op: Operand, cuts: list[int]) -> list[Operand]:
        return [op.view(lambda x, a=cuts[i], b=cuts[i + 1]: x[a:b]) for i in range(n)]

    if variant == "ideal":
        return (segs(Operand(inputs.q.ideal), qc), segs(Operand(inputs.k.ideal), kc),
                segs(Operand(inputs.v.ideal), kc))
    qs = segs(Operand(inputs.q.stored, per_tensor(inputs.q.scale)), qc)
    if inputs.k_pool is not None and inputs.v_pool is not None:
        kp, vp = inputs.k_pool, inputs.v_pool
        ks, vs = per_tensor(kp.scale), per_tensor(vp.scale)
        return (qs, [Operand(kp.gather(i, dequant=False), ks) for i in range(n)],
                [Operand(vp.gather(i, dequant=False), vs) for i in range(n)])
    return (qs, segs(Operand(inputs.k.stored, per_tensor(inputs.k.scale)), kc),
            segs(Operand(inputs.v.stored, per_tensor(inputs.v.scale)), kc))


def reference(inputs: PrefillInputs, variant: str = "exact", dtype: torch.dtype = torch.float32) -> Result:
    case = inputs.case
    qs, ks, vs = operands(inputs, variant)
    return concat(attend_each(list(zip(qs, ks, vs, strict=True)), case.softmax_scale,
                              case.causal, case.soft_cap, dtype=dtype))
