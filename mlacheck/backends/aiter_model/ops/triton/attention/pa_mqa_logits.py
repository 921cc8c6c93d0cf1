"""Model of `aiter.ops.triton.attention.pa_mqa_logits` at AITER_COMMIT:
`deepgemm_fp8_paged_mqa_logits`, the lightning indexer's logits over a paged FP8 key cache
(the non-gluon `_deepgemm_fp8_paged_mqa_logits` path; Preshuffle needs the gluon kernel).

kv_cache [blocks, KVBlockSize, 1, D + 4] uint8, each block its FP8 values then its FP32
scales; kv_indices [B, max_blocks] the block table; context_lens [B] (one per request);
q_fp8 [B, next_n, H, D]; weights [B * next_n, H]. Row (b, j) writes, for every position p
of the ChunkK-wide chunks covering [0, context_lens[b]) and p < max_model_len: the logit
(sum_h w ReLU(q . k_p * scale_p)) where p <= context_lens[b] - next_n + j, -inf elsewhere;
columns past the last chunk are never written (the caller initialises out_logits).
"""

from __future__ import annotations

import torch

from mlacheck import fp8


def deepgemm_fp8_paged_mqa_logits(q_fp8, kv_cache, weights, out_logits, context_lens,  # noqa: ANN001, ANN201, PLR0913
                                  kv_indices, max_model_len, Preshuffle=False,  # noqa: N803
                                  KVBlockSize=1, ChunkK=256, TotalCuCount=None,  # noqa: N803
                                  WavePerEU=2, VarCtxSchedule=None):  # noqa: N803
    from mlacheck.backends.aiter_model.dtypes import chip_fp8
    from mlacheck.backends.torch_pipeline import logits_rows

    batch, next_n, heads, dim = q_fp8.shape
    _, block_size, _, index_dim = kv_cache.shape
    assert ChunkK % KVBlockSize == 0 or KVBlockSize % ChunkK == 0
    assert block_size == KVBlockSize
    assert not Preshuffle, "Preshuffle mode is only supported on gluon kernel."
    flat = kv_cache.reshape(-1, KVBlockSize * index_dim)
    values = flat[:, : KVBlockSize * dim].view(chip_fp8()).reshape(-1, KVBlockSize, dim)
    scales = flat[:, KVBlockSize * dim:].view(torch.float32)
    table = kv_indices.long().cpu()
    lens = context_lens.long().cpu().reshape(-1)
    for b in range(batch):
        n = int(lens[b])
        if n <= 0:
            continue
        written = min(-(-n // ChunkK) * ChunkK, int(max_model_len))
        pages = table[b, : -(-n // KVBlockSize)].to(values.device)
        k = fp8.select_rows(values, pages).reshape(-1, dim)[:n]
        s = scales.index_select(0, pages).reshape(-1)[:n]
        rows = torch.arange(b * next_n, (b + 1) * next_n, device=out_logits.device)
        visible = torch.tensor([n - next_n + j + 1 for j in range(next_n)])
        got = logits_rows(q_fp8[b], weights[rows], k, s, torch.zeros_like(visible), visible,
                          written)
        out_logits[rows, :written] = got
    return None
