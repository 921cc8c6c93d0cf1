"""Model of `aiter.ops.triton.attention.fp8_mqa_logits` at AITER_COMMIT: the lightning
indexer's logits, prefill form (`_fp8_mqa_logits_kernel`, the non-gluon path).

Row i over key columns [cu_starts[i], cu_ends[i]) (clamped to [0, seq_len_kv)): the FP8
q . k products summed over the head dim (tl.dot, fp32 accumulation), times kv_scales[j],
ReLU, times weights[i, h], summed over heads. Columns outside the window: -inf when
clean_logits (the wrapper fills the buffer with -inf), else never written (the model leaves
NaN there: "whatever was in the output buffer"). On gfx942 OCP e4m3fn inputs are recast to
fnuz at half their value and the key scales doubled, exactly as the wrapper does (exact:
halving an e4m3fn value is an e4m3fnuz value).
"""

from __future__ import annotations

import torch

from mlacheck.backends.aiter_model.jit.utils.chip_info import get_gfx


def fp8_mqa_logits(Q, KV, kv_scales, weights, cu_starts, cu_ends, clean_logits=True):  # noqa: ANN001, ANN201, N803
    from mlacheck.backends.torch_pipeline import logits_rows

    seq_len, num_heads, head_size = Q.shape
    seq_len_kv = KV.shape[0]
    assert num_heads & (num_heads - 1) == 0, "num q. heads should be power of 2."
    assert head_size & (head_size - 1) == 0, "head size should be power of 2."
    scales = kv_scales.float()
    if get_gfx() == "gfx942":
        fnuz = torch.float8_e4m3fnuz
        mul = 1.0
        if Q.dtype != fnuz:
            Q, mul = (Q.to(torch.float32) * 0.5).to(fnuz), mul * 2.0
        if KV.dtype != fnuz:
            KV, mul = (KV.to(torch.float32) * 0.5).to(fnuz), mul * 2.0
        scales = scales * mul
    logits = logits_rows(Q, weights, KV, scales, cu_starts, cu_ends, seq_len_kv)
    if not clean_logits:
        col = torch.arange(seq_len_kv, device=logits.device)[None, :]
        start = cu_starts.long().clamp(min=0)[:, None].to(logits.device)
        end = cu_ends.long().clamp(max=seq_len_kv)[:, None].to(logits.device)
        logits = logits.masked_fill((col < start) | (col >= end), float("nan"))
    return logits
