"""Counterfactual diagnosis (mlacheck/counterfactual.py): a kernel that computed other
semantics than the model's is named on the first line of its card, with the residual.

The catalogue's global faults (default-softmax-scale, lse-base2, causal-top-left,
fp8-unit-scale, soft-cap-ignored) are checked on every failing case of their selftest groups
by test_localisation.py (axis `semantics`). Here, each alternative of the catalogue that no
planted fault exercises: the torch backend run on inputs rewired the way the mix-up reads
them (their scales squared, their bits read as the other FP8 format, V replaced by K's first
128 channels, the case's dims without YaRN), and the kernel that computed none of them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mlacheck import counterfactual
from mlacheck.backends.base import Output
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.harness import run_case
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs, Quantised
from mlacheck.kvcache import KVPool
from mlacheck.spec import NO_YARN, Case, DecodeCase, PrefillCase, Quant, Request, Segment
from mlacheck.verdict import FAIL, PASS

FN = Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax")
FNUZ = Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "amax")
DECODE = DecodeCase(requests=(Request(1, 40), Request(2, 70)), num_heads=16, page_size=16)
PREFILL = PrefillCase(segments=(Segment(20, 12), Segment(16, 0)), num_heads=16)


def _q(t: Quantised, scale: torch.Tensor | None = None, read_as: str | None = None) -> Quantised:
    stored = t.stored if read_as is None else t.stored.view(torch.uint8).view(_dtype(read_as))
    return Quantised(stored, t.scale if scale is None else scale, read_as or t.fmt, t.ideal)


def _pool(p: KVPool, scale: torch.Tensor | None = None, read_as: str | None = None) -> KVPool:
    data = p.data if read_as is None else p.data.view(torch.uint8).view(_dtype(read_as))
    return KVPool(data, read_as or p.fmt, p.scale if scale is None else scale, p.table, p.layout,
                  p.kind)


def _dtype(fmt: str) -> torch.dtype:
    from mlacheck import fp8

    return fp8.fmt(fmt).dtype


def _rescaled(inputs: Inputs, new) -> Inputs:  # noqa: ANN001 - scale -> scale
    if isinstance(inputs, DecodeInputs):
        return dataclasses.replace(inputs, q=_q(inputs.q, new(inputs.q.scale)),
                                   pool=_pool(inputs.pool, new(inputs.pool.scale)))
    return dataclasses.replace(inputs, q=_q(inputs.q, new(inputs.q.scale)),
                               k=_q(inputs.k, new(inputs.k.scale)),
                               v=_q(inputs.v, new(inputs.v.scale)))


def _read_as(inputs: Inputs, fmt: str) -> Inputs:
    if isinstance(inputs, DecodeInputs):
        return dataclasses.replace(inputs, q=_q(inputs.q, read_as=fmt),
                                   pool=_pool(inputs.pool, read_as=fmt))
    return dataclasses.replace(inputs, q=_q(inputs.q, read_as=fmt), k=_q(inputs.k, read_as=fmt),
                               v=_q(inputs.v, read_as=fmt))


def _v_from_k(inputs: Inputs) -> Inputs:
    assert isinstance(inputs, PrefillInputs)
    k = inputs.k
    return dataclasses.replace(inputs, v=Quantised(k.stored[..., :128], k.scale, k.fmt,
                                                   k.ideal[..., :128]))


class Rewired(TorchBackend):
    """The same-precision torch backend on inputs rewired as a mix-up reads them."""

    def __init__(self, rewire, case_change=None) -> None:  # noqa: ANN001
        super().__init__(name="rewired")
        self.rewire, self.case_change = rewire, case_change

    def run(self, case: Case, inputs: Inputs) -> Output:
        seen = self.case_change(case) if self.case_change else case
        return super().run(seen, dataclasses.replace(self.rewire(inputs), case=seen))


CATALOGUE = [
    pytest.param(dataclasses.replace(DECODE, quant=FN), Rewired(lambda i: _rescaled(
        i, lambda s: torch.ones_like(s))), "fp8-scale-ignored", id="decode-fp8-scale-ignored"),
    pytest.param(dataclasses.replace(PREFILL, quant=FN), Rewired(lambda i: _rescaled(
        i, lambda s: s * s)), "fp8-scale-twice", id="prefill-fp8-scale-twice"),
    pytest.param(dataclasses.replace(DECODE, quant=FNUZ), Rewired(lambda i: _rescaled(
        i, lambda s: 1 / s)), "fp8-scale-reciprocal", id="decode-fp8-scale-reciprocal"),
    pytest.param(dataclasses.replace(DECODE, quant=FNUZ),
                 Rewired(lambda i: _read_as(i, "fp8_e4m3fn")), "fnuz-read-as-fn",
                 id="decode-fnuz-read-as-fn"),
    pytest.param(dataclasses.replace(PREFILL, quant=FN),
                 Rewired(lambda i: _read_as(i, "fp8_e4m3fnuz")), "fn-read-as-fnuz",
                 id="prefill-fn-read-as-fnuz"),
    pytest.param(PREFILL, Rewired(lambda i: i, lambda c: dataclasses.replace(c, dims=NO_YARN)),
                 "scale-no-mscale", id="prefill-scale-no-mscale"),
    pytest.param(PREFILL, Rewired(_v_from_k), "v-from-k", id="prefill-v-from-k"),
]


@pytest.mark.parametrize(("case", "backend", "name"), CATALOGUE)
def test_each_alternative_is_named_when_the_kernel_computed_it(case: Case, backend: Rewired,
                                                               name: str) -> None:
    v = run_case(case, backend)
    assert v.status == FAIL
    first = v.summary().splitlines()[0]
    assert v.metrics.get("axis") == counterfactual.AXIS, first
    assert v.metrics["semantics"]["name"] == name, first
    assert 0 <= v.metrics["semantics"]["residual"] <= 1.0
    assert " -- semantics: the kernel matches " in first and " x the bound, " in first


def test_no_alternative_is_claimed_for_a_kernel_that_computed_none() -> None:
    """Every row off by a random 30 %: a global failure that no convention explains."""

    class Noisy(TorchBackend):
        def run(self, case: Case, inputs: Inputs) -> Output:
            res = super().run(case, inputs)
            g = torch.Generator().manual_seed(0)
            res.out.mul_(1 + 0.3 * torch.randn(res.out.shape, generator=g).to(res.out.dtype))
            return res

    v = run_case(dataclasses.replace(DECODE, quant=FN), Noisy(name="noisy"))
    assert v.status == FAIL and v.metrics.get("axis") != counterfactual.AXIS, v.summary()
    assert "no alternative semantics matches the output (tried: " in v.diagnosis, v.diagnosis
    assert "fp8-scale-twice" in v.diagnosis and "semantics" not in v.metrics


def test_a_correct_kernel_gets_no_diagnosis() -> None:
    v = run_case(dataclasses.replace(PREFILL, quant=FNUZ), TorchBackend())
    assert v.status == PASS and not v.diagnosis


def test_the_catalogue_leaves_out_what_the_case_cannot_tell() -> None:
    """Unit scales: no FP8 scale mix-up can show; no context: no causal alignment; decode:
    V is K's latent slice by definition; no soft cap: nothing to leave out."""
    from mlacheck.inputs import build

    unit = dataclasses.replace(PREFILL, segments=(Segment(8),), quant=dataclasses.replace(
        FNUZ, scale="unit"))
    names = {a.name for a in counterfactual.alternatives(unit, build(unit, "cpu"))}
    assert not names & {"fp8-scale-ignored", "fp8-scale-twice", "fp8-unit-cast",
                        "causal-top-left", "soft-cap-ignored"}
    assert {"fnuz-read-as-fn", "v-from-k", "scale-latent", "lse-base2"} <= names
    dec = {a.name for a in counterfactual.alternatives(DECODE, build(DECODE, "cpu"))}
    assert "v-from-k" not in dec and "causal-top-left" in dec
