"""Head padding faults: bug classes (mlacheck/bugclasses.py) 5 and 12.

AITER's MLA decode kernels work in groups of 16 query heads: fewer heads must be padded to 16
before the call and the output unpadded after it (mlacheck.backends.aiter.head_padding: repeat
each head 16 // H times when H divides 16, zero heads otherwise).

pad-heads-floor-div (class 5): vLLM's `q.repeat_interleave(16 // H)` applied to every H < 16,
    unpadded with `o[:, ::16 // H]`. Right for 1, 2, 4 and 8 heads; for 12, `16 // 12 == 1`
    leaves q with 12 heads, which AITER has no kernel for (it refuses the call).
unpad-heads-slice (class 12): heads padded by repeating each one (8 -> 16: 0,0,1,1,...) but the
    output unpadded by slicing the first H heads (o[:, :H]: 0,0,1,1,2,2,3,3): right when no
    padding happens (16, 32, ...) or when padding appends zero heads (12 -> 16), wrong for
    the repeated divisors of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import fp8
from mlacheck.backends.aiter import AiterApi, HeadPadding
from mlacheck.backends.faults._base import AdapterFault, adapter
from mlacheck.spec import DecodeCase, SparseDecodeCase

MIN_HEADS = 16


@dataclass(frozen=True)
class FloorDivisionPadding(HeadPadding):
    """Pad with repeat_interleave(16 // H), unpad with [:, ::16 // H]."""

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        bits = fp8.as_ints(x)
        return bits.repeat_interleave(MIN_HEADS // self.heads, dim=1).view(x.dtype).contiguous()

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :: MIN_HEADS // self.heads]


@dataclass(frozen=True)
class SliceUnpadding(HeadPadding):
    """The right padding, unpadded by slicing the first H heads."""

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.identity else x[:, : self.heads]


class PadHeadsFloorDiv(AdapterFault):
    """Class 5: `16 // H` head padding for every H < 16."""

    def head_padding_for(self, api: AiterApi, case: DecodeCase | SparseDecodeCase
                         ) -> HeadPadding:
        right = super().head_padding_for(api, case)
        if case.num_heads >= MIN_HEADS:
            return right
        return FloorDivisionPadding(case.num_heads, right.padded)


class UnpadHeadsSlice(AdapterFault):
    """Class 12: output unpadded as o[:, :H] whatever the padding was."""

    def head_padding_for(self, api: AiterApi, case: DecodeCase | SparseDecodeCase
                         ) -> HeadPadding:
        p = super().head_padding_for(api, case)
        return SliceUnpadding(p.heads, p.padded, p.repeat)


def pad_heads_floor_div(inner: str = "aiter-model") -> AdapterFault:
    return adapter(PadHeadsFloorDiv, "fault:pad-heads-floor-div", inner)  # type: ignore[return-value]


def unpad_heads_slice(inner: str = "aiter-model") -> AdapterFault:
    return adapter(UnpadHeadsSlice, "fault:unpad-heads-slice", inner)  # type: ignore[return-value]
