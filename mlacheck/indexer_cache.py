"""The paged FP8 indexer-key cache of DeepSeek-V3.2, in the byte layout its kernels read.

Each page of `page_size` tokens is one run of bytes: first the page's FP8 key values,
token after token (page_size x D bytes), then the page's FP32 dequantisation scales, one
per token (page_size x 4 bytes). The kernels view a page as [page_size, 1, D + 4] uint8
(DeepGEMM `fp8_paged_mqa_logits`: `fused_kv_cache`, whose `stride(0)` is the page; AITER
`deepgemm_fp8_paged_mqa_logits`: `kv_cache.view(-1, KVBlockSize * index_dim)` split at
`KVBlockSize * hidden_dim`; vLLM's `indexer_k_quant_and_cache` writes it), i.e. the
[D + 4] "token" view is NOT a token's bytes: token t's values are at t * D of its page and
its scale at page_size * D + 4 t.

Keys are quantised per token: scale = max(amax, 1e-4) / fmt.max (vLLM's
`indexer_k_quant_and_cache`; `ue8m0`: rounded up to a power of two).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import fp8
from mlacheck.formats import INDEXER_SCALE_BYTES as SCALE_BYTES
from mlacheck.formats import indexer_page_bytes as page_bytes  # noqa: F401 (re-exported)

# vLLM's indexer_k_quant_and_cache: scale = max(amax, AMAX_FLOOR) / fmt max (e4m3fn 448;
# on fnuz it divides by 224, half the fnuz max, to stay clear of the NaN boundary).
AMAX_FLOOR = 1e-4


@dataclass(frozen=True)
class IndexerKeys:
    """Per-token quantised indexer keys: values [N, D] in `fmt`, scales [N] FP32."""

    values: torch.Tensor
    scales: torch.Tensor
    fmt: str

    def dequant(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.values.to(dtype) * self.scales.to(dtype)[:, None]


def quantise_keys(k: torch.Tensor, fmt_name: str = "fp8_e4m3fn", ue8m0: bool = False,
                  divisor: float | None = None) -> IndexerKeys:
    """k [N, D] (any float) -> per-token FP8 keys. divisor: what amax is divided by (default:
    the format's max; vLLM uses 224 on fnuz)."""
    f = fp8.fmt(fmt_name)
    amax = k.float().abs().amax(dim=-1).clamp(min=AMAX_FLOOR).cpu()
    scale = amax / (divisor or f.max)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.to(k.device)
    values = fp8.quantize(k, fmt_name, scale[:, None])
    return IndexerKeys(values, scale.to(torch.float32), fmt_name)


def pack(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values [P, ps, D] (FP8), scales [P, ps] (FP32) -> pages [P, ps, 1, D + 4] uint8 in
    the kernels' layout (values of the page, then its scales)."""
    pages, ps, dim = values.shape
    flat = torch.empty((pages, page_bytes(ps, dim)), dtype=torch.uint8, device=values.device)
    flat[:, : ps * dim] = values.reshape(pages, ps * dim).view(torch.uint8)
    flat[:, ps * dim:] = scales.to(torch.float32).contiguous().reshape(pages, ps).view(
        torch.uint8).reshape(pages, ps * SCALE_BYTES)
    return flat.view(pages, ps, 1, dim + SCALE_BYTES)


def unpack(pages: torch.Tensor, dim: int, fmt_name: str = "fp8_e4m3fn"
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """pages [P, ps, 1, D + 4] (or [P, ps * (D + 4)]) uint8 -> (values [P, ps, D] in
    `fmt_name`, scales [P, ps] FP32): the inverse of `pack`, a copy."""
    n = pages.shape[0]
    flat = pages.reshape(n, -1)
    ps = flat.shape[1] // (dim + SCALE_BYTES)
    if ps * (dim + SCALE_BYTES) != flat.shape[1]:
        raise ValueError(f"a page of {flat.shape[1]} bytes is not page_size x {dim + 4}")
    values = flat[:, : ps * dim].contiguous().view(fp8.fmt(fmt_name).dtype).view(n, ps, dim)
    scales = flat[:, ps * dim:].contiguous().view(torch.float32).view(n, ps)
    return values, scales
