"""Model of `aiter.ops.triton._triton_kernels.attention.sparse_attention_dsv4` at AITER_COMMIT:
the DeepSeek-V4 positions -> global slots kernels (:64-129), the ones AITER's
`compute_global_topk_ragged_indices_and_indptr` launches (deleted from AITER main with its
file by ROCm/aiter 8fbed79; the kernels stay):

- `_compute_topk_lens_kernel` (:64-87): per token the count of its `topk` entries >= 0, 0 for
  a token whose `is_valid_token` is False.
- `_pack_global_topk_ragged_kernel` (:90-129): for token t, the first
  `min(indptr[t + 1] - indptr[t], topk)` entries p of its row ->
  `block_table[req, p // block_size] * block_size + p % block_size` (req =
  `token_to_req_indices[t]`), -1 where p < 0, stored from `indptr[t]`. It copies a PREFIX of
  the row: valid positions after a -1 are not skipped over.

Launched as Triton kernels are, `kernel[grid](...)`; `fn` is the Python function (what the
adapters' signature checks read). The grid is not needed: each model does every program's work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class _Kernel:
    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return self.fn


def _rows(ptr: torch.Tensor, stride: int, rows: int, width: int) -> torch.Tensor:
    """What a kernel reads at ptr + row * stride + col (col < width)."""
    return ptr.as_strided((rows, width), (stride, 1))


def compute_topk_lens(topk_lens_ptr, topk_indices_ptr, topk_indices_stride, topk,  # noqa: ANN001, ANN201
                      is_valid_token_ptr, TRITON_BLOCK_SIZE):  # noqa: N803
    rows = _rows(topk_indices_ptr, topk_indices_stride, topk_lens_ptr.numel(), topk)
    count = (rows >= 0).sum(1).to(torch.int32)
    topk_lens_ptr.copy_(torch.where(is_valid_token_ptr.bool(), count, 0))


def pack_global_topk_ragged(global_topk_ragged_ptr, topk_indptr_ptr, topk_indices_ptr,  # noqa: ANN001, ANN201, PLR0913
                            topk_indices_stride, token_to_req_indices_ptr, block_table_ptr,
                            block_table_stride, block_size, topk, BLOCK_SIZE):  # noqa: N803
    tokens = topk_indptr_ptr.numel() - 1
    rows = _rows(topk_indices_ptr, topk_indices_stride, tokens, topk).long()
    table = block_table_ptr.reshape(-1).long()
    indptr = topk_indptr_ptr.long().tolist()
    reqs = token_to_req_indices_ptr.long().tolist()
    for t in range(tokens):
        start, end = indptr[t], indptr[t + 1]
        local = rows[t, : max(0, min(end - start, topk))]
        valid = local >= 0
        pages = table[(reqs[t] * block_table_stride + local // block_size).clamp(min=0)]
        slots = torch.where(valid, pages * block_size + local % block_size, -1)
        global_topk_ragged_ptr[start: start + local.numel()] = slots.to(
            global_topk_ragged_ptr.dtype)


_compute_topk_lens_kernel = _Kernel(compute_topk_lens)
_pack_global_topk_ragged_kernel = _Kernel(pack_global_topk_ragged)
