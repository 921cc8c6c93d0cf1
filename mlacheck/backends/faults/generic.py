"""Generic faults: the small numerical and bookkeeping mistakes any attention kernel can make.

perturb-row          one (token, head) output row scaled by (1 + delta): the smallest
                     corruption a per-row judge must see (sensitivity is measured with it);
default-softmax-scale sm_scale not passed: AITER decode falls back to 1/sqrt(576);
lse-base2            the LSE returned in base 2 (FlashInfer's default) instead of natural log;
causal-top-left      the causal mask aligned top-left (query i sees keys j <= i) instead of
                     bottom-right: only wrong when a segment has context (q_len < kv_len);
last-page-off-by-one kv_last_page_lens computed as kv_len % page_size: 0 for a full last
                     page, which then is not read (right whenever the last page is partial);
write-past-output    the last output tile writes one row past the output (no bounds check);
nondeterministic     the KV split count depends on the run (occupancy at launch), so equal
                     inputs give bitwise different outputs: only a determinism check sees it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mlacheck.backends.base import Backend, Capability, Output
from mlacheck.backends.faults._base import (
    AdapterFault,
    Wrapper,
    adapter,
    case_generator,
    resolve_inner,
    restrict,
    torch_only,
)
from mlacheck.backends.numerics import Numerics, flash_attend, p_format_for
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.inputs import Inputs, PrefillInputs
from mlacheck.kvcache import GUARD_ROWS
from mlacheck.spec import OPS, PIPELINE_OPS, Case, Op

PREFILL_OPS = (Op.PREFILL, Op.PAGED_PREFILL)
# The ops whose output is attention [T, H, Dv] with an LSE (the others' outputs are logits,
# selections and slots: mlacheck/backends/faults/pipeline.py plants theirs).
ATTENTION_OPS = tuple(op for op in OPS if op not in PIPELINE_OPS) + (Op.SPARSE_PREFILL,
                                                                      Op.SPARSE_PIPELINE)
DEFAULT_DELTA = 0.02  # the bf16 sensitivity target (docs/detection.md)


class PerturbRow(Wrapper):
    """One (token, head) row of the correct output scaled by (1 + delta)."""

    ops = ATTENTION_OPS

    def __init__(self, inner: Backend, name: str, delta: float = DEFAULT_DELTA) -> None:
        super().__init__(inner, name)
        self.delta = delta

    def row(self, case: Case, out: torch.Tensor) -> tuple[int, int]:
        """The row perturbed: drawn from the case's own seed (a different row per seed)."""
        gen = case_generator(case, salt=0x5EED)
        t = int(torch.randint(out.shape[0], (1,), generator=gen))
        h = int(torch.randint(out.shape[1], (1,), generator=gen))
        return t, h

    def run(self, case: Case, inputs: Inputs) -> Output:
        res = self.inner.run(case, inputs)
        t, h = self.row(case, res.out)
        res.out[t, h] = (res.out[t, h].float() * (1.0 + self.delta)).to(res.out.dtype)
        res.metadata["fault"] = f"row (token {t}, head {h}) x (1 + {self.delta:g})"
        return res


class DefaultSoftmaxScale(AdapterFault):
    """mla_decode_fwd called without sm_scale: AITER's default 1/sqrt(576) applies."""

    def rewrite(self, qualname: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        if qualname == "mla.mla_decode_fwd":
            kwargs.pop("sm_scale", None)
        return kwargs


class LseBase2(Wrapper):
    """The LSE handed back in base 2 (log2 sum 2^(s log2 e)) = natural LSE / ln 2."""

    ops = ATTENTION_OPS

    def run(self, case: Case, inputs: Inputs) -> Output:
        res = self.inner.run(case, inputs)
        if res.lse is not None:
            res.lse = res.lse / math.log(2.0)
        return res


class CausalTopLeft(TorchBackend):
    """Prefill whose causal mask is aligned top-left: query i of a segment sees kv j <= i."""

    def capabilities(self) -> dict[str, Capability]:
        return restrict(super().capabilities(), PREFILL_OPS)

    def _prefill(self, inputs: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor]:
        from mlacheck.golden.prefill import kv_tensors

        case = inputs.case
        ks, vs = kv_tensors(inputs, "exact")
        q = inputs.q.dequant()
        qc = inputs.cu_seqlens_q.tolist()
        pf = p_format_for(case.quant.kv, self.numerics)
        outs, lses = [], []
        for i in range(len(case.segments)):
            qi = q[qc[i] : qc[i + 1]]
            top_left = torch.arange(qi.shape[0], device=qi.device)  # the bug: no kv - q offset
            o, lse = flash_attend(qi, ks[i], vs[i], case.softmax_scale, case.causal, pf,
                                  self.numerics, case.soft_cap, q_positions=top_left)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


class LastPageOffByOne(AdapterFault):
    """kv_last_page_lens = kv_len % page_size: a full last page becomes an empty one."""

    fault_ops = (Op.DECODE, Op.PAGED_PREFILL)

    def rewrite(self, qualname: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        last, size = kwargs.get("kv_last_page_lens"), call_page_size(qualname, kwargs)
        if last is not None and size > 1:
            kwargs["kv_last_page_lens"] = last % size
        return kwargs


class WritePastOutput(Wrapper):
    """The last output tile writes one row too many: the row after the output is written."""

    ops = ATTENTION_OPS

    def run(self, case: Case, inputs: Inputs) -> Output:
        res = self.inner.run(case, inputs)
        full, n = inputs.out.full, res.out.shape[0]
        full[GUARD_ROWS + n] = full[GUARD_ROWS + n - 1]  # the tile's padding row, unmasked
        res.wrote_into_guarded = True
        return res


class Nondeterministic(TorchBackend):
    """Split-KV whose split count alternates between calls (as one chosen from the occupancy
    at launch would): every result is accurate, two runs differ bitwise."""

    def __init__(self, name: str) -> None:
        super().__init__(Numerics(), name)
        self.calls = 0

    def capabilities(self) -> dict[str, Capability]:
        # its spec's ops: the split count is a decode/prefill kernel's, not the sparse path's
        return restrict(super().capabilities(), tuple(op for op in ATTENTION_OPS if op not in (
            Op.SPARSE_PREFILL, Op.SPARSE_PIPELINE)))

    def run(self, case: Case, inputs: Inputs) -> Output:
        self.calls += 1
        self.numerics = Numerics(kv_block=32, splits=1 + 2 * (self.calls % 2))
        return super().run(case, inputs)


def call_page_size(qualname: str, kwargs: dict[str, Any]) -> int:
    """The page size of an AITER call: its page_size argument, or CK's K layout."""
    if qualname == "mha_batch_prefill_func":
        k = kwargs["k"]
        return int(k.shape[1]) if k.dim() == 4 else int(k.shape[3]) if k.dim() == 5 else 1
    return int(kwargs.get("page_size", 1))


# --------------------------------------------------------------------------- factories


def perturb_row(inner: str = "torch", delta: float = DEFAULT_DELTA) -> PerturbRow:
    return PerturbRow(resolve_inner(inner), "fault:perturb-row", delta)


def default_softmax_scale(inner: str = "aiter-model") -> AdapterFault:
    return adapter(DefaultSoftmaxScale, "fault:default-softmax-scale", inner)  # type: ignore[return-value]


def lse_base2(inner: str = "torch") -> LseBase2:
    return LseBase2(resolve_inner(inner), "fault:lse-base2")


def causal_top_left(inner: str = "torch") -> CausalTopLeft:
    torch_only(inner, "causal-top-left")
    return CausalTopLeft(name="fault:causal-top-left")


def last_page_off_by_one(inner: str = "aiter-model") -> AdapterFault:
    return adapter(LastPageOffByOne, "fault:last-page-off-by-one", inner)  # type: ignore[return-value]


def write_past_output(inner: str = "torch") -> WritePastOutput:
    return WritePastOutput(resolve_inner(inner), "fault:write-past-output")


def nondeterministic(inner: str = "torch") -> Nondeterministic:
    torch_only(inner, "nondeterministic")
    return Nondeterministic("fault:nondeterministic")
