"""Counter-based random numbers: element i of a stream is a pure function of (key, i).

A case's data must be the same bits on every device and in every run (a CPU CI and a GPU
runner replay the same case), and a multi-GB case must be generated where it is used: torch's
CPU generator is sequential (one core, ~200 MB/s, then a copy to the GPU) and its CUDA
generator gives other bits. Here each element is a 32-bit integer hash of its index, turned
into a normal value through a quantile table with linear interpolation; the two outermost
intervals of that table open onto a second, finer table of the tails, so the largest values
grow with the tensor's size as a normal sample's do (about sqrt(2 ln n): 4.4 sigma at 2^16
elements, 5.3 at 2^24, up to 6.2), instead of stopping at one bound. Only integer
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
# 12 bits pick one, the low 20 bits (exact in fp32) place the value inside it.
_TABLE_BITS = 12
_FRAC_BITS = 32 - _TABLE_BITS
# The tails: interval 0 (and, mirrored, the last one) holds the probabilities below 2^-12;
# its low 20 bits f map to p = (f + 0.5) / 2^32, the probability the hash itself has (down
# to 1.2e-10: -6.33 sigma), so the tails are the normal's. f below 2^12 reads its quantile
# from a direct table; above, its top 12 bits pick an interval of a second table (relative
# width <= 1/16) and the rest interpolate, as in the body. 2 x 4096 entries, computed like
# the body's with Python floats.
_TAIL_DIRECT_BITS = 12
_TAIL_SHIFT = _FRAC_BITS - _TAIL_DIRECT_BITS  # 8: the bits interpolated above 2^12
# Elements per chunk: small on CPU (its dozen integer passes stay in cache), large on GPU.
_CPU_CHUNK = 1 << 16
_GPU_CHUNK = 1 << 26


@functools.lru_cache(maxsize=1)
def _quantiles() -> np.ndarray:
    """Normal quantiles at the probabilities j / 2^12 (j = 1 .. 2^12 - 1), fp32: interval j
    holds the probabilities [j, j + 1) / 2^12, the same share as of the hashes. The two
    outermost entries (the quantiles of 0 and 1 are infinite) are placeholders: those
    intervals are the tails (_tail_tables).

    Computed with Python's own floats (statistics.NormalDist), not a torch or numpy kernel,
    so the table is the same on every machine and library version."""
    n = 1 << _TABLE_BITS
    inv = NormalDist().inv_cdf
    ends = (inv(0.5 / n), -inv(0.5 / n))
    return np.array([ends[0], *(inv(j / n) for j in range(1, n)), ends[1]], dtype=np.float32)


@functools.lru_cache(maxsize=1)
def _tail_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(direct, base, step) of the lower tail: direct[f] for f < 2^12; for f >= 2^12 the
    value is base[f >> 8] + step[f >> 8] * (f & 255) / 256 (entries below 16 unused)."""
    inv = NormalDist().inv_cdf
    scale = 1 << _FRAC_BITS

    def q(g: float) -> float:
        return inv(g / 2.0**32)

    direct = np.array([q(f + 0.5) for f in range(1 << _TAIL_DIRECT_BITS)], dtype=np.float32)
    width = 1 << _TAIL_SHIFT
    knots = np.array([q(max(k * width, 0.5)) for k in range((scale >> _TAIL_SHIFT) + 1)],
                     dtype=np.float32)
    return direct, knots[:-1], knots[1:] - knots[:-1]


@functools.lru_cache(maxsize=8)
def _table_on(device: str, which: str) -> torch.Tensor:
    tables = {"base": lambda: _quantiles()[:-1], "steps": _steps,
              "tail_direct": lambda: _tail_tables()[0], "tail_base": lambda: _tail_tables()[1],
              "tail_steps": lambda: _tail_tables()[2]}
    return torch.from_numpy(tables[which]().copy()).to(device)


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
        tail = np.flatnonzero((j == 0) | (j == (1 << _TABLE_BITS) - 1))
        if tail.size:
            seg[tail] = _tail_numpy(x[tail])


_TOP = (1 << _TABLE_BITS) - 1
_LOW = (1 << _FRAC_BITS) - 1


def _tail_numpy(x: np.ndarray) -> np.ndarray:
    """Tail values of hashes x whose top bits pick interval 0 (lower) or the last (upper)."""
    direct, base, steps = _tail_tables()
    upper = (x >> np.uint32(_FRAC_BITS)) == _TOP
    f = (x & np.uint32(_LOW)).astype(np.int64)
    f = np.where(upper, _LOW - f, f)  # the upper tail mirrors the lower one
    k = f >> _TAIL_SHIFT
    frac = (f & ((1 << _TAIL_SHIFT) - 1)).astype(np.float32) * np.float32(2.0**-_TAIL_SHIFT)
    v = np.take(steps, k) * frac
    v += np.take(base, k)
    v = np.where(f < (1 << _TAIL_DIRECT_BITS), np.take(direct, np.minimum(f, len(direct) - 1)), v)
    return np.where(upper, -v, v).astype(np.float32)


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
        tail = torch.nonzero((j == 0) | (j == _TOP)).squeeze(1)
        if tail.numel():
            seg[tail] = _tail_torch(x[tail])


def _tail_torch(x: torch.Tensor) -> torch.Tensor:
    """_tail_numpy on int64 hashes on any device: the same operations, the same bits."""
    dev = str(x.device)
    direct, base, steps = (_table_on(dev, w) for w in ("tail_direct", "tail_base", "tail_steps"))
    upper = (x >> _FRAC_BITS) == _TOP
    f = x & _LOW
    f = torch.where(upper, _LOW - f, f)
    k = f >> _TAIL_SHIFT
    frac = (f & ((1 << _TAIL_SHIFT) - 1)).to(torch.float32).mul_(2.0**-_TAIL_SHIFT)
    v = steps[k].mul_(frac).add_(base[k])
    v = torch.where(f < (1 << _TAIL_DIRECT_BITS),
                    direct[f.clamp(max=direct.numel() - 1)], v)
    return torch.where(upper, -v, v)


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


def integers(n: int, high: int, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """n integers in [0, high) (int64) of stream `key`: the hash modulo high (bias below
    high / 2^32), the same on every device."""
    if not 0 < high <= 1 << 32:
        raise ValueError(f"high must be in 1..2^32, got {high}")
    device = torch.device(device)
    out = torch.empty(n, dtype=torch.int64, device=device)
    chunk = _CPU_CHUNK if device.type == "cpu" else _GPU_CHUNK
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        if device.type == "cpu":
            bits = torch.from_numpy(_bits_numpy(key, start, m).astype(np.int64))
        else:
            bits = _bits_torch(key, start, m, device)
        out[start : start + m] = bits % high
    return out
