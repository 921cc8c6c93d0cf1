"""FP8 fault: bug class 7.

fp8-unit-scale (class 7): the path casts the unquantised activations to the chip's FP8 with a
    unit scale, ignoring the amax scales it was given (what vLLM's FP8 ASM prefill does with
    bf16 Q/K/V). torch's casts behave as the chips do: e4m3fn (gfx950) saturates at +-448,
    e4m3fnuz (gfx942) turns anything above 240 into NaN. Values that fit lose only rounding
    (a few e4m3 roundoffs), so the fault shows where activations exceed the format's range:
    outlier channels (the `stress` profile) under amax scales, where the judge's exact-golden
    checks see the saturated / NaN inputs.
"""

from __future__ import annotations

import torch

from mlacheck import fp8 as fp8_mod
from mlacheck import kvcache
from mlacheck.backends.base import Output
from mlacheck.backends.faults._base import Wrapper, replace_inputs, resolve_inner
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs, Quantised
from mlacheck.spec import Case, Op

FP8_OPS = (Op.DECODE, Op.PREFILL)


def unit_cast(t: Quantised) -> Quantised:
    """The unquantised values cast to the stored format with scale 1 (torch's overflow)."""
    if not fp8_mod.fmt(t.fmt).is_fp8:
        return t
    one = torch.ones((), dtype=torch.float32, device=t.stored.device)
    return Quantised(fp8_mod.quantize(t.ideal, t.fmt, 1.0).to(t.stored.device), one, t.fmt,
                     t.ideal)


class Fp8UnitScale(Wrapper):
    """Class 7: FP8 inputs re-cast from the unquantised values with a unit scale."""

    ops = FP8_OPS

    def run(self, case: Case, inputs: Inputs) -> Output:
        if isinstance(inputs, PrefillInputs):
            seen: Inputs = replace_inputs(inputs, q=unit_cast(inputs.q), k=unit_cast(inputs.k),
                                          v=unit_cast(inputs.v))
        else:
            assert isinstance(inputs, DecodeInputs)
            seen = replace_inputs(inputs, q=unit_cast(inputs.q), pool=self._pool(inputs))
        return self.inner.run(case, seen)

    @staticmethod
    def _pool(inputs: DecodeInputs) -> kvcache.KVPool:
        pool = inputs.pool
        if not fp8_mod.fmt(pool.fmt).is_fp8:
            return pool
        values = [unit_cast(kv).stored for kv in inputs.kv]
        tail = inputs.case.placement.tail_poison
        return kvcache.build_pool(values, pool.table, pool.num_pages, pool.fmt,
                                  torch.ones((), dtype=torch.float32), pool.data.device,
                                  pool.layout, pool.kind, tail)


def fp8_unit_scale(inner: str = "torch") -> Fp8UnitScale:
    return Fp8UnitScale(resolve_inner(inner), "fault:fp8-unit-scale")
