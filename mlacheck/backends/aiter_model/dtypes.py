"""Model of `aiter.dtypes`: torch dtypes by AITER's names.

`fp8` is the modelled chip's FP8 format (gfx942: float8_e4m3fnuz, gfx950: float8_e4m3fn),
looked up on each access (AITER fixes it at import) so a process can switch chips.
"""

from __future__ import annotations

import torch

from mlacheck.backends.aiter_model.jit.utils.chip_info import get_gfx

bf16 = torch.bfloat16
fp16 = torch.float16
fp32 = torch.float32
i8 = torch.int8
u8 = torch.uint8
i32 = torch.int32
i64 = torch.int64
u64 = torch.uint64

CHIP_FP8: dict[str, torch.dtype] = {
    "gfx942": torch.float8_e4m3fnuz,
    "gfx950": torch.float8_e4m3fn,
}


def chip_fp8() -> torch.dtype:
    return CHIP_FP8[get_gfx()]


def __getattr__(name: str) -> torch.dtype:
    if name == "fp8":
        return chip_fp8()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
