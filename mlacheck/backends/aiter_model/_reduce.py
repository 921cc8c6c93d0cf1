"""Model of `aiter.mla_reduce_v1` (csrc/kernels/mla/reduce.cu, HEAD 9-argument form).

For reduce tile t with n = reduce_indptr[t+1] - reduce_indptr[t] partials starting at rows
p_k = reduce_partial_map[reduce_indptr[t] + k], output rows [q_start, q_end) =
reduce_final_map[t] (or [t*len, (t+1)*len) with len = p_1 - p_0 when the map is None):
    lse* = max_k lse_k + log(sum_k exp(lse_k - max)),  out = sum_k exp(lse_k - lse*) o_k
reading partial row p_k + (s - q_start). NaN partial LSEs count as -inf and NaN partial
outputs as 0 (AITER's torch reference); a row whose partials all have LSE -inf gets output
0 and LSE +inf (the kernel writes INFINITY when the sum is 0 or NaN).

At AITER main the kernel skips tiles with n <= 1 (their rows and final LSE stay unwritten);
with MLACHECK_AITER_MODEL_REVISION=pr3606 (ROCm/aiter#3606) tiles with n == 1 are reduced too.
"""

from __future__ import annotations

import torch

from mlacheck.backends.aiter_model._common import check, lse_fix
from mlacheck.backends.numerics import merge_partials

# (heads, Dv) pairs the reduce kernel is instantiated for.
SUPPORTED_DV128_HEADS = (1, 2, 4, 8, 10, 16, 32, 40, 48, 64, 96, 128)
SUPPORTED_DV512_HEADS = (8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
SUPPORTED_OTHER = ((64, 64),)


def reduce_supported(heads: int, dv: int) -> bool:
    return ((dv == 128 and heads in SUPPORTED_DV128_HEADS)
            or (dv == 512 and heads in SUPPORTED_DV512_HEADS)
            or (heads, dv) in SUPPORTED_OTHER)


def min_partials_reduced() -> int:
    """Tiles with fewer partials than this are skipped (2 at AITER main, 1 with #3606)."""
    return 1 if lse_fix() else 2


def mla_reduce_v1(
    partial_output: torch.Tensor,
    partial_lse: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor | None,
    reduce_partial_map: torch.Tensor,
    max_seqlen_q: int,
    num_kv_splits: int,
    final_output: torch.Tensor,
    final_lse: torch.Tensor | None = None,
) -> None:
    """Merge KV-split partials into final_output (and final_lse), in place (model).

    max_seqlen_q and num_kv_splits only tune AITER's launch; the model ignores them.
    """
    check(partial_output.dtype == torch.float32, "mla_reduce_v1: partial_output must be fp32")
    check(partial_lse.dtype == torch.float32, "mla_reduce_v1: partial_lse must be fp32")
    heads, dv = final_output.shape[-2], final_output.shape[-1]
    check(reduce_supported(heads, dv),
          f"mla_reduce_v1: no kernel instance for {heads} heads x Dv {dv}")
    rows = partial_output.shape[0]
    part_o = partial_output.reshape(rows, heads, dv)
    part_lse = partial_lse.reshape(rows, heads)
    indptr = [int(x) for x in reduce_indptr.tolist()]
    pmap = [int(x) for x in reduce_partial_map.tolist()]
    fmap = None if reduce_final_map is None else reduce_final_map.tolist()
    need = min_partials_reduced()
    for t in range(len(indptr) - 1):
        lo, hi = indptr[t], indptr[t + 1]
        n = hi - lo
        if n < need:
            continue
        starts = pmap[lo:hi]
        if fmap is not None:
            q_start, q_end = int(fmap[t][0]), int(fmap[t][1])
        else:
            qo_len = starts[1] - starts[0] if n > 1 else max_seqlen_q
            q_start, q_end = t * qo_len, (t + 1) * qo_len
        if q_end <= q_start:
            continue
        local = torch.arange(q_end - q_start, device=part_o.device)
        idx = torch.tensor(starts, device=part_o.device)[:, None] + local[None, :]  # [n, rows]
        check(bool((idx >= 0).all()) and int(idx.max()) < rows,
              f"AITER model: reduce tile {t} reads partial rows outside the {rows}-row buffer")
        out, lse = merge_tile(part_o[idx], part_lse[idx])
        final_output[q_start:q_end] = out.to(final_output.dtype)
        if final_lse is not None:
            final_lse.view(-1, heads)[q_start:q_end] = lse


def merge_tile(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [n, rows, H, Dv], lses [n, rows, H] -> (out [rows, H, Dv], lse [rows, H])."""
    lses = torch.nan_to_num(lses, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    outs = torch.nan_to_num(outs, nan=0.0, posinf=float("inf"), neginf=float("-inf"))
    out, lse = merge_partials(outs, lses)
    # no partial saw a key: the kernel's sum is 0 and it writes +INFINITY as the LSE
    return out, torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
