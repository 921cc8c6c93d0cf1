"""`flashmla`: DeepSeek's FlashMLA dense decode on sm_90 (H100/H200).

`flash_mla.get_mla_metadata()` + `flash_mla.flash_mla_with_kvcache(...)`: the absorbed-MLA
decode (q 576, kv 576, v = the first 512 channels) over a paged latent cache with FlashMLA's
own persistent tile scheduler (the first call of a schedule computes the work split across
the SMs; the NVIDIA analogue of AITER's persistent decode metadata). The cache is mlacheck's
latent pool as is when its pages are 64 tokens ([pages, 64, 1, 576]: FlashMLA's
[num_blocks, page_block_size, num_heads_k, head_dim]); other page sizes are repacked into a
fresh shuffled, tail-poisoned page-64 pool ("Currently page_block_size must be 64",
csrc/api/dense_decode.h), and the verdict's metadata says so. The page table goes in vLLM's
form (block_table + cache_seqlens). q is [batch, q_len, heads, 576], one q_len per call: a
mixed MTP batch runs as one call per q_len, empty requests left out. FlashMLA returns the
LSE as [batch, heads, q_len] in natural log.

What it does not take (SKIP with the reason): FP8 dense caches (sm_90 dense decode is
bf16/fp16 only), pools in a non-linear layout (repacking one would claim a layout the kernel
never saw) and the sparse decode (its FP8 656-byte V3.2 cache layout with
per-128-channel scales is not one of mlacheck's formats).
"""

from __future__ import annotations

from typing import Any

import torch

from mlacheck import layouts
from mlacheck.backends.base import Capability, Output
from mlacheck.backends.toolkit import (
    LibraryAdapter,
    Loaded,
    cuda_refusal,
    load_library,
    lse_natural,
    lse_tokens_heads,
)
from mlacheck.inputs import DecodeInputs, Inputs, generator
from mlacheck.kvcache import KVPool, repaged
from mlacheck.spec import Case, DecodeCase

MODULE = "flash_mla"
DISTRIBUTIONS = ("flash_mla", "flash-mla")
INSTALL_HINT = "build deepseek-ai/FlashMLA for sm_90 (docs/flashmla.md)"
PAGE_SIZE = 64  # "Currently page_block_size must be 64" (csrc/api/dense_decode.h)
REPAGE_SALT = 0x64  # seeds the shuffled page order of a repacked page-64 pool
FORMATS = ("bf16", "fp16")  # sm_90 dense decode: bf16 / fp16 q and cache of the same dtype

CALLED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "get_mla_metadata": (),
    "flash_mla_with_kvcache": (
        "q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
        "softmax_scale", "causal"),
}


def load() -> Loaded | str:
    """Import flash_mla and check the installed signatures; a one-line reason otherwise."""
    return load_library(MODULE, distributions=DISTRIBUTIONS, install_hint=INSTALL_HINT,
                        called=CALLED_PARAMETERS)


class FlashMLABackend(LibraryAdapter):
    """FlashMLA's dense decode behind the backend contract."""

    def __init__(self, name: str = "flashmla") -> None:
        self.name = name

    def import_library(self) -> Loaded | str:
        return load()

    def machine_refusal(self) -> str | None:
        return cuda_refusal("FlashMLA", 9, "FlashMLA's dense decode runs on sm_90 only (H100/H200)")

    def capabilities(self) -> dict[str, Capability]:
        got = self.loaded()
        if isinstance(got, str):
            return {"mla_decode": Capability(refusal=got)}
        problem = got.first_problem(CALLED_PARAMETERS)
        return {
            "mla_decode": Capability(
                q_formats=FORMATS, kv_formats=FORMATS,
                format_pairs=frozenset((f, f) for f in FORMATS), empty_requests=True,
                layouts=(layouts.LINEAR.name,),  # FlashMLA's cache: linear pages only
                causal=(True,), lse=True, devices=("cuda",), refusal=problem,
                notes="flash_mla_with_kvcache dense decode, persistent tile scheduler; LSE "
                      "natural log. Pages other than 64 run repacked into a page-64 pool; a "
                      "batch of mixed q_len runs as one call per q_len (empty requests left "
                      "out)"),
        }

    def run(self, case: Case, inputs: Inputs) -> Output:
        got = self.loaded()
        if isinstance(got, str):
            raise RuntimeError(got)
        assert isinstance(case, DecodeCase) and isinstance(inputs, DecodeInputs)
        dev, heads, dv = inputs.device, case.num_heads, case.dims.kv_lora_rank
        pool = inputs.pool
        repacked = pool.table.page_size if _needs_repage(pool) else None
        if repacked is not None:
            pool = repaged(pool, PAGE_SIZE, case.placement.tail_poison, generator(case, REPAGE_SALT))
        block_table, seqlens = pool.table.to_vllm()
        block_table, seqlens = block_table.to(dev), seqlens.to(dev)
        out = torch.zeros(case.total_q, heads, dv, dtype=inputs.q.stored.dtype, device=dev)
        lse = torch.zeros(case.total_q, heads, dtype=torch.float32, device=dev)
        sm_parts = []
        for rows, tokens, s_q in _uniform_groups(case, inputs.qo_indptr):
            q = inputs.q.stored[tokens.to(dev)].view(len(rows), s_q, heads, case.dims.latent)
            sched, _ = got.module.get_mla_metadata()
            o, l = got.module.flash_mla_with_kvcache(
                q=q, k_cache=pool.data, block_table=block_table[rows.to(dev)],
                cache_seqlens=seqlens[rows.to(dev)], head_dim_v=dv,
                tile_scheduler_metadata=sched, softmax_scale=case.softmax_scale, causal=True)
            out[tokens.to(dev)] = o.reshape(-1, heads, dv)
            lse[tokens.to(dev)] = lse_tokens_heads(lse_natural(l), len(tokens), heads)  # [b, H, s_q]
            sm_parts.append(_sm_parts(sched))
        meta: dict[str, Any] = {"flashmla": {
            "version": got.version, "sm_parts": sm_parts, "calls": len(sm_parts),
            "repacked_from_page_size": repacked}}
        return Output(out, lse, metadata=meta)


def _needs_repage(pool: KVPool) -> bool:
    return pool.table.page_size != PAGE_SIZE or pool.layout != layouts.LINEAR.name


def _uniform_groups(
    case: DecodeCase, qo_indptr: torch.Tensor,
) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(request rows, their token rows, q_len) per distinct non-zero q_len, in first-seen order.

    FlashMLA takes q as [batch, q_len, heads, 576]: a mixed batch runs as one call per q_len;
    empty requests (q_len 0) have no tokens and are left out of every call.
    """
    starts = qo_indptr.tolist()
    groups: dict[int, list[int]] = {}
    for r, req in enumerate(case.requests):
        if req.q_len:
            groups.setdefault(req.q_len, []).append(r)
    return [(torch.tensor(rows), torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows]),
             s_q) for s_q, rows in groups.items()]


def _sm_parts(sched: Any) -> int | None:
    """How many SM partitions the tile scheduler split the batch over (for the record)."""
    meta = getattr(sched, "tile_scheduler_metadata", None)
    return int(meta.shape[0]) if isinstance(meta, torch.Tensor) else None


def factory() -> FlashMLABackend:
    return FlashMLABackend()
