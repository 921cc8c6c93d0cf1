"""Faults of graded size planted in the e2e model's attention: the doses of the
dose-response benchmark (benchmarks/e2e_dose_response.py, docs/e2e.md §8).

Each dose is a backend built around an inner one, as the fault catalogue's wrappers are
(mlacheck.backends.faults): the inner backend is the `torch` reference on a CPU and a real
kernel on a GPU, so the same fault can be planted in FlashInfer's decode as in mlacheck's own.
A few doses are planted in the torch backend's own arithmetic (`torch_only`): they change how
attention is computed, not what a kernel is handed. The catalogue's faults are reused where
one exists (perturb-row, lse-base2, fp8-unit-scale, the tile bound); the ones added here act
on what the model's serving loop hands a kernel: a real paged cache whose free memory holds
whatever the run's `tail_poison` puts there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlacheck.backends.base import Backend, Capability, Output
from mlacheck.backends.faults._base import Wrapper, replace_inputs, with_table
from mlacheck.backends.faults.boundary import TileMultipleDropsLast
from mlacheck.backends.faults.fp8 import Fp8UnitScale
from mlacheck.backends.faults.generic import LseBase2, PerturbRow
from mlacheck.backends.numerics import flash_attend
from mlacheck.backends.torch_ref import TorchBackend, split_factory
from mlacheck.inputs import DecodeInputs, Inputs
from mlacheck.kvcache import PageTable
from mlacheck.spec import OPS, Case, Op, Quant

DECODE = (Op.DECODE,)
# AITER's and FlashMLA's decode default: 1/sqrt(DeepSeek's latent width 576)
LATENT_WIDTH_SCALE = 1 / math.sqrt(576)
# the kernel-level default tile of the catalogue's tile-bound fault (never reached by the
# e2e model's sequences, which stay under 256 tokens)
LONG_TILE = 256
STALE_PAGE_INDEX = 1  # the second page of a request: always inside the prompt (> 32 tokens)

FP8 = Quant(q="fp8_e4m3fn", kv="fp8_e4m3fn", scale="amax")


class PerturbAllRows(Wrapper):
    """Every output row of every call scaled by (1 + delta): the same error as perturb-row
    on every (token, head) row instead of one."""

    ops = OPS

    def __init__(self, inner: Backend, name: str, delta: float) -> None:
        super().__init__(inner, name)
        self.delta = delta

    def run(self, case: Case, inputs: Inputs) -> Output:
        res = self.inner.run(case, inputs)
        res.out.mul_(1.0 + self.delta)
        return res


class StalePage(Wrapper):
    """One page-table entry per request left pointing at a page that now holds another
    sequence: page `index` of request r is read from page `index` of request r + 1 (cyclic),
    as a table not updated after its page was freed and handed on."""

    ops = DECODE

    def __init__(self, inner: Backend, name: str, index: int = STALE_PAGE_INDEX) -> None:
        super().__init__(inner, name)
        self.index = index

    def run(self, case: Case, inputs: Inputs) -> Output:
        assert isinstance(inputs, DecodeInputs)
        return self.inner.run(case, replace_inputs(inputs, pool=with_table(
            inputs.pool, stale_table(inputs.table, self.index))))


def stale_table(table: PageTable, index: int) -> PageTable:
    """`table` with page `index` of each request replaced by the next request's (requests
    with fewer pages, or whose neighbour has fewer, keep theirs)."""
    indices = table.indices.clone()
    counts = (table.indptr[1:] - table.indptr[:-1]).tolist()
    starts = table.indptr[:-1].tolist()
    b = len(counts)
    for r in range(b if b > 1 else 0):
        nxt = (r + 1) % b
        if counts[r] > index and counts[nxt] > index:
            indices[starts[r] + index] = table.indices[starts[nxt] + index]
    return dataclasses.replace(table, indices=indices)


class TailTimesZero(TorchBackend):
    """AITER Triton's finding 1 (docs/gpu-results.md): decode reads a partial last page
    whole and multiplies its unused tail by P = 0 instead of masking it. Right when the
    tail holds finite values; NaN in the cache's free memory turns the request's output NaN."""

    def capabilities(self) -> dict[str, Capability]:
        return {op: c for op, c in super().capabilities().items() if op in DECODE}

    def _decode_request(self, inputs: DecodeInputs, r: int, q: torch.Tensor, p_format: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        kv = inputs.pool.gather(r, whole_pages=True)  # the tail too
        n = int(inputs.table.kv_lens[r])
        live = torch.arange(kv.shape[0], device=kv.device) < n  # P = 0 past the live tokens
        pos = torch.arange(q.shape[0], device=kv.device) + n - q.shape[0]  # bottom-right
        return flash_attend(q, kv, kv[..., :inputs.case.dims.kv_lora_rank],
                            self.softmax_scale(inputs.case), True, p_format, self.numerics,
                            kv_valid=live, q_positions=pos)


class WrongDecodeScale(TorchBackend):
    """The `torch` backend with decode's softmax scale 1/sqrt(576) (a kernel's default)
    instead of the case's (the model's); prefill untouched."""

    def softmax_scale(self, case: Case) -> float:
        return LATENT_WIDTH_SCALE if case.op == Op.DECODE else case.softmax_scale


class DecodeOnlyTileDrop(TileMultipleDropsLast):
    """The catalogue's tile-bound fault on decode only: a kv length that is an exact
    multiple of `tile` drops its last `tile` keys (tile = page size: a full last page
    dropped, as kv_last_page_lens = kv_len % page_size does)."""

    ops = DECODE


@dataclass(frozen=True)
class Dose:
    """One planted fault of one size."""

    name: str
    family: str
    mechanism: str  # one line, with the size
    build: Callable[[Backend, int], Backend]  # (inner backend, page size) -> faulted backend
    torch_only: bool = False  # planted in the torch backend's arithmetic: inner must be torch
    quant: Quant | None = None  # the run's formats when the dose needs its own (FP8)
    tail_poison: str = "nan"  # what the cache's free memory holds for this run
    control: bool = False  # a correct implementation: the false-alarm control


def _perturb_row(delta: float) -> Callable[[Backend, int], Backend]:
    return lambda inner, _: PerturbRow(inner, f"perturb-row-{delta:g}", delta)


def _perturb_all(delta: float) -> Callable[[Backend, int], Backend]:
    return lambda inner, _: PerturbAllRows(inner, f"perturb-all-{delta:g}", delta)


def _tail_times_zero(inner: Backend, _: int) -> Backend:
    return TailTimesZero(name="tail-times-zero")


DOSES: tuple[Dose, ...] = (
    Dose("control-split-kv", "control", "correct: KV split in 4 chunks merged by LSE, 32-key "
         "tiles (another accumulation order)",
         lambda inner, _: split_factory(),
         torch_only=True, control=True),
    Dose("control-fp8", "control", "correct: FP8 e4m3fn q and KV cache, amax scales, P in FP8",
         lambda inner, _: inner, quant=FP8, control=True),
    *(Dose(f"perturb-row-{int(d * 100)}%", "row perturbation",
           f"one (token, head) output row per call x {1 + d:g}", _perturb_row(d))
      for d in (0.01, 0.05, 0.20)),
    *(Dose(f"perturb-all-{int(d * 100)}%", "row perturbation",
           f"every output row of every call x {1 + d:g}", _perturb_all(d))
      for d in (0.01, 0.05, 0.20, 1.0)),
    Dose("drop-full-last-page", "paging",
         "decode: a full last page is not read (kv_last_page_lens = kv_len % page_size)",
         lambda inner, ps: DecodeOnlyTileDrop(inner, "drop-full-last-page", ps)),
    Dose("stale-page", "paging",
         "decode: each request's second page read from the next request's (a stale table entry)",
         lambda inner, _: StalePage(inner, "stale-page")),
    Dose("tile-256-drops-last", "kv length boundary",
         f"decode: a kv length that is a multiple of {LONG_TILE} drops its last {LONG_TILE} "
         "keys (never reached: the model's sequences are shorter)",
         lambda inner, _: DecodeOnlyTileDrop(inner, "tile-256-drops-last", LONG_TILE)),
    Dose("lse-base2", "LSE", "the LSE returned in base 2 (the output is right)",
         lambda inner, _: LseBase2(inner, "lse-base2")),
    Dose("tail-times-zero-nan", "poisoned free memory",
         "decode reads a partial last page whole, tail x P=0 (AITER Triton finding 1); "
         "free memory holds NaN", _tail_times_zero, torch_only=True),
    Dose("tail-times-zero-finite", "poisoned free memory",
         "the same bug; free memory holds a large finite value", _tail_times_zero,
         torch_only=True, tail_poison="sentinel"),
    Dose("decode-scale-1/sqrt(576)", "softmax scale",
         "decode softmax scale 1/sqrt(576) (a kernel default) instead of the model's",
         lambda inner, _: WrongDecodeScale(name="decode-scale-1/sqrt(576)"), torch_only=True),
    Dose("fp8-unit-scale", "FP8", "FP8 q/KV re-cast from the unquantised values with scale 1 "
         "(amax scales ignored; run with FP8 q and KV)",
         lambda inner, _: Fp8UnitScale(inner, "fp8-unit-scale"), quant=FP8),
)

BY_NAME: dict[str, Dose] = {d.name: d for d in DOSES}


def planted(d: Dose, inner: Backend, page_size: int) -> tuple[Backend, Backend]:
    """(decode backend, prefill backend) of a run with dose `d` planted in `inner`: an op
    the fault does not act on stays with `inner`."""
    faulted = d.build(inner, page_size)
    caps = faulted.capabilities()
    return (faulted if Op.DECODE in caps else inner,
            faulted if Op.PREFILL in caps else inner)


def dose(name: str) -> Dose:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown dose {name!r}; known: {', '.join(BY_NAME)}") from None
