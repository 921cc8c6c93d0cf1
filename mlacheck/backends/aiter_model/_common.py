"""Shared pieces of the AITER model: environment switches, FP8 reading, errors."""

from __future__ import annotations

import os

import torch

from mlacheck import fp8
from mlacheck.backends.aiter_model.dtypes import chip_fp8
from mlacheck.backends.aiter_model.jit.utils.chip_info import get_gfx

AITER_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"
AITER_DESCRIBE = "v0.1.20-46-ge4048607a5"
PR_3606_COMMIT = "1784f4ce462c117651e216524be6ca5ed9a1ea75"

# Which AITER the model reproduces where AITER main and the LSE fix differ:
#   head   - AITER main at AITER_COMMIT: mla_prefill_ps_fwd returns the partial-LSE buffer,
#            mla_reduce_v1 skips tiles with fewer than two partials, get_ps_metadata_info_v1
#            has no max_kvlen;
#   pr3606 - ROCm/aiter#3606 (PR_3606_COMMIT): every PS work writes a partial, the reduce
#            runs for one-partial tiles too and the final LSE is returned.
REVISION_ENV = "MLACHECK_AITER_MODEL_REVISION"
REVISIONS = ("head", "pr3606")
EXPERIMENTAL_ENV = "AITER_ENABLE_EXPERIMENTAL"  # AITER's own switch (HK kernels, occupancy)


def revision() -> str:
    rev = os.environ.get(REVISION_ENV, "head").strip().lower() or "head"
    if rev not in REVISIONS:
        raise RuntimeError(f"{REVISION_ENV}={rev!r}: expected one of {', '.join(REVISIONS)}")
    return rev


def lse_fix() -> bool:
    """True when modelling ROCm/aiter#3606 (final LSE of the FP8 prefill path)."""
    return revision() == "pr3606"


def experimental_enabled() -> bool:
    """AITER's is_experimental_enabled(): AITER_ENABLE_EXPERIMENTAL parsed as int, != 0."""
    raw = os.environ.get(EXPERIMENTAL_ENV, "0").strip() or "0"
    try:
        return int(raw) != 0
    except ValueError:
        return False


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    """Any 1-byte float: AITER's C++ maps both e4m3 variants to one 'fp8' type."""
    return dtype.is_floating_point and dtype.itemsize == 1


def chip_fp8_name() -> str:
    return fp8.chip_fp8_format(get_gfx())


def as_chip_values(t: torch.Tensor) -> torch.Tensor:
    """fp32 values of `t` as the modelled chip reads its bytes.

    The kernels take raw bytes: an FP8 tensor in the other e4m3 flavour is read in the
    chip's format (e4m3fn bytes on gfx942 decode to half their value, for instance), as the
    hardware would, rather than converted.
    """
    if is_fp8_dtype(t.dtype) and t.dtype != chip_fp8():
        t = t.contiguous().view(torch.uint8).view(chip_fp8())
    return t.float()


def p_format_for(dtype: torch.dtype) -> str:
    """The format P is rounded to before the PV product, for inputs of `dtype`."""
    if is_fp8_dtype(dtype):
        return chip_fp8_name()
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def check(condition: bool, message: str) -> None:
    """AITER_CHECK: a failed C++ check surfaces in Python as RuntimeError."""
    if not condition:
        raise RuntimeError(message)


def scalar_scale(scale: torch.Tensor | None) -> float:
    """A per-tensor scale argument (fp32 [1] or 0-d) as a float; None means 1."""
    if scale is None:
        return 1.0
    if scale.numel() != 1:
        raise RuntimeError(f"per-tensor scale expected, got shape {tuple(scale.shape)}")
    return float(scale.reshape(()).item())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
