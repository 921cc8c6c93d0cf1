"""KV pool layouts: one record per layout, read by the case spec (validation, ids), the pool
builder (`kvcache`), backend capabilities, the Hypothesis strategies and the matrix loader.

A layout says how one page of a `[pages, page_size, heads, dim]` pool is stored and how to
read it back. Adding one is a new `KVLayout` in `LAYOUTS` (and a backend that declares it).
Torch is not imported here: the transforms only call methods of the tensors they are given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlacheck.formats import VECTOR_BYTES, vector_width

Tensor = Any  # a torch.Tensor; annotated loosely so that this module needs no torch


@dataclass(frozen=True)
class KVLayout:
    name: str
    tag: str  # in case ids ("p16vec"): part of every case id, never change it
    description: str
    # page_size must be a multiple of the format's vector width
    needs_vector_pages: bool
    # (page_size, heads, dim, fmt, kind) -> the stored shape of one page; kind: latent | k | v
    page_shape: Callable[[int, int, int, str, str], tuple[int, ...]]
    # linear pages [P, ps, H, D] -> stored pages, and back (a view where the layout allows)
    store: Callable[[Tensor, str, str], Tensor]
    load: Callable[[Tensor, str], Tensor]

    def page_size_problem(self, page_size: int, fmt: str) -> str | None:
        vec = vector_width(fmt)
        if self.needs_vector_pages and page_size % vec:
            return (f"{self.name} layout needs page_size % {vec} == 0 for {fmt} "
                    f"(vec = {VECTOR_BYTES} bytes / element), got {page_size}")
        return None


def to_vectorized_k(k: Tensor, vec: int) -> Tensor:
    """[P, ps, H, D] -> CK vectorized K [P, H, D/vec, ps, vec]."""
    p, ps, h, d = k.shape
    return k.reshape(p, ps, h, d // vec, vec).permute(0, 2, 3, 1, 4).contiguous()


def from_vectorized_k(k: Tensor) -> Tensor:
    p, h, dv, ps, vec = k.shape
    return k.permute(0, 3, 1, 2, 4).reshape(p, ps, h, dv * vec)


def to_vectorized_v(v: Tensor, vec: int) -> Tensor:
    """[P, ps, H, D] -> CK vectorized V [P, H, ps/vec, D, vec]."""
    p, ps, h, d = v.shape
    return v.reshape(p, ps // vec, vec, h, d).permute(0, 3, 1, 4, 2).contiguous()


def from_vectorized_v(v: Tensor) -> Tensor:
    p, h, psv, d, vec = v.shape
    return v.permute(0, 2, 4, 1, 3).reshape(p, psv * vec, h, d)


def _vectorized_page_shape(ps: int, h: int, d: int, fmt: str, kind: str) -> tuple[int, ...]:
    vec = vector_width(fmt)
    return (h, d // vec, ps, vec) if kind == "k" else (h, ps // vec, d, vec)


LINEAR = KVLayout(
    "linear", "lin", "[pages, page_size, heads, dim], token-major (vLLM, FlashInfer, AITER MLA)",
    needs_vector_pages=False,
    page_shape=lambda ps, h, d, fmt, kind: (ps, h, d),
    store=lambda lin, fmt, kind: lin,
    load=lambda data, kind: data,
)
VECTORIZED = KVLayout(
    "vectorized", "vec",
    "CK's vectorized K [P, H, D/vec, ps, vec] / V [P, H, ps/vec, D, vec], vec = 16 bytes",
    needs_vector_pages=True,
    page_shape=_vectorized_page_shape,
    store=lambda lin, fmt, kind: (to_vectorized_k if kind == "k" else to_vectorized_v)(
        lin, vector_width(fmt)),
    load=lambda data, kind: from_vectorized_k(data) if kind == "k" else from_vectorized_v(data),
)
LAYOUTS: dict[str, KVLayout] = {x.name: x for x in (LINEAR, VECTORIZED)}
NAMES: tuple[str, ...] = tuple(LAYOUTS)


def get(name: str) -> KVLayout:
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"layout must be one of {', '.join(NAMES)}, not {name!r}") from None
