"""Deterministic tensors for a case: queries, latent KV, weights, quantised copies, pools.

Bulk values (q, k, v, latent KV, weights) come from mlacheck.rng's counter-based streams,
keyed by the case content and drawn directly on the device: the same bits on CPU and GPU,
without a CPU-sized detour for a multi-GB case; how each tensor is distributed (per-tensor
ranges, channel and token structure, near-ties) is the case's `distribution`
(mlacheck.distributions). Small structural draws (page placement, the stress profile's
outlier channels, sparse top-k sets) come from a CPU torch.Generator seeded the same way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from mlacheck import distributions, fp8, kvcache, rng
from mlacheck.kvcache import Guarded, KVPool, PageTable
from mlacheck.spec import (
    PIPELINE_OPS,
    Case,
    DecodeCase,
    MLADims,
    Op,
    PrefillCase,
    Quant,
    SparseDecodeCase,
)

# Stress profile: a few outlier channels this large overflow FP8 under a unit scale
# (e4m3fn max 448, e4m3fnuz max 240), the condition behind bug class 7.
STRESS_OUTLIER = 600.0
STRESS_CHANNELS = 4


@dataclass
class Quantised:
    """A tensor as the kernel receives it (`stored` in `fmt`, scale = dequant factor) and the
    unquantised original (`ideal`, fp32)."""

    stored: torch.Tensor
    scale: torch.Tensor
    fmt: str
    ideal: torch.Tensor

    def dequant(self) -> torch.Tensor:
        return fp8.dequantize(self.stored, self.scale)


@dataclass
class Weights:
    """Per-head absorption weights: k_nope = W_UK c_kv, v = W_UV^T c_kv (both views derivable)."""

    w_uk: torch.Tensor  # [H, qk_nope, kv_lora_rank]
    w_uv: torch.Tensor  # [H, kv_lora_rank, v_head]


@dataclass
class PrefillInputs:
    case: PrefillCase
    q: Quantised  # [Tq, H, 192]
    k: Quantised  # [Tk, H, 192] (all segments' context + own tokens, concatenated)
    v: Quantised  # [Tk, H, 128]
    cu_seqlens_q: torch.Tensor  # [S+1] int32
    cu_seqlens_k: torch.Tensor  # [S+1] int32
    out: Guarded  # [Tq, H, 128]
    k_pool: KVPool | None = None
    v_pool: KVPool | None = None

    @property
    def row_bounds(self) -> list[int]:
        """Token-row boundaries of each segment (CSR)."""
        return self.cu_seqlens_q.tolist()

    def with_row_bounds(self, case: PrefillCase, bounds: torch.Tensor) -> PrefillInputs:
        """These tensors read as `case` (other segments) with other query-row boundaries: a
        shallow copy, so what a kernel writes into `out` lands in this buffer."""
        return dataclasses.replace(self, case=case, cu_seqlens_q=bounds)

    @property
    def paged_pool(self) -> KVPool | None:
        """The pool failures name pages and bytes in: the K pool (None when unpaged)."""
        return self.k_pool

    @property
    def device(self) -> torch.device:
        return self.q.stored.device


@dataclass
class DecodeInputs:
    case: DecodeCase | SparseDecodeCase
    q: Quantised  # [T, H, 576] absorbed queries
    kv: list[Quantised]  # per request [kv_len, 1, 576] (logical order)
    pool: KVPool  # paged latent pool [P, ps, 1, 576] stored in case.layout (linear: as is)
    qo_indptr: torch.Tensor  # [B+1] int32
    out: Guarded  # [T, H, 512]
    # Sparse only: per query token, logical kv positions in its request, -1 padded to topk.
    topk_indices: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @property
    def row_bounds(self) -> list[int]:
        """Token-row boundaries of each request (CSR)."""
        return self.qo_indptr.tolist()

    def with_row_bounds(self, case: DecodeCase | SparseDecodeCase,
                        bounds: torch.Tensor) -> DecodeInputs:
        """These tensors read as `case` (other requests) with other query-row boundaries: a
        shallow copy, so what a kernel writes into `out` lands in this buffer."""
        return dataclasses.replace(self, case=case, qo_indptr=bounds)

    @property
    def paged_pool(self) -> KVPool:
        """The pool failures name pages and bytes in: the latent pool."""
        return self.pool

    @property
    def device(self) -> torch.device:
        return self.q.stored.device

    @property
    def table(self) -> PageTable:
        return self.pool.table


Inputs = PrefillInputs | DecodeInputs


def generator(case: Case, salt: int = 0) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed((case.seed_material + salt) % (1 << 63))


def _randn(shape: tuple[int, ...], case: Case, role: str, stream: str, gen: torch.Generator,
           device: torch.device | str) -> torch.Tensor:
    """The case's tensor of `role` (mlacheck.distributions) from its stream `stream`, made
    on `device`; the stress profile's outlier channels on top."""
    x = distributions.draw(case, role, shape, device, stream)
    if case.profile == "stress":
        # the same few channels (last dim) in every row carry outliers, as LLM activations do
        ch = torch.randperm(shape[-1], generator=gen)[:STRESS_CHANNELS]
        x[..., ch.to(x.device)] *= STRESS_OUTLIER
    return x


def quantise(x: torch.Tensor, fmt_name: str, quant: Quant, device: torch.device | str) -> Quantised:
    """The stored copy a production path would hand the kernel (torch-native overflow),
    computed where `x` lives (integer and correctly rounded operations: the same bits on
    every device) and moved to `device`."""
    scale = fp8.pick_scale(x, fmt_name, quant.scale, quant.per_token)
    stored = fp8.quantize(x, fmt_name, scale)
    return Quantised(stored.to(device), scale.to(device), fmt_name, x.to(device))


def make_weights(dims: MLADims, num_heads: int, gen: torch.Generator) -> Weights:
    """Weights from a torch generator (callers that hold one, e.g. a model's own seed)."""
    # entries N(0, 1/rank): k_nope and v keep unit variance when c_kv has it
    std = dims.kv_lora_rank**-0.5
    w_uk = torch.randn((num_heads, dims.qk_nope, dims.kv_lora_rank), generator=gen) * std
    w_uv = torch.randn((num_heads, dims.kv_lora_rank, dims.v_head), generator=gen) * std
    return Weights(w_uk, w_uv)


def weights_for(case: Case, device: torch.device | str = "cpu") -> Weights:
    """The case's absorption weights (entries N(0, 1/rank), as make_weights draws them)."""
    d, h = case.dims, case.num_heads
    std = d.kv_lora_rank**-0.5
    w_uk = rng.normal((h, d.qk_nope, d.kv_lora_rank), rng.stream_key(case.seed_material, "w_uk"),
                      device, std)
    w_uv = rng.normal((h, d.kv_lora_rank, d.v_head), rng.stream_key(case.seed_material, "w_uv"),
                      device, std)
    return Weights(w_uk, w_uv)


def mha_from_latent(
    c_kv: torch.Tensor, k_pe: torch.Tensor, w: Weights
) -> tuple[torch.Tensor, torch.Tensor]:
    """MHA-view K [T, H, 192] and V [T, H, 128] from latent c_kv [T, 512] and k_pe [T, 64]."""
    k_nope = torch.einsum("hnc,tc->thn", w.w_uk, c_kv)
    v = torch.einsum("hcv,tc->thv", w.w_uv, c_kv)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, w.w_uk.shape[0], -1)], dim=-1)
    return k, v


def absorb_q(q_nope: torch.Tensor, q_pe: torch.Tensor, w: Weights) -> torch.Tensor:
    """Absorbed query [T, H, 576] = [q_nope · W_UK ‖ q_pe]."""
    return torch.cat([torch.einsum("thn,hnc->thc", q_nope, w.w_uk), q_pe], dim=-1)


def unabsorb_out(o_latent: torch.Tensor, w: Weights) -> torch.Tensor:
    """Absorbed output [T, H, 512] -> per-head value space [T, H, 128] through W_UV."""
    return torch.einsum("thc,hcv->thv", o_latent, w.w_uv)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return out


def build(case: Case, device: torch.device | str = "cpu") -> Inputs:
    """The tensors of a case (each op's builder: a new op adds its own, mlacheck/ops.py)."""
    if case.op in PIPELINE_OPS:  # the DeepSeek-V3.2 sparse-pipeline ops: their own tensors
        from mlacheck import pipeline_inputs

        return pipeline_inputs.BUILDERS[case.op](case, device)  # type: ignore[return-value]
    build_op = {Op.PREFILL: _build_prefill, Op.PAGED_PREFILL: _build_prefill,
                Op.DECODE: _build_decode, Op.SPARSE_DECODE: _build_decode}[case.op]
    return build_op(case, device)  # type: ignore[operator]


def _drawn(case: Case) -> list[tuple[str, str, str, tuple[int, ...], str]]:
    """(name, distribution role, stream, shape, format) of the tensors a case draws, in the
    order build() draws them (the stress profile's generator sees that order)."""
    d, h = case.dims, case.num_heads
    if isinstance(case, PrefillCase):
        return [("q", "q", "q", (case.total_q, h, d.qk_head), case.quant.q),
                ("k", "k", "k", (case.total_kv, h, d.qk_head), case.quant.kv),
                ("v", "v", "v", (case.total_kv, h, d.v_head), case.quant.kv)]
    kv = sum(r.kv_len for r in case.requests)
    return [("q", "q_latent", "q", (case.total_q, h, d.latent), case.quant.q),
            ("kv", "kv_latent", "kv", (kv, 1, d.latent), case.quant.kv)]


def input_scales(case: Case, max_elements: int = 1 << 24) -> tuple[dict[str, float], bool]:
    """The dequantisation scale each drawn tensor gets (name -> scale: per tensor; per token:
    the median row's; 1 for unit scales and non-FP8 formats), from the tensors themselves
    without pools or references. Past `max_elements` a tensor's leading rows are used (the
    same values: element i does not depend on the tensor's size); the flag says whether every
    tensor was used whole."""
    gen = generator(case)
    scales: dict[str, float] = {}
    whole = True
    for name, role, stream, shape, fmt in _drawn(case):
        per_row = max(1, math.prod(shape[1:]))
        rows = min(shape[0], max(1, max_elements // per_row))
        whole &= rows == shape[0]
        x = _randn((rows, *shape[1:]), case, role, stream, gen, "cpu")
        s = fp8.pick_scale(x, fmt, case.quant.scale, case.quant.per_token)
        scales[name] = float(s.median()) if s.dim() else float(s)
    return scales, whole


def _build_prefill(case: PrefillCase, device: torch.device | str) -> PrefillInputs:
    gen = generator(case)
    d, h = case.dims, case.num_heads
    tq = case.total_q
    q, k, v = (_randn(shape, case, role, stream, gen, device)
               for _, role, stream, shape, _ in _drawn(case))
    qq = quantise(q, case.quant.q, case.quant, device)
    kq = quantise(k, case.quant.kv, case.quant, device)
    vq = quantise(v, case.quant.kv, case.quant, device)
    inputs = PrefillInputs(
        case=case,
        q=qq,
        k=kq,
        v=vq,
        cu_seqlens_q=cu_seqlens([s.q_len for s in case.segments]).to(device),
        cu_seqlens_k=cu_seqlens([s.kv_len for s in case.segments]).to(device),
        out=kvcache.guarded_empty((tq, h, d.v_head), _out_dtype(case.quant), device),
    )
    if case.paging is not None:
        if case.quant.per_token:
            raise ValueError("paged prefill takes per-tensor K/V scales (per_token is decode-only)")
        lens = [s.kv_len for s in case.segments]
        page_bytes = case.paging.page_size * h * d.qk_head * fp8.fmt(case.quant.kv).itemsize
        table, n_pages = kvcache.assign_pages(lens, case.paging.page_size, page_bytes, case.placement, gen)
        cuts = cu_seqlens(lens).tolist()
        for name, t in (("k", kq), ("v", vq)):
            per_req = [t.stored[cuts[i] : cuts[i + 1]] for i in range(len(lens))]
            pool = kvcache.build_pool(
                per_req, table, n_pages, t.fmt, t.scale, device, case.paging.layout, name,
                case.placement.tail_poison,
            )
            setattr(inputs, f"{name}_pool", pool)
    return inputs


def _build_decode(case: DecodeCase | SparseDecodeCase, device: torch.device | str) -> DecodeInputs:
    gen = generator(case)
    d, h = case.dims, case.num_heads
    q, kv_all = (_randn(shape, case, role, stream, gen, device)
                 for _, role, stream, shape, _ in _drawn(case))
    qq = quantise(q, case.quant.q, case.quant, device)
    lens = [r.kv_len for r in case.requests]
    if case.quant.per_token and fp8.fmt(case.quant.kv).is_fp8:
        raise ValueError("per-token KV scales are not modelled for paged pools; use per-tensor")
    kvq = quantise(kv_all, case.quant.kv, case.quant, device)
    cuts = cu_seqlens(lens).tolist()
    kv = [
        Quantised(kvq.stored[a:b], kvq.scale, kvq.fmt, kvq.ideal[a:b])
        for a, b in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    page_bytes = case.page_size * d.latent * fp8.fmt(case.quant.kv).itemsize
    table, n_pages = kvcache.assign_pages(lens, case.page_size, page_bytes, case.placement, gen)
    pool = kvcache.build_pool(
        [kvq.stored[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)],
        table, n_pages, kvq.fmt, kvq.scale, device, case.layout, "latent",
        case.placement.tail_poison,
    )
    inputs = DecodeInputs(
        case=case,
        q=qq,
        kv=kv,
        pool=pool,
        qo_indptr=cu_seqlens([r.q_len for r in case.requests]).to(device),
        out=kvcache.guarded_empty((case.total_q, h, d.kv_lora_rank), _out_dtype(case.quant), device),
    )
    if case.sparse:
        inputs.topk_indices = sparse_indices(case, gen).to(device)
    return inputs


def fingerprint(inp: Inputs) -> list[int]:
    """Checksums of every tensor a kernel reads (all but the output buffer): a kernel that
    writes into its inputs changes them, and the harness then builds the case afresh
    instead of handing the next backend what the last one left. The sums stay on the device
    until one transfer at the end: a sync per tensor (hundreds for a 128-request batch) cost
    seconds per item with 8 processes sharing one GPU (H100 nightly, 2026-11-26)."""
    sums: list[torch.Tensor] = []
    sizes: list[int] = []

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            sums.append(_checksum(x))
            sizes.append(x.numel())
        elif isinstance(x, list | tuple):
            for i in x:
                walk(i)
        elif isinstance(x, dict):
            for i in x.values():
                walk(i)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                if f.name not in ("out", "case"):  # a nested stage's output buffer is output
                    walk(getattr(x, f.name))

    for f in dataclasses.fields(inp):
        if f.name not in ("out", "case"):
            walk(getattr(inp, f.name))
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    values = [0] * len(sums)
    for where in by_device.values():  # one transfer per device
        for i, v in zip(where, torch.stack([sums[i] for i in where]).tolist(), strict=True):
            values[i] = v
    return [x for pair in zip(values, sizes, strict=True) for x in pair]


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Sum of the tensor's bytes read as 64-bit words (wrapping; one fast pass), xor the sum
    of its last few bytes: an int64 scalar on the tensor's device (no sync)."""
    b = fp8.as_ints(t).reshape(-1).view(torch.uint8)
    n = b.numel() // 8 * 8
    try:
        head = b[:n].view(torch.int64).sum()
    except RuntimeError:  # a slice not aligned to 8 bytes: the slow sum
        head = b[:n].sum(dtype=torch.int64)
    return torch.bitwise_xor(head, b[n:].sum(dtype=torch.int64))


def sparse_indices(case: SparseDecodeCase, gen: torch.Generator) -> torch.Tensor:
    """[T, topk] logical kv positions per query token (unsorted, as an indexer emits), -1 padded."""
    rows = []
    for visible, n in zip(case.visible_lengths, case.attended_lengths, strict=True):
        row = torch.full((case.topk,), -1, dtype=torch.int64)
        row[:n] = torch.randperm(visible, generator=gen)[:n]
        rows.append(row)
    return torch.stack(rows).to(torch.int32)


def _out_dtype(quant: Quant) -> torch.dtype:
    """Kernels write bf16 for bf16/fp8 inputs, fp16 for fp16, fp32 for fp32."""
    return {"fp16": torch.float16, "fp32": torch.float32}.get(quant.q, torch.bfloat16)


# --------------------------------------------------------------------------- given tensors
# Inputs built from real tensors instead of seeded random ones (mlacheck.e2e runs a model's
# attention through a backend with these): quantised, laid out and guarded as build() does.


def quantise_with_scale(
    x: torch.Tensor, fmt_name: str, scale: torch.Tensor | float, device: torch.device | str
) -> Quantised:
    """`x` stored in `fmt_name` under a given dequantisation scale (e.g. a KV cache's fixed
    per-layer scale) instead of one picked from `x` itself; what the scale does not cover
    saturates, as the cache write does (`fp8.quantize_cache_write`)."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    stored = fp8.quantize_cache_write(x, fmt_name, s)
    return Quantised(stored.to(device), s.to(device), fmt_name, x.float().to(device))


def prefill_inputs_from_tensors(
    case: PrefillCase,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    device: torch.device | str | None = None,
) -> PrefillInputs:
    """PrefillInputs for a (non-paged) `case` from given MHA-view tensors.

    q [total_q, H, qk_head]; k [total_kv, H, qk_head] and v [total_kv, H, v_head] with the
    segments concatenated, each segment's context tokens first, then its own (as build()
    lays them out). Quantised per `case.quant` (q with the q format, k/v with the kv format,
    scales by the case's policy); the output buffer is guarded.
    """
    if case.paging is not None:
        raise ValueError("prefill_inputs_from_tensors builds non-paged prefill inputs only")
    d, h = case.dims, case.num_heads
    dev = q.device if device is None else device
    want = {
        "q": (q, (case.total_q, h, d.qk_head)),
        "k": (k, (case.total_kv, h, d.qk_head)),
        "v": (v, (case.total_kv, h, d.v_head)),
    }
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the case needs {shape}")
    return PrefillInputs(
        case=case,
        q=quantise(q.float(), case.quant.q, case.quant, dev),
        k=quantise(k.float(), case.quant.kv, case.quant, dev),
        v=quantise(v.float(), case.quant.kv, case.quant, dev),
        cu_seqlens_q=cu_seqlens([s.q_len for s in case.segments]).to(dev),
        cu_seqlens_k=cu_seqlens([s.kv_len for s in case.segments]).to(dev),
        out=kvcache.guarded_empty((case.total_q, h, d.v_head), _out_dtype(case.quant), dev),
    )


def decode_inputs_from_tensors(
    case: DecodeCase,
    q: torch.Tensor,
    kv: list[torch.Tensor],
    device: torch.device | str | None = None,
    *,
    pool: KVPool | None = None,
    kv_scale: torch.Tensor | float | None = None,
    gen: torch.Generator | None = None,
) -> DecodeInputs:
    """DecodeInputs for `case` from given absorbed queries and cached latents.

    q [total_q, H, latent]: absorbed queries `[q_nope · W_UK ‖ q_pe]`, quantised per
    `case.quant.q`. kv: per request, its latents `[kv_len, 1, latent]` (or `[kv_len, latent]`)
    in logical order, unquantised; stored in `case.quant.kv` under one per-tensor scale:
    `kv_scale` when given (a cache's fixed scale), else the pool's scale when a pool is given,
    else the one the case's policy picks from all requests' values (as build() does).

    pool: a paged pool that already holds exactly these stored tokens (a serving engine's
    cache; its page table and layout must describe the case's). None: one is laid out with
    the case's placement and layout through kvcache.assign_pages / build_pool, seeded by
    `gen` (default: the case's generator).
    """
    d, h = case.dims, case.num_heads
    dev = q.device if device is None else device
    if tuple(q.shape) != (case.total_q, h, d.latent):
        want_q = (case.total_q, h, d.latent)
        raise ValueError(f"q has shape {tuple(q.shape)}, the case needs {want_q}")
    if len(kv) != len(case.requests):
        raise ValueError(f"{len(kv)} kv tensors for {len(case.requests)} requests")
    lens = [r.kv_len for r in case.requests]
    kv3 = [t.reshape(t.shape[0], 1, -1) if t.dim() == 2 else t for t in kv]
    for r, (t, n) in enumerate(zip(kv3, lens, strict=True)):
        if tuple(t.shape) != (n, 1, d.latent):
            want = (n, 1, d.latent)
            raise ValueError(f"kv[{r}] has shape {tuple(t.shape)}, the case needs {want}")
    if case.quant.per_token and fp8.fmt(case.quant.kv).is_fp8:
        raise ValueError("per-token KV scales are not modelled for paged pools; use per-tensor")
    kv_all = torch.cat([t.float() for t in kv3])
    if kv_scale is None and pool is not None:
        kv_scale = pool.scale
    if kv_scale is None:
        kvq = quantise(kv_all, case.quant.kv, case.quant, dev)
    else:
        kvq = quantise_with_scale(kv_all, case.quant.kv, kv_scale, dev)
    cuts = cu_seqlens(lens).tolist()
    parts = [
        Quantised(kvq.stored[a:b], kvq.scale, kvq.fmt, kvq.ideal[a:b])
        for a, b in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    if pool is None:
        page_bytes = case.page_size * d.latent * fp8.fmt(case.quant.kv).itemsize
        g = generator(case) if gen is None else gen
        table, n_pages = kvcache.assign_pages(lens, case.page_size, page_bytes, case.placement, g)
        pool = kvcache.build_pool(
            [p.stored for p in parts], table, n_pages, kvq.fmt, kvq.scale, dev, case.layout,
            "latent", case.placement.tail_poison,
        )
    else:
        if pool.layout != case.layout:
            raise ValueError(f"pool is stored {pool.layout}, the case's layout is {case.layout}")
        if pool.table.page_size != case.page_size or pool.table.kv_lens.tolist() != lens:
            raise ValueError(
                f"pool table (page size {pool.table.page_size}, kv lens "
                f"{pool.table.kv_lens.tolist()}) does not describe the case's requests"
            )
        if pool.fmt != case.quant.kv:
            raise ValueError(f"pool holds {pool.fmt}, the case's kv format is {case.quant.kv}")
    return DecodeInputs(
        case=case,
        q=quantise(q.float(), case.quant.q, case.quant, dev),
        kv=parts,
        pool=pool,
        qo_indptr=cu_seqlens([r.q_len for r in case.requests]).to(dev),
        out=kvcache.guarded_empty((case.total_q, h, d.kv_lora_rank), _out_dtype(case.quant), dev),
    )
