"""The composed DeepSeek-V3.2 sparse path in FP32/FP64: logits -> top-k -> slots -> attention.

A pipeline under test selects with its own (rounded) logits, so its selection may differ
from the reference one wherever golden logits are near-ties (golden.topk says which
differences are allowed). Its attention output is then compared with the golden attention
on the GOLDEN selection, allowing per row the distance between the golden attention on the
two selections (`selection_allowance`): by the triangle inequality a correct pipeline is
within (attention bound + that allowance), and the allowance is exactly 0 on rows where the
two selections agree. A selection that is not a tie-consistent top-k fails on its own
(golden.topk), so the allowance never excuses a wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import fp8, sparse_index
from mlacheck.golden.core import Operand
from mlacheck.golden.sparse import SparseResult, sparse_attention
from mlacheck.golden.topk import reference_topk


def local_rows(logits: torch.Tensor, k_start: torch.Tensor, width: int) -> torch.Tensor:
    """Prefill-form logits [T, S] over a batch's keys laid end to end -> request-local logits
    [T, width]: row t shifted left by k_start[t] (its request's first key), -inf past S.
    What vLLM's prefill top-k returns positions relative to ("localize")."""
    rows, s_total = logits.shape
    col = k_start.long().to(logits.device)[:, None] + torch.arange(width, device=logits.device)
    inside = col < s_total
    got = logits.gather(1, col.clamp(max=max(0, s_total - 1)))
    return torch.where(inside, got, torch.full_like(got, float("-inf")))


@dataclass
class PipelineReference:
    selection: torch.Tensor  # [T, k] request-local positions, -1 padded (reference_topk)
    slots: torch.Tensor  # [T, k] global slots of the same, -1 kept
    attention: SparseResult  # golden sparse attention on those slots


def reference(
    local_logits: torch.Tensor, k: int, token_request: torch.Tensor, block_table: torch.Tensor,
    page_size: int, kv_lens: torch.Tensor, q: torch.Tensor | Operand,
    kv_slots: torch.Tensor | Operand, scale: float, dv: int, dtype: torch.dtype = torch.float32,
) -> PipelineReference:
    """Golden selection of `local_logits` [T, W] (request-local, -inf masked), converted to
    global slots through the block table, and the golden sparse attention of q [T, H, D] over
    the pool viewed as rows of slots kv_slots [pages * page_size, D]."""
    selection = reference_topk(local_logits, k)
    slots = sparse_index.to_global_slots(selection, token_request, block_table, page_size,
                                         kv_lens)
    return PipelineReference(selection, slots,
                             sparse_attention(q, kv_slots, slots, scale, dv, dtype))


def selection_allowance(
    q: torch.Tensor | Operand, kv_slots: torch.Tensor | Operand, golden_slots: torch.Tensor,
    kernel_slots: torch.Tensor, scale: float, dv: int, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, SparseResult | None]:
    """(rows whose selections differ [n], the golden attention on the kernel's selection for
    exactly those rows, or None when every row agrees). The judge measures the allowance as
    its own row distance between this and the golden attention on the golden selection."""
    differ = torch.nonzero(~sparse_index.same_sets(golden_slots.cpu(), kernel_slots.cpu()))
    rows = differ.flatten()
    if rows.numel() == 0:
        return rows, None
    qo = q if isinstance(q, Operand) else Operand(q)
    dev = qo.data.device
    sub = qo.view(lambda x: fp8.select_rows(x, rows))
    return rows, sparse_attention(sub, kv_slots, kernel_slots[rows.to(kernel_slots.device)]
                                  .to(dev), scale, dv, dtype)
