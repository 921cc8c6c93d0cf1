"""How long a matrix item will take, estimated before it runs (no torch, no device).

Two decisions read it: the order a run starts its cases in (longest first, so no long case
starts last and holds the run's end: mlacheck.pytest_plugin) and how `--shard K/N` balances
the shards (mlacheck.shard). Both need the ranking more than the seconds.

An item's time is the sum of what its phases touch: the stored inputs and pools (built,
checksummed, restored between backends), the attention arithmetic (golden exact and ideal,
the same-precision baseline, once per case; the kernel, per backend) and the output the
judge reads (a few fp64 passes over every element, per backend). The rates are per device
type; what they are from is said at each. `mlacheck.footprint` estimates bytes, this module
seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from mlacheck import footprint
from mlacheck.spec import PIPELINE_OPS, Case, Op

# Per item whatever its size: the pytest item, the verdict line, admission, the checksum of the
# shared inputs. The H100 nightly's small cases took ~0.1 s per item (1041 items, 99.7 s on
# 8 workers, most of it in a few large cases: docs/gpu-results.md).
ITEM_S = 0.05
# Seconds per byte of stored inputs and pools (drawn on the device: the three largest nightly
# inputs, 2.5 GB each, took 0.17-0.23 s on the H100; on a CPU ~225 MB/s, docs/gpu-results.md).
BYTE_S = {"cuda": 1 / 12e9, "cpu": 1 / 225e6}
# Seconds per attention FLOP (q x kv x heads x (qk + v) x 2) of the references, computed once
# per case: golden exact + ideal in fp32 (55% of the H100's 51.5 TFLOP/s fp32 matmul, bench-
# marks/golden_perf.py) and the same-precision baseline (kernel-precision numerics, ~3x the
# golden). CPU: ~20 GFLOP/s for a 2-thread worker's fp32 matmul.
REF_FLOP_S = {"cuda": 5 / 28e12, "cpu": 5 / 20e9}
# Seconds per attention FLOP of the backend under test: a model or the torch backend runs the
# baseline's numerics; library kernels (KERNEL_SPEEDUP) are much faster than that.
KERNEL_FLOP_S = {"cuda": 3 / 28e12, "cpu": 3 / 20e9}
KERNEL_SPEEDUP = {"aiter": 10.0, "aiter-nonpersistent": 10.0, "aiter-triton": 10.0,
                  "flashinfer": 10.0, "flashinfer-fa3": 10.0, "flashmla": 10.0,
                  "deepgemm": 10.0, "deepgemm-flashmla": 10.0}
# Measured kernel seconds / the estimate above, per (backend, op), on the H100 (the nightly of
# main 5717c62, one GPU, 2026-11-26: docs/gpu-results.md "Two H100s of one host"; regenerate
# with `python benchmarks/calibrate_cost.py RESULTS.jsonl`). Medians over the items whose
# estimate is >= 0.1 ms. The FLOP rate alone put aiter-model's 62 s sparse prefill at 0.1 s,
# so the longest case started late and held the 2-GPU run. Unlisted pairs: 1.
KERNEL_CALIBRATION: dict[tuple[str, Op], float] = {
    ('aiter-model', Op.DECODE): 105.7,
    ('aiter-model', Op.SPARSE_PREFILL): 499.8,
    ('aiter-model', Op.MQA_LOGITS): 45.6,
    ('aiter-triton', Op.DECODE): 73.5,
    ('aiter-triton', Op.PREFILL): 6.9,
    ('torch', Op.DECODE): 55.2,
    ('torch', Op.PREFILL): 6.3,
    ('torch', Op.SPARSE_DECODE): 39.9,
    ('torch', Op.SPARSE_PREFILL): 17.1,
    ('torch', Op.MQA_LOGITS): 44.8,
    ('torch', Op.PAGED_PREFILL): 3.5,
}
# Seconds per output element judged: about a dozen fp64 passes (row errors against the exact
# and the unquantised golden, for the kernel and the baseline, norms, cosine, finiteness),
# run where the output is in row slices (mlacheck.judge.SLICE_ELEMENTS). CPU: 2.5e-8 s per
# element and pass with 2 threads (measured: row_errors on a [4096, 16, 128] output).
JUDGE_ELEMENT_S = {"cuda": 12 * 16 / 2e12, "cpu": 12 * 2.5e-8}


# Memoised: the references and every backend's item estimate ask for it (4 times a case in a
# 3-backend run, in every worker), and the per-token lengths of a 16k-token prefill are long.
@functools.lru_cache(maxsize=1 << 14)
def attention_flops(case: Case) -> float:
    """Multiply-adds x 2 of one attention pass over the case: the (query, key) pairs each
    token attends (a causal window: the visible triangle only; a top-k: its valid entries),
    each a q.k of qk_width and a p.v of out_width per head."""
    if case.op in PIPELINE_OPS:
        return _pipeline_flops(case)
    width = case.qk_width + case.out_width  # type: ignore[union-attr]
    return 2.0 * sum(case.attended_lengths) * case.num_heads * width


def _pipeline_flops(case: Case) -> float:
    """The sparse-pipeline ops (docs/sparse-pipeline.md): logits (and their magnitudes) over
    every row's window, the selections' attention, a sort for top-k."""
    op = case.op
    vis = case.visible_lengths  # type: ignore[union-attr]
    if op in (Op.MQA_LOGITS, Op.PAGED_MQA_LOGITS):
        return 4.0 * sum(vis) * case.num_heads * case.head_dim  # type: ignore[union-attr]
    if op == Op.TOPK:
        return 20.0 * sum(vis)
    if op == Op.INDEX_CONVERSION:
        return 10.0 * case.total_q * case.topk  # type: ignore[union-attr]
    d = case.dims  # type: ignore[union-attr]
    pairs = sum(min(case.topk, v) for v in vis)  # type: ignore[union-attr]
    attention = 2.0 * pairs * case.num_heads * (d.latent + d.kv_lora_rank)
    if op == Op.SPARSE_PIPELINE:
        attention += 4.0 * sum(vis) * case.index_heads * case.index_head_dim  # type: ignore[union-attr]
    return attention


def _pipeline_outputs(case: Case) -> int:
    op = case.op
    if op == Op.MQA_LOGITS:
        return case.total_q * case.total_kv  # type: ignore[union-attr]
    if op in (Op.PAGED_MQA_LOGITS, Op.TOPK):
        width = case.total_kv if getattr(case, "form", "") == "prefill" else max(case.kv_lengths)  # type: ignore[union-attr]
        return case.total_q * width  # type: ignore[union-attr]
    if op == Op.INDEX_CONVERSION:
        return case.total_q * case.topk  # type: ignore[union-attr]
    out = case.total_q * case.num_heads * case.dims.kv_lora_rank  # type: ignore[union-attr]
    if op == Op.SPARSE_PIPELINE:
        out += case.total_q * max(case.kv_lengths)  # type: ignore[union-attr]
    return out


def output_elements(case: Case) -> int:
    if case.op in PIPELINE_OPS:
        return _pipeline_outputs(case)
    return case.total_q * case.num_heads * case.out_width


def _kind(device: str) -> str:
    return "cpu" if device.startswith("cpu") else "cuda"


def references_s(case: Case, device: str = "cuda") -> float:
    """What a case costs once, whatever its backends: inputs and references."""
    fp = footprint.estimate(case)
    kind = _kind(device)
    return (fp.inputs + fp.pools) * BYTE_S[kind] + attention_flops(case) * REF_FLOP_S[kind]


def kernel_s(case: Case, backend: str, device: str = "cuda", calibrated: bool = True) -> float:
    """The backend's kernel on the case: the FLOP rate, times the measured factor of its
    (backend, op) on a GPU (KERNEL_CALIBRATION)."""
    kind = _kind(device)
    est = attention_flops(case) * KERNEL_FLOP_S[kind] / KERNEL_SPEEDUP.get(backend, 1.0)
    if calibrated and kind == "cuda":
        est *= KERNEL_CALIBRATION.get((backend, case.op), 1.0)
    return est


def item_s(case: Case, backend: str, device: str = "cuda") -> float:
    """One backend's own part of a case: its kernel and the judging of its output."""
    kind = _kind(device)
    return ITEM_S + kernel_s(case, backend, device) + output_elements(case) * JUDGE_ELEMENT_S[kind]


def case_s(case: Case, backends: Iterable[str], device: str = "cuda") -> float:
    """A case with all its backends in one worker (they share its inputs and references)."""
    return references_s(case, device) + sum(item_s(case, b, device) for b in backends)
