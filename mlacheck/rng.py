"""Counter-based random numbers: element i of a stream is a pure function of (key, i).

A case's data must be the same bits on every device and in every run (a CPU CI and a GPU
runner replay the same case), and a multi-GB case must be generated where it is used: torch's
CPU generator is sequential (one core, ~200 MB/s, then a copy to the GPU) and its CUDA
generator gives other bits. Here each element is a 32-bit integer hash of its index, turned
into a normal value through a quantile table with linear interpolation. Only integer
operations (arithmetic mod 2^32) and single correctly rounded fp32 operations (one per call,
never fused) are used, so every implementation gives the same bits: numpy on the CPU (torch's
CPU integer kernels are 3-5x slower) and torch on a GPU, checked against each other by
tests/unit/core/test_core_rng.py.
"""

from __future__ import annotations

import functools
import hashlib
from statistics import NormalDist

import numpy as np
import torch

_M32 = (1 << 32) - 1
# A 32-bit avalanche hash of the index (xorshift-multiply, the shape of murmur3's finaliser);
# odd multipliers below 2^31, so the GPU path's int64 products of 32-bit values stay below
# 2^63 (no overflow anywhere).
_ROUNDS = ((16, 0x7FEB352D), (15, 0x5BD1E995), (16, None))
_GOLDEN = 0x9E3779B1  # folds the index's bits above 2^32 into the key word
# The quantile table: 2^12 intervals (16 KB: stays in the CPU's L1 cache); the hash's top
# 12 bits pick one, the low 20 bits (exact in fp32) place the value inside it. Values
# reach +-3.66 standard deviations; the variance is 0.998.
_TABLE_BITS = 12
_FRAC_BITS = 32 - _TABLE_BITS
# Elements per chunk: small on CPU (its dozen integer passes stay in cache), large on GPU.
_CPU_CHUNK = 1 << 16
_GPU_CHUNK = 1 << 26


@functools.lru_cache(maxsize=1)
def _quantiles() -> np.ndarray:
    """Normal quantiles at 2^12 + 1 evenly spaced probabilities inside (0, 1), fp32.

    Computed with Python's own floats (statistics.NormalDist), not a torch or numpy kernel,
    so the table is the same on every machine and library version."""
    n = 1 << _TABLE_BITS
    inv = NormalDist().inv_cdf
    return np.array([inv((j + 0.5) / (n + 1)) for j in range(n + 1)], dtype=np.float32)


@functools.lru_cache(maxsize=8)
def _table_on(device: str, which: str) -> torch.Tensor:
    table = _quantiles()[:-1] if which == "base" else _steps()
    return torch.from_numpy(table.copy()).to(device)


def stream_key(*parts: int | str) -> int:
    """A 64-bit key for one stream from anything that names it (seed, tensor name, ...)."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def _key_word(key: int, start: int) -> int:
    """The 32-bit word a chunk's indices are mixed with: the key's two halves and the index's
    bits above 2^32 (chunks are powers of two: none crosses a multiple of 2^32)."""
    return (key ^ (key >> 32) ^ ((start >> 32) * _GOLDEN)) & _M32


def _bits_numpy(key: int, start: int, n: int) -> np.ndarray:
    x = np.arange(start & _M32, (start & _M32) + n, dtype=np.uint32)
    x ^= np.uint32(_key_word(key, start))
    tmp = np.empty_like(x)
    for shift, mul in _ROUNDS:
        np.right_shift(x, shift, out=tmp)
        x ^= tmp
        if mul is not None:
            np.multiply(x, np.uint32(mul), out=x)  # mod 2^32 (unsigned wrap)
    return x


def _bits_torch(key: int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """The same bits as _bits_numpy, as int64 values in [0, 2^32)."""
    x = torch.arange(start & _M32, (start & _M32) + n, dtype=torch.int64, device=device)
    x.bitwise_xor_(_key_word(key, start))
    tmp = torch.empty_like(x)
    for shift, mul in _ROUNDS:
        torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp)
        if mul is not None:
            x.mul_(mul).bitwise_and_(_M32)
    return x


@functools.lru_cache(maxsize=1)
def _steps() -> np.ndarray:
    """Table[j + 1] - Table[j] (one fp32 rounding each, as the value is formed below)."""
    t = _quantiles()
    return t[1:] - t[:-1]


def _fill_numpy(flat: np.ndarray, key: int) -> None:
    base, steps = _quantiles()[:-1], _steps()
    frac_unit = np.float32(2.0**-_FRAC_BITS)
    low = np.uint32((1 << _FRAC_BITS) - 1)
    for start in range(0, flat.size, _CPU_CHUNK):
        n = min(_CPU_CHUNK, flat.size - start)
        x = _bits_numpy(key, start, n)
        j = (x >> np.uint32(_FRAC_BITS)).astype(np.intp)  # intp + clip: numpy's fast take
        frac = (x & low).astype(np.float32)
        frac *= frac_unit
        seg = flat[start : start + n]
        np.take(steps, j, out=seg, mode="clip")  # base + step * frac, one rounding each
        seg *= frac
        seg += np.take(base, j, mode="clip")


def _fill_torch(flat: torch.Tensor, key: int) -> None:
    base = _table_on(str(flat.device), "base")
    steps = _table_on(str(flat.device), "steps")
    for start in range(0, flat.numel(), _GPU_CHUNK):
        n = min(_GPU_CHUNK, flat.numel() - start)
        x = _bits_torch(key, start, n, flat.device)
        j = x >> _FRAC_BITS
        frac = (x & ((1 << _FRAC_BITS) - 1)).to(torch.float32).mul_(2.0**-_FRAC_BITS)
        seg = flat[start : start + n]
        torch.index_select(steps, 0, j, out=seg)
        seg.mul_(frac).add_(base[j])


def normal_(out: torch.Tensor, key: int, std: float = 1.0, *, impl: str = "auto") -> torch.Tensor:
    """Fill a contiguous fp32 tensor with (approximately) normal values of stream `key`.

    impl: "auto" (numpy on CPU, torch elsewhere), or "numpy" / "torch" to compare them."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("normal_ fills a contiguous float32 tensor")
    if impl == "auto":
        impl = "numpy" if out.device.type == "cpu" else "torch"
    if impl == "numpy":
        if out.device.type != "cpu":
            raise ValueError("the numpy implementation fills CPU tensors")
        _fill_numpy(out.view(-1).numpy(), key)
    elif impl == "torch":
        _fill_torch(out.view(-1), key)
    else:
        raise ValueError(f"unknown implementation {impl!r}")
    if std != 1.0:
        out.mul_(std)
    return out


def normal(shape: tuple[int, ...], key: int, device: torch.device | str = "cpu",
           std: float = 1.0) -> torch.Tensor:
    return normal_(torch.empty(shape, dtype=torch.float32, device=device), key, std)
