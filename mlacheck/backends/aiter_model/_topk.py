"""Model of `aiter.ops.topk`'s per-row top-k at AITER_COMMIT (csrc/kernels/
topk_per_row_kernels.cu): the top-k of the DeepSeek-V3.2 indexer's logits.

top_k_per_row_prefill: row r reads logits[r, rowStarts[r]:rowEnds[r]] and writes k indices
(into `indices[r]`) of its largest values AS POSITIONS OF THE WHOLE ROW (i + rowStart: vLLM
localises them afterwards); a row with at most k positions writes all of them in order,
then -1. top_k_per_row_decode: row r reads positions [0, seqLens[r // next_n] - next_n +
r % next_n + 1). Which of several equal values is taken is the kernel's business (the model
takes the lowest position, as `stable=True` documents); the output order is not specified
(the model writes ascending positions).
"""

from __future__ import annotations

import torch


def _write(logits: torch.Tensor, starts: list[int], ends: list[int], indices: torch.Tensor,
           values: torch.Tensor | None, num_rows: int, stride0: int, stride1: int,
           k: int) -> None:
    rows = logits.as_strided((num_rows, stride0 // max(1, stride1)), (stride0, stride1))
    for r in range(num_rows):
        a, b = starts[r], ends[r]
        out = torch.full((k,), -1, dtype=indices.dtype)
        if b - a <= k:
            out[: max(0, b - a)] = torch.arange(a, max(a, b), dtype=indices.dtype)
        else:
            seg = rows[r, a:b].float().cpu()
            order = torch.sort(seg, descending=True, stable=True).indices[:k]
            out[:] = (order.sort().values + a).to(indices.dtype)
        indices[r] = out.to(indices.device)
        if values is not None:
            valid = out >= 0
            values[r] = torch.where(valid.to(values.device),
                                    rows[r, out.clamp(min=0).to(rows.device)].to(values.dtype),
                                    torch.zeros(k, dtype=values.dtype, device=values.device))


def top_k_per_row_prefill(logits, rowStarts, rowEnds, indices, values, numRows, stride0,  # noqa: ANN001, ANN201, N803
                          stride1, k=2048, stable=False):
    _write(logits, rowStarts.long().tolist(), rowEnds.long().tolist(), indices, values,
           int(numRows), int(stride0), int(stride1), int(k))


def top_k_per_row_decode(logits, next_n, seqLens, indices, numRows, stride0, stride1,  # noqa: ANN001, ANN201, N803
                         k=2048, stable=False):
    lens = seqLens.long().tolist()
    ends = [lens[r // next_n] - next_n + r % next_n + 1 for r in range(int(numRows))]
    _write(logits, [0] * int(numRows), ends, indices, None, int(numRows), int(stride0),
           int(stride1), int(k))
