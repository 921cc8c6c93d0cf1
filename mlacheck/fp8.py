"""Element formats, FP8 quantisation emulation and scales.

Scales are dequantisation factors: real = stored * scale (per tensor, or per token = per
row of the leading dims). The overflow policy is explicit because torch's two FP8 casts
differ (torch 2.13, CPU): `.to(float8_e4m3fn)` saturates to +-448 (even +-inf), while
`.to(float8_e4m3fnuz)` gives NaN for anything that rounds above 240. A unit-scale cast (what
vLLM's FP8 ASM prefill does with bf16 Q/K/V) therefore behaves differently on gfx942
(fnuz) and gfx950 (fn): `policy="torch"` reproduces the chip, the others make it uniform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from mlacheck import formats

OverflowPolicy = Literal["torch", "saturate", "nan"]


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype
    max: float  # largest finite magnitude
    nan_bits: int  # the bit pattern we poison with (a NaN of this format)

    @property
    def bits_dtype(self) -> torch.dtype:
        """The integer view of the same width, for bit-level fills (`int_dtype`)."""
        return int_dtype(self.dtype)

    @property
    def is_fp8(self) -> bool:
        return self.dtype.itemsize == 1

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def native_overflow(self) -> str:
        """What torch's plain cast does above `max` (see module docstring)."""
        if self.name == "fp8_e4m3fnuz":
            return "nan"
        return "saturate" if self.is_fp8 else "inf"

    @property
    def eps(self) -> float:
        """Unit roundoff (half an ulp at 1.0): 2^-(mantissa bits + 1)."""
        return torch.finfo(self.dtype).eps / 2


FORMATS: dict[str, Format] = {
    # e4m3fn: S.1111.111 is NaN (0x7F / 0xFF), no inf; max 448. OCP format, gfx950 / NVIDIA.
    "fp8_e4m3fn": Format("fp8_e4m3fn", torch.float8_e4m3fn, 448.0, 0x7F),
    # e4m3fnuz: the single NaN is 0x80 (negative zero's pattern); max 240. gfx942 (MI300).
    "fp8_e4m3fnuz": Format("fp8_e4m3fnuz", torch.float8_e4m3fnuz, 240.0, 0x80),
    "bf16": Format("bf16", torch.bfloat16, 3.3895313892515355e38, 0x7FC0),
    "fp16": Format("fp16", torch.float16, 65504.0, 0x7E00),
    "fp32": Format("fp32", torch.float32, 3.4028234663852886e38, 0x7FC00000),
}


def _check_covers_formats() -> None:
    """This table and mlacheck.formats (what cases may name, torch-free) must list the same
    formats with the same widths: a format added to one only fails at import, not mid-run."""
    if set(FORMATS) != set(formats.FORMATS) or any(
            f.itemsize != formats.FORMAT_BYTES[name] for name, f in FORMATS.items()):
        raise ImportError(f"mlacheck.fp8.FORMATS {sorted(FORMATS)} does not match "
                          f"mlacheck.formats.FORMATS {sorted(formats.FORMATS)} (names and widths)")


_check_covers_formats()

# FP8 NaN encodings a kernel may meet in a poisoned pool (all of them are NaN on decode).
FP8_NAN_BYTES: dict[str, tuple[int, ...]] = {
    "fp8_e4m3fn": (0x7F, 0xFF),
    "fp8_e4m3fnuz": (0x80,),
}


def fmt(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(FORMATS)}") from None


def format_of(dtype: torch.dtype) -> str:
    """The format name of a torch dtype (what a library hands back, e.g. its FP8 dtype)."""
    for f in FORMATS.values():
        if f.dtype == dtype:
            return f.name
    raise ValueError(f"no mlacheck format is stored as {dtype}; known: {', '.join(FORMATS)}")


def chip_fp8_format(gfx: str) -> str:
    """The FP8 format a chip computes in: gfx942 (MI300) fnuz, gfx950 (MI355) and others OCP fn."""
    return "fp8_e4m3fnuz" if gfx.startswith("gfx94") else "fp8_e4m3fn"


def pick_scale(
    x: torch.Tensor, name: str, policy: str = "amax", per_token: bool = False
) -> torch.Tensor:
    """The dequantisation scale a production path would pick, in fp32.

    unit: 1 (cast as is). amax: amax / format max, so the largest value lands on the
    format's max; per token: one scale per row (last dim reduced), shape `x.shape[:-1] + (1,)`.
    Non-fp8 formats always get scale 1.
    """
    f = fmt(name)
    shape = (*x.shape[:-1], 1) if per_token else ()
    if not f.is_fp8 or policy == "unit":
        return torch.ones(shape, dtype=torch.float32, device=x.device)
    if policy != "amax":
        raise ValueError(f"unknown scale policy {policy!r}")
    xf = x.detach().float()  # max |x| as max(max x, -min x): no |x| copy of a pool-sized x
    lo, hi = xf.aminmax(dim=-1, keepdim=True) if per_token else xf.aminmax()
    # the division on the CPU: CUDA divides by a scalar as a multiply by its reciprocal,
    # which can differ in the last bit (the same case must get the same scale everywhere)
    amax = torch.maximum(hi, -lo).cpu()
    scale = amax / f.max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float32)
    return scale.to(x.device)


def quantize(
    x: torch.Tensor, name: str, scale: torch.Tensor | float = 1.0, policy: OverflowPolicy = "torch"
) -> torch.Tensor:
    """x / scale cast to the format, with an explicit overflow policy."""
    f = fmt(name)
    unit = scale == 1 if isinstance(scale, float | int) else (
        scale.dim() <= x.dim() and bool((scale == 1).all()))
    y = x.float() if unit else x.float() / scale  # x / 1 == x: no pool-sized copy
    if policy == "saturate":
        y = y.clamp(-f.max, f.max)
    elif policy == "nan":
        thr = overflow_threshold(name)
        # a tie at thr rounds to even: up (overflow) iff max's last mantissa bit is 1 (fnuz
        # 240), onto max otherwise (e4m3fn: 464 -> 448, as a non-saturating cast does)
        up = int(f.max / (2 * (thr - f.max))) % 2 == 1
        over = y.abs() >= thr if up else y.abs() > thr
        y = torch.where(over, torch.full_like(y, float("nan")), y)
    elif policy != "torch":
        raise ValueError(f"unknown overflow policy {policy!r}")
    return y.to(f.dtype)


# A KV cache written under a fixed scale (calibrated, or fixed at prefill) gets later tokens
# larger than the scale covers. Serving engines' cache writes saturate them: vLLM's
# scaled_vec_conversion is `__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, ...)`
# (csrc/quantization/fp8/nvidia/quant_utils.cuh). torch's own cast does not promise that:
# CPU torch 2.13 saturates e4m3fn, the CUDA cast of the GPU machine's torch 2.11 gave NaN
# (every FP8 e2e run on the H100 at 0%, docs/e2e.md §7), e4m3fnuz gives NaN everywhere.
CACHE_WRITE_OVERFLOW: OverflowPolicy = "saturate"


def quantize_cache_write(x: torch.Tensor, name: str, scale: torch.Tensor | float) -> torch.Tensor:
    """x stored in a KV cache of format `name` under its fixed dequantisation scale, values
    beyond the format's range saturated as a serving engine's cache write does (the same on
    every device and torch build)."""
    return quantize(x, name, scale, CACHE_WRITE_OVERFLOW)


def overflow_threshold(name: str) -> float:
    """Smallest magnitude that does not round onto the format's max (max + half an ulp there)."""
    f = fmt(name)
    ulp_at_max = 2.0 ** math.floor(math.log2(f.max)) * torch.finfo(f.dtype).eps
    return f.max + ulp_at_max / 2


def dequantize(x: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Stored values times the dequantisation scale, in fp32: what a kernel computes. Exact for
    bf16/fp16 and unit scales; an FP8 value times an amax scale can need 28 mantissa bits, so
    that product is rounded to fp32 here (the fp64 golden multiplies in fp64 instead).

    The product is taken in place on a fresh fp32 copy: the same values as `x.float() * scale`
    without a second full-size fp32 temporary (a 98k-token latent KV: 226 MB less at the
    peak of every gather)."""
    if torch.result_type(torch.empty(1), scale) != torch.float32:  # e.g. an fp64 per-token scale
        return x.float() * scale
    return x.to(torch.float32, copy=True).mul_(scale)


def round_trip(x: torch.Tensor, name: str, policy: OverflowPolicy = "torch") -> torch.Tensor:
    """Round x to the format (unit scale) and back to fp32: how a kernel rounds P or Q."""
    return quantize(x, name, 1.0, policy).float()


INT_OF_WIDTH: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                         8: torch.int64}


def int_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same width: bit-exact copies, fills and comparisons (fp8
    has no index_copy / cat / repeat kernels on every device, and NaN != NaN)."""
    return INT_OF_WIDTH[dtype.itemsize]


def as_ints(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of the same width (a view where `t` is contiguous)."""
    return t.contiguous().view(int_dtype(t.dtype))


def select_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows] (dim 0) through the integer view of x's bits: fp8 has no index_select kernel
    on every device."""
    bits = int_dtype(x.dtype)
    return x.view(bits).index_select(0, rows.to(x.device)).view(x.dtype)


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0 through the integer view (fp8 has no cat kernel everywhere)."""
    bits = int_dtype(parts[0].dtype)
    return torch.cat([p.view(bits) for p in parts]).view(parts[0].dtype)


def nan_fill_value(name: str) -> tuple[torch.dtype, int]:
    """(integer view dtype, bit pattern) that writes this format's NaN with one fill."""
    f = fmt(name)
    bits = f.nan_bits
    if f.bits_dtype == torch.int16 and bits >= 1 << 15:
        bits -= 1 << 16
    return f.bits_dtype, bits


def sentinel_value(name: str) -> float:
    """A large finite value: visible if used, harmless if a kernel only reads and masks it.

    Half the format's max (FP8: the max itself) keeps it finite after scaling by typical
    factors yet far outside any realistic activation, so a kernel that *uses* a tail
    element produces an error far above tolerance.
    """
    f = fmt(name)
    return f.max if f.is_fp8 else min(f.max / 2, 3.0e4)
