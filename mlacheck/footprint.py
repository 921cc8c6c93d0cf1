"""How much memory a case needs, and whether the device has it, before anything is built.

A case that cannot fit is the suite's problem, not the kernel's: the harness turns it into a
SKIP naming the sizes (a matrix run) and `mlacheck replay` into a one-line exit-2 error, never
a CRASH charged to the backend. The estimate counts what inputs.build and the references
allocate: the unquantised fp32 originals and their stored copies, the paged pools, the
output, and the golden's and baseline's largest working set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mlacheck.formats import indexer_page_bytes
from mlacheck.ops import Op
from mlacheck.spec import FORMAT_BYTES, PIPELINE_OPS, Case, PrefillCase

FP32 = 4
# Largest score block the golden (mlacheck.golden.core) materialises at once: 512 MiB (2^27
# fp32 or 2^26 fp64 elements). A 16k-token x 128-head prefill or a 128k-context decode then
# runs in bounded memory on CPU and GPU, and fp64 stays within the same bytes as fp32
# (benchmarks/golden_perf.py measures it). Here, not in the golden: this module is read by
# the xdist controller (the scheduler's estimates), which does not import torch.
SCORE_BLOCK_BYTES = 512 << 20
# The count below misses temporaries (casts, gathers, the backends' own copies). Measured
# (torch.cuda.max_memory_allocated per case, H100 nightly with torch + aiter-model +
# aiter-triton, 2026-11-25): a case's device peak was at most 2.03x the count plus
# CASE_OVERHEAD (fp8 amax decode: the quantisation's fp32 temporary; big prefill: the torch
# backend's fp32 K/V copies); on CPU, peak RSS of a torch-backend case was 1.04-1.34x.
TEMPORARIES = 2.25
# Per case, whatever its size: kernel workspaces, persistent schedule buffers, allocator
# granularity (the same run's smallest cases peaked at 0.30 GiB against a count of MiBs).
CASE_OVERHEAD = 2**29
# A case may use this share of the memory the device reports available: the rest is for the
# interpreter, the backend's own buffers and the allocator's slack.
FIT_FRACTION = 0.8


@dataclass(frozen=True)
class Footprint:
    inputs: int
    pools: int
    references: int

    @property
    def total(self) -> int:
        return int(TEMPORARIES * (self.inputs + self.pools + self.references)) + CASE_OVERHEAD

    def describe(self) -> str:
        return (f"~{gib(self.total)} (inputs {gib(self.inputs)}, pools {gib(self.pools)}, "
                f"references {gib(self.references)}, x{TEMPORARIES:g} for temporaries, "
                f"+{gib(CASE_OVERHEAD)} per case)")


def gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**24 else f"{n / 2**20:.3g} MiB"


def estimate(case: Case) -> Footprint:
    if case.op in PIPELINE_OPS:
        return _PIPELINE_ESTIMATES[case.op](case)
    d, h = case.dims, case.num_heads
    qb, kb = FORMAT_BYTES[case.quant.q], FORMAT_BYTES[case.quant.kv]
    out_b = 2 if case.quant.q != "fp32" else FP32
    lens, tq, tk = case.kv_lengths, case.total_q, case.total_kv
    longest, rows = max(lens), case.max_q_len * h
    if isinstance(case, PrefillCase):  # the MHA form: per-head K and V
        inputs = (tq * h * d.qk_head * (FP32 + qb) + tk * h * (d.qk_head + d.v_head) * (FP32 + kb)
                  + tq * h * d.v_head * out_b)
        pools = 0
        if case.paging is not None:
            ps = case.paging.page_size
            for width in (d.qk_head, d.v_head):
                pages = case.placement.pool_pages(lens, ps, ps * h * width * kb)
                pools += pages * ps * h * width * kb
        refs = 2 * longest * h * (d.qk_head + d.v_head) * FP32  # golden + baseline operands
    else:  # the absorbed form: one latent pool
        inputs = tq * h * d.latent * (FP32 + qb) + tk * d.latent * (FP32 + kb) + (
            tq * h * d.kv_lora_rank * out_b)
        ps = case.paging.page_size
        pages = case.placement.pool_pages(lens, ps, ps * d.latent * kb)
        pools = pages * ps * d.latent * kb
        refs = 2 * longest * d.latent * FP32
    refs += min(SCORE_BLOCK_BYTES, rows * longest * FP32)
    return Footprint(inputs, pools, refs)


# --------------------------------------------------------------------------- sparse pipeline
# The same count for the sparse-pipeline ops (mlacheck.pipeline_inputs, golden.pipeline_ops):
# inputs (unquantised originals and stored copies), the guarded output, the references
# (golden values + magnitudes or the golden attention, and the baseline's copy of the output)
# and the largest score block a reference or the torch backend forms at once.


def _indexer_query(rows: int, h: int, dim: int) -> int:
    return rows * h * dim * (FP32 + 1) + 3 * rows * h * FP32  # q (fp32, fp8), scale, weights


def _indexer(case: Any) -> Footprint:
    t, s = case.total_q, case.total_kv
    inputs = _indexer_query(t, case.num_heads, case.head_dim) + s * case.head_dim * (FP32 + 1)
    out = t * s * FP32
    return Footprint(inputs + out, 0, 3 * out + min(SCORE_BLOCK_BYTES, t * case.num_heads * s * FP32))


def _paged_indexer(case: Any) -> Footprint:
    rows, width = case.total_q, max(case.kv_lengths)
    page_bytes = indexer_page_bytes(case.page_size, case.head_dim)
    pool = case.placement.pool_pages(list(case.kv_lengths), case.page_size,
                                     page_bytes) * page_bytes
    inputs = (_indexer_query(rows, case.num_heads, case.head_dim)
              + case.total_kv * case.head_dim * (FP32 + 1) + rows * width * FP32)
    block = min(SCORE_BLOCK_BYTES, case.next_n * case.num_heads * width * FP32)
    return Footprint(inputs, pool, 3 * rows * width * FP32 + block)


def _topk(case: Any) -> Footprint:
    width = case.total_kv if case.form == "prefill" else max(case.kv_lengths)
    logits = case.total_q * width * FP32
    return Footprint(logits + case.total_q * case.topk * FP32, 0, 4 * logits)


def _conversion(case: Any) -> Footprint:
    return Footprint(4 * case.total_q * case.topk * FP32, 0, 4 * case.total_q * case.topk * FP32)


def _sparse_prefill(case: Any) -> Footprint:
    d, h, t = case.dims, case.num_heads, case.total_q
    qb = FORMAT_BYTES[case.quant.q]
    out = t * h * d.kv_lora_rank
    inputs = t * h * d.latent * (FP32 + qb) + case.total_kv * d.latent * (FP32 + qb) + out * 2
    refs = 3 * out * FP32 + min(SCORE_BLOCK_BYTES, t * case.topk * d.latent * FP32)
    return Footprint(inputs, 0, refs)


def _pipeline(case: Any) -> Footprint:
    att, idx = estimate(case.attention_case()), estimate(case.indexer_case())
    gathered = min(SCORE_BLOCK_BYTES, case.total_q * case.topk * case.dims.latent * FP32)
    return Footprint(att.inputs + idx.inputs, att.pools + idx.pools,
                     att.references + idx.references + gathered)


_PIPELINE_ESTIMATES = {Op.MQA_LOGITS: _indexer, Op.PAGED_MQA_LOGITS: _paged_indexer,
                       Op.TOPK: _topk, Op.INDEX_CONVERSION: _conversion,
                       Op.SPARSE_PREFILL: _sparse_prefill, Op.SPARSE_PIPELINE: _pipeline}


def available_bytes(device: str) -> int | None:
    """Memory a case may take on `device` (None: unknown, not checked). On a GPU that is the
    whole device, not what is free now: other workers' cases give theirs back, and
    `mlacheck.admission` makes a case wait for that (a SKIP would depend on the schedule)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        _, total = torch.cuda.mem_get_info(dev)
        return total  # inputs are drawn on the device (mlacheck.rng): the host holds no copy
    return host_available()


def host_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def does_not_fit(case: Case, device: str) -> str | None:
    """None when the case fits, else a one-line reason naming the sizes."""
    need = estimate(case)
    have = available_bytes(device)
    if have is None or need.total <= FIT_FRACTION * have:
        return None
    return (f"case needs {need.describe()}, more than {FIT_FRACTION:.0%} of the "
            f"{gib(have)} available on {device}: too large for this machine")
