"""MLA dimensions, case types and case ids.

A case is a frozen, JSON-serialisable description of one kernel invocation. Everything
else (tensors, pools, references, verdicts) is derived from it deterministically, so a
case id is enough to reproduce a failure anywhere (`mlacheck replay <id|case.json>`).

Every case answers the same questions the same way, whatever its kind, so readers
(capabilities, footprint, boundaries, localisation, backends) need not branch on the case
type for shared facts: `op` (mlacheck.ops.Op), `units` (its segments or requests: each has
`q_len` and `kv_len`), `unit_name`, `q_lengths`, `kv_lengths`, `total_q`, `total_kv`,
`max_q_len`, `has_empty`, `paging` (page size and layout; None without a paged pool),
`visible_lengths` / `attended_lengths` (per query token: its causal window / the kv positions
it reads, a top-k's valid entries), `with_units` (the case over other units). Facts a kind may
lack are on every case with the value that means "none": `causal` (True), `soft_cap` (0),
`topk` / `valid_cap` (None), `sparse` (attention over top-k selections: False),
`requires_lse` (False). The attention ops' cases also have `page_token_values` (the values
one token takes in a page of its pool), `qk_width` and `out_width` (Dv of the output
[T, H, Dv]).

The attention ops' cases (PrefillCase, DecodeCase, SparseDecodeCase) come first; the
DeepSeek-V3.2 sparse path's (indexer logits, top-k, index conversion, sparse prefill, the path
composed: docs/sparse-pipeline.md) after them, under "sparse pipeline".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from mlacheck import layouts
from mlacheck.formats import FORMAT_BYTES, FORMATS, VECTOR_BYTES, vector_width  # noqa: F401 (re-exported)
from mlacheck.ops import OPS, Op  # noqa: F401 (re-exported: the ops, defined once there)

# --------------------------------------------------------------------------- dims

ScalePolicy = Literal["unit", "amax"]
Layout = str  # a name in mlacheck.layouts.LAYOUTS (the layouts are defined there, once)
PlacementKind = Literal["packed", "shuffled", "high"]
Profile = Literal["realistic", "stress"]
TailPoison = Literal["nan", "sentinel"]
# How a case's input tensors are distributed (mlacheck.distributions draws them; it checks that
# it defines exactly these): per-tensor stds (the default), a trained layer's shape, near-ties.
Distribution = Literal["gaussian", "layer", "ties"]
DISTRIBUTIONS: tuple[str, ...] = ("gaussian", "layer", "ties")


@dataclass(frozen=True)
class MLADims:
    """Per-head dims of one MLA layer. Defaults: DeepSeek-V2/V3/R1/V3.2."""

    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    kv_lora_rank: int = 512
    # YaRN rope scaling (DeepSeek-V3/R1: factor 40, mscale_all_dim 1.0); factor <= 1 = none.
    rope_factor: float = 40.0
    mscale_all_dim: float = 1.0

    @property
    def qk_head(self) -> int:
        """q/k width in the MHA (prefill) view: 192."""
        return self.qk_nope + self.qk_rope

    @property
    def latent(self) -> int:
        """Width of one cached latent token `[c_kv ‖ k_pe]`: 576."""
        return self.kv_lora_rank + self.qk_rope

    @property
    def softmax_scale(self) -> float:
        return softmax_scale(self)


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's `yarn_get_mscale`: 0.1 * mscale * ln(factor) + 1 (1 when no scaling)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(dims: MLADims) -> float:
    """1/sqrt(qk_nope + qk_rope) * mscale^2: the SAME scale in the MHA and absorbed views.

    DeepSeek-V3/R1 (factor 40, mscale_all_dim 1.0): 0.135234. Never 1/sqrt(576) (AITER and
    FlashMLA decode defaults) nor 1/sqrt(128) (AITER fp8 prefill default).
    """
    m = yarn_mscale(dims.rope_factor, dims.mscale_all_dim)
    return m * m / math.sqrt(dims.qk_head)


DEEPSEEK_V3 = MLADims()
NO_YARN = MLADims(rope_factor=1.0)

# --------------------------------------------------------------------------- parts


@dataclass(frozen=True)
class Quant:
    """Element formats of the inputs a kernel receives and how their scales are picked.

    `q`/`kv` are format names from `FORMATS`. For fp8 formats `scale` says how the
    dequantisation factor is chosen: "unit" (cast as is: what vLLM's FP8 ASM prefill does)
    or "amax" (amax / format max: what a calibrated path does). `per_token` scales are
    per token (row) instead of per tensor.
    """

    q: str = "bf16"
    kv: str = "bf16"
    scale: ScalePolicy = "amax"
    per_token: bool = False

    def __post_init__(self) -> None:
        for f in (self.q, self.kv):
            if f not in FORMATS:
                raise ValueError(f"unknown format {f!r}; known: {', '.join(FORMATS)}")
        if self.scale not in ("unit", "amax"):
            raise ValueError(f"scale policy must be 'unit' or 'amax', not {self.scale!r}")

    @property
    def is_fp8(self) -> bool:
        return self.q.startswith("fp8") or self.kv.startswith("fp8")

    @property
    def slug(self) -> str:
        fmt = self.q if self.q == self.kv else f"{self.q}-{self.kv}"
        fmt = fmt.replace("fp8_", "")
        if self.is_fp8:
            fmt += f"-{self.scale}" + ("-tok" if self.per_token else "")
        return fmt


# Kernels address a KV pool with 32-bit byte offsets: a signed one wraps at 2^31, an unsigned
# one at 2^32 (bug class 6). A placement may model a narrower width (`Placement.scaled`).
OFFSET_BITS = 32
MIN_OFFSET_BITS = 16


def offset_wraps(bits: int = OFFSET_BITS) -> tuple[int, int]:
    """Byte offsets where `bits`-wide offsets wrap: (signed 2^(bits-1), unsigned 2^bits)."""
    return 1 << (bits - 1), 1 << bits


@dataclass(frozen=True)
class Placement:
    """Where live KV pages sit in the pool.

    packed: pages 0..n-1 in request order; shuffled: a seeded permutation of a pool with
    `spare_pages` free pages interleaved; high: the pool is sized past `offset_bytes` and the
    live pages straddle that byte offset (half below, half above, shuffled), so 32-bit
    offset arithmetic (2^31 signed / 2^32 unsigned) is exercised by real requests.

    offset_bits: the byte-offset width the case models, 32 for every real kernel. A scale
    model (`scaled(24)`: high at 2^23 / 2^24, regions named and the planted offset-wrap
    faults wrapping at 24 bits) runs mlacheck's own class-6 detection and localisation on
    megabyte pools instead of 2 / 4 GiB ones (docs/ci.md "Test tiers"). It says nothing
    about a real kernel, which wraps at 32 bits whatever the case says.
    """

    kind: PlacementKind = "shuffled"
    offset_bytes: int = 0
    spare_pages: int = 8
    # What fills a partial last page's tail: NaN (any use or unmasked read shows) or a large
    # finite sentinel (only a kernel that *uses* the tail shows: tells reads-but-masks apart).
    tail_poison: TailPoison = "nan"
    offset_bits: int = OFFSET_BITS

    LATER_FIELDS: ClassVar[frozenset[str]] = frozenset({"offset_bits"})

    def __post_init__(self) -> None:
        if self.kind not in ("packed", "shuffled", "high"):
            raise ValueError(f"placement must be packed, shuffled or high, not {self.kind!r}")
        if self.kind == "high" and self.offset_bytes <= 0:
            raise ValueError("high placement needs offset_bytes > 0 (e.g. 2**31 or 2**32)")
        if self.tail_poison not in ("nan", "sentinel"):
            raise ValueError(f"tail_poison must be 'nan' or 'sentinel', not {self.tail_poison!r}")
        if self.spare_pages < 0:
            raise ValueError("spare_pages must be >= 0")
        if (isinstance(self.offset_bits, bool) or not isinstance(self.offset_bits, int)
                or not MIN_OFFSET_BITS <= self.offset_bits <= OFFSET_BITS):
            raise ValueError(f"offset_bits must be an integer in {MIN_OFFSET_BITS}.."
                             f"{OFFSET_BITS}, not {self.offset_bits!r}")

    def first_live_page(self, live: int, page_bytes: int) -> int:
        """The pool's first live page: 0, or for `high` the page that puts half of the `live`
        pages below offset_bytes and half above."""
        if self.kind != "high":
            return 0
        return max(0, math.ceil(self.offset_bytes / page_bytes) - live // 2)

    def pool_pages(self, kv_lens: Sequence[int], page_size: int, page_bytes: int) -> int:
        """How many pages the pool of these requests has (mlacheck.kvcache.assign_pages
        allocates exactly these; torch-free, for estimates and the matrix's expansion)."""
        live = sum(-(-n // page_size) for n in kv_lens)
        return self.first_live_page(live, page_bytes) + live + self.spare_pages

    @property
    def slug(self) -> str:
        s = f"high{self.offset_bytes.bit_length() - 1}" if self.kind == "high" else self.kind
        if self.offset_bits != OFFSET_BITS:
            s += f"-off{self.offset_bits}"
        return s + ("-sentinel" if self.tail_poison == "sentinel" else "")

    @property
    def wraps(self) -> tuple[int, int]:
        """Byte offsets where the modelled offsets wrap: (2^31 signed, 2^32 unsigned)."""
        return offset_wraps(self.offset_bits)

    def scaled(self, bits: int) -> Placement:
        """This placement in a `bits`-wide offset model: a high offset moves by the same
        factor as the wraps (2^31 / 2^32 to 2^(bits-1) / 2^bits)."""
        shift = self.offset_bits - bits
        offset = self.offset_bytes >> shift if shift >= 0 else self.offset_bytes << -shift
        return dataclasses.replace(self, offset_bits=bits, offset_bytes=offset)


@dataclass(frozen=True)
class Segment:
    """One prefill request: `q_len` new tokens attending to `context_len` cached ones + itself.

    q_len 0 is an empty segment: a repeated cu_seqlens entry, as serving engines produce for
    padded batch slots (CUDA-graph padding) or a request with nothing new this step. It has
    no output rows; a kernel must skip it without shifting the segments after it.
    """

    q_len: int
    context_len: int = 0

    @property
    def kv_len(self) -> int:
        return self.context_len + self.q_len


@dataclass(frozen=True)
class Request:
    """One decode request: `q_len` query tokens (1, or 2..4 for MTP) over `kv_len` cached ones
    (the kv includes the query tokens themselves, as in a serving engine).

    q_len 0 is an empty request (a repeated qo_indptr entry): a padded batch slot (kv_len 0,
    CUDA-graph padding) or a request whose cache is present but which decodes nothing this
    step (kv_len > 0). kv_len 0 with q_len > 0 cannot exist: the kv holds the query tokens.
    """

    q_len: int
    kv_len: int


@dataclass(frozen=True)
class Paging:
    """Paged K/V for CK-style batch prefill."""

    page_size: int = 16
    layout: Layout = layouts.LINEAR.name


# --------------------------------------------------------------------------- cases


class _Defaults:
    """Facts a kind of case may lack, on every case: a kind without the field has the value
    that means "none", so generic code reads the fact instead of asking for the case type.
    (A plain class: dataclass fields of the same names in a case keep their places.)"""

    causal: ClassVar[bool] = True  # bottom-right causal windows (a prefill may attend all)
    soft_cap: ClassVar[float] = 0.0  # the scores' tanh soft cap (0: none; a prefill field)
    topk: ClassVar[int | None] = None  # width of each query token's top-k row (None: no top-k)
    valid_cap: ClassVar[int | None] = None  # at most this many valid entries per top-k row
    # Attention over each query token's own top-k selection (the V3.2 sparse cases) instead of
    # its window: the positions a token reads are no prefix of its unit's kv, and its tokens
    # are pseudo-requests of their own (kernels and the golden take the batch whole).
    sparse: ClassVar[bool] = False


def _once(case: Any, name: str, compute: Callable[[], str]) -> str:
    """`compute()` kept on the case object under `name` (not a field: eq, hash, asdict and
    replace() ignore it); a frozen case cannot change what it derives from."""
    cached = case.__dict__.get(name)
    if cached is None:
        cached = compute()
        object.__setattr__(case, name, cached)
    return cached


@dataclass(frozen=True)
class _CaseBase(_Defaults):
    kind: ClassVar[str] = ""
    op: ClassVar[Op]
    # Fields added after the first case schema. Case ids and seeds hash the *identity*
    # JSON, which leaves such a field out while it holds its default: adding a defaulted
    # field therefore changes no existing id and no existing case's data (known-failure
    # rules, pinned ids and old replays stay valid). Every field added from now on goes here;
    # a subclass's set adds to its parents' (see `later_fields`), never replaces them. The
    # nested types (Quant, Placement, Paging, MLADims, Request, Segment) declare theirs the
    # same way, a `LATER_FIELDS` ClassVar: `identity_dict` applies it at every level.
    LATER_FIELDS: ClassVar[frozenset[str]] = frozenset()

    def to_json(self) -> str:
        """The whole case (every field): what results files record and replay reads."""
        return json.dumps(case_to_dict(self), sort_keys=True, separators=(",", ":"))

    def identity_json(self) -> str:
        """What the id and the seed hash: the case minus later fields at their defaults.

        Computed once per case object (a frozen case cannot change it): a run asks for the
        ids of every item many times over (collection, the scheduler, the results), and the
        nightly's 1446 cases spent most of a run's start here (measured: 20 s of a 37 s
        profiled two-item run)."""
        return _once(self, "_identity_json_cache", lambda: json.dumps(
            identity_dict(self), sort_keys=True, separators=(",", ":")))

    @property
    def id(self) -> str:
        """Display id: readable slug + short hash of the identity (the hash makes it unique).
        Computed once per case object, as identity_json is."""
        return _once(self, "_id_cache",
                     lambda: f"{self.slug}-{_digest(self.identity_json())[:8]}")

    @property
    def slug(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def seed_material(self) -> int:
        """Seed of the case's random data: the identity itself (same case, same data)."""
        return int(_digest(self.identity_json())[:15], 16)

    @property
    def softmax_scale(self) -> float:
        return softmax_scale(self.dims)  # type: ignore[attr-defined]

    # -- the shared facts, one shape for every kind of case

    @property
    def units(self) -> tuple[Segment, ...] | tuple[Request, ...]:
        """The independent parts of the batch: prefill segments or decode requests."""
        raise NotImplementedError  # pragma: no cover - each case type says

    @property
    def unit_name(self) -> str:
        """"segment" or "request": what a failure location names."""
        return Op(self.op).unit

    @property
    def q_lengths(self) -> tuple[int, ...]:
        return tuple(u.q_len for u in self.units)

    @property
    def kv_lengths(self) -> tuple[int, ...]:
        return tuple(u.kv_len for u in self.units)

    @property
    def total_q(self) -> int:
        return sum(self.q_lengths)

    @property
    def total_kv(self) -> int:
        return sum(self.kv_lengths)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lengths)

    @property
    def has_empty(self) -> bool:
        """Some request / segment has no query token (an empty one)."""
        return any(q == 0 for q in self.q_lengths)

    # -- facts a kind may lack (_Defaults), and what follows from the facts

    @property
    def requires_lse(self) -> bool:
        """A kernel without an LSE output cannot run this case (a prefill that asks for one).
        Decode LSEs are judged where a kernel returns one, never required."""
        return False

    @property
    def visible_lengths(self) -> tuple[int, ...]:
        """Per query token (in order), how many positions of its unit it sees: the bottom-right
        causal prefix kv_len - q_len + j + 1 (the whole unit without the causal mask)."""
        return tuple(u.kv_len - u.q_len + j + 1 if self.causal else u.kv_len
                     for u in self.units for j in range(u.q_len))

    @property
    def attended_lengths(self) -> tuple[int, ...]:
        """Per query token, how many kv positions it reads: its visible window, or with a top-k
        the valid entries of its row, min(topk, visible, valid_cap)."""
        if self.topk is None:
            return self.visible_lengths
        most = self.topk if self.valid_cap is None else min(self.topk, self.valid_cap)
        return tuple(min(most, v) for v in self.visible_lengths)

    def with_units(self: _C, units: tuple[Segment, ...] | tuple[Request, ...]) -> _C:
        """The same case over other units (one unit alone, the empty ones dropped, ...)."""
        return dataclasses.replace(self, **{_UNITS_FIELD[self.unit_name]: tuple(units)})


# The field that holds a case's units, by what a unit is called.
_UNITS_FIELD = {"segment": "segments", "request": "requests"}
_C = TypeVar("_C", bound=_CaseBase)


def _check_common(num_heads: int, seed: int, distribution: str = "gaussian") -> None:
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, "
                         f"not {distribution!r}")
    for name, v in (("num_heads", num_heads), ("seed", seed)):
        if not isinstance(v, int) or isinstance(v, bool):  # 16.0 would give another case id
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")


@dataclass(frozen=True)
class PrefillCase(_CaseBase):
    """MHA-form prefill (q/k 192, v 128) over ragged segments, optionally paged (CK batch prefill)."""

    kind: ClassVar[str] = "prefill"
    segments: tuple[Segment, ...] = (Segment(64),)
    num_heads: int = 16
    causal: bool = True
    quant: Quant = Quant()
    soft_cap: float = 0.0
    return_lse: bool = True
    paging: Paging | None = None
    placement: Placement = Placement()
    profile: Profile = "realistic"
    dims: MLADims = DEEPSEEK_V3
    seed: int = 0
    # The input distribution (mlacheck.distributions). Added after the first schema.
    distribution: Distribution = "gaussian"
    LATER_FIELDS: ClassVar[frozenset[str]] = frozenset({"distribution"})

    def __post_init__(self) -> None:
        _check_common(self.num_heads, self.seed, self.distribution)
        if not self.segments:
            raise ValueError("a prefill case needs at least one segment")
        for s in self.segments:
            if s.q_len < 0 or s.context_len < 0:
                raise ValueError(f"bad segment {s}: q_len >= 0 and context_len >= 0")
        if self.total_q < 1:
            raise ValueError("a prefill case needs at least one query token (all segments empty)")
        if self.soft_cap < 0:
            raise ValueError("soft_cap must be >= 0 (0 = off)")
        if self.paging is not None:
            if self.quant.per_token:
                raise ValueError("paged prefill takes per-tensor K/V scales (per_token is not modelled)")
            _check_page_size(self.paging.page_size)
            problem = layouts.get(self.paging.layout).page_size_problem(
                self.paging.page_size, self.quant.kv)
            if problem:
                raise ValueError(problem)

    @property
    def op(self) -> Op:  # type: ignore[override]
        return Op.PAGED_PREFILL if self.paging is not None else Op.PREFILL

    @property
    def units(self) -> tuple[Segment, ...]:
        return self.segments

    @property
    def requires_lse(self) -> bool:
        return self.return_lse

    @property
    def page_token_values(self) -> int:
        """Values per token in a page of the K pool (every head's 192-wide key)."""
        return self.num_heads * self.dims.qk_head

    @property
    def qk_width(self) -> int:
        """Per-head width of q and k, what a score's dot product runs over: 192 (MHA form)."""
        return self.dims.qk_head

    @property
    def out_width(self) -> int:
        """Dv of the output [T, H, Dv]: the per-head value width, 128."""
        return self.dims.v_head

    @property
    def slug(self) -> str:
        segs = len(self.segments)
        ctx = sum(s.context_len for s in self.segments)
        parts = [
            "pf",
            f"s{segs}",
            f"q{self.total_q}",
            f"ctx{ctx}" if ctx else "",
            f"empty{sum(s.q_len == 0 for s in self.segments)}" if self.has_empty else "",
            f"h{self.num_heads}",
            self.quant.slug,
            "causal" if self.causal else "full",
            f"cap{self.soft_cap:g}" if self.soft_cap else "",
            f"p{self.paging.page_size}{layouts.get(self.paging.layout).tag}" if self.paging else "",
            self.placement.slug if self.paging else "",
            "stress" if self.profile == "stress" else "",
            _distribution_slug(self.distribution),
        ]
        return "-".join(p for p in parts if p)


def _distribution_slug(distribution: str) -> str:
    """'' for the default (ids of cases from before the field are unchanged), else its name."""
    return "" if distribution == "gaussian" else distribution


class _Requests:
    """What decode and sparse decode cases share: requests in a paged latent pool."""

    requests: tuple[Request, ...]
    num_heads: int
    page_size: int
    quant: Quant
    seed: int
    layout: Layout
    dims: MLADims
    distribution: str
    return_lse = True  # decode always returns its LSE (not a field: no case id changes)

    def _check_decode(self) -> None:
        _check_common(self.num_heads, self.seed, self.distribution)
        _check_page_size(self.page_size)
        _check_requests(self.requests)
        _check_pool_quant(self.quant)
        problem = layouts.get(self.layout).page_size_problem(self.page_size, self.quant.kv)
        if problem:
            raise ValueError(problem)

    @property
    def _page_slug(self) -> str:
        """p16, or p16vec for another layout: linear keeps the slug it had before decode
        cases had a layout (ids are pinned)."""
        tag = "" if self.layout == layouts.LINEAR.name else layouts.get(self.layout).tag
        return f"p{self.page_size}{tag}"

    @property
    def units(self) -> tuple[Request, ...]:
        return self.requests

    @property
    def paging(self) -> Paging:
        """The latent pool's pages (every decode case is paged)."""
        return Paging(self.page_size, self.layout)

    @property
    def page_token_values(self) -> int:
        """Values per token in a page of the latent pool: [c_kv || k_pe], 576."""
        return self.dims.latent

    @property
    def qk_width(self) -> int:
        """Per-head width of q and k (the latent [c_kv || k_pe]): 576 (absorbed form)."""
        return self.dims.latent

    @property
    def out_width(self) -> int:
        """Dv of the output [T, H, Dv]: the absorbed (latent) width, 512."""
        return self.dims.kv_lora_rank

    def _batch_slug(self, kind: str) -> list[str]:
        kv = [r.kv_len for r in self.requests]
        return [
            kind,
            f"b{len(self.requests)}",
            f"mtp{self.max_q_len}" if self.max_q_len > 1 else "",
            f"kv{max(kv)}" if min(kv) == max(kv) else f"kv{min(kv)}-{max(kv)}",
            f"empty{sum(r.q_len == 0 for r in self.requests)}" if self.has_empty else "",
        ]


@dataclass(frozen=True)
class DecodeCase(_Requests, _CaseBase):
    """Absorbed-MQA decode (q 576, kv 576 latent, out 512) over a paged latent pool."""

    kind: ClassVar[str] = "decode"
    op: ClassVar[Op] = Op.DECODE
    requests: tuple[Request, ...] = (Request(1, 256),)
    num_heads: int = 16
    page_size: int = 16
    quant: Quant = Quant()
    placement: Placement = Placement()
    profile: Profile = "realistic"
    dims: MLADims = DEEPSEEK_V3
    seed: int = 0
    # How the latent pool's pages are stored (mlacheck.layouts; "latent" pages take the
    # V flavour of a vectorized layout). Added after the first schema: a later field.
    layout: Layout = layouts.LINEAR.name
    distribution: Distribution = "gaussian"  # as PrefillCase.distribution
    LATER_FIELDS: ClassVar[frozenset[str]] = frozenset({"layout", "distribution"})

    def __post_init__(self) -> None:
        self._check_decode()

    @property
    def slug(self) -> str:
        parts = [
            *self._batch_slug("dec"),
            f"h{self.num_heads}",
            self._page_slug,
            self.quant.slug,
            self.placement.slug,
            "stress" if self.profile == "stress" else "",
            _distribution_slug(self.distribution),
        ]
        return "-".join(p for p in parts if p)


@dataclass(frozen=True)
class SparseDecodeCase(_Requests, _CaseBase):
    """DeepSeek-V3.2 sparse decode: each query token attends to its own top-k kv positions.

    Token i of a request sees the causal prefix `kv_len - q_len + i + 1`; it selects
    `min(topk, visible)` positions (at most `valid_cap` when set, to get lengths < topk
    even on long contexts) and pads the rest of its `topk` row with -1.
    """

    kind: ClassVar[str] = "sparse"
    op: ClassVar[Op] = Op.SPARSE_DECODE
    sparse: ClassVar[bool] = True
    requests: tuple[Request, ...] = (Request(1, 2048),)
    topk: int = 2048
    valid_cap: int | None = None
    num_heads: int = 16
    page_size: int = 64
    quant: Quant = Quant()
    placement: Placement = Placement()
    profile: Profile = "realistic"
    dims: MLADims = DEEPSEEK_V3
    seed: int = 0
    layout: Layout = layouts.LINEAR.name  # as DecodeCase.layout
    distribution: Distribution = "gaussian"  # as PrefillCase.distribution
    LATER_FIELDS: ClassVar[frozenset[str]] = frozenset({"layout", "distribution"})

    def __post_init__(self) -> None:
        self._check_decode()
        if self.topk < 1:
            raise ValueError("topk must be >= 1")
        if self.valid_cap is not None and not 0 <= self.valid_cap <= self.topk:
            raise ValueError("valid_cap must be in [0, topk]")

    @property
    def slug(self) -> str:
        parts = [
            *self._batch_slug("sparse"),
            f"top{self.topk}",
            f"cap{self.valid_cap}" if self.valid_cap is not None else "",
            f"h{self.num_heads}",
            self._page_slug,
            self.quant.slug,
            self.placement.slug,
            _distribution_slug(self.distribution),
        ]
        return "-".join(p for p in parts if p)


# --------------------------------------------------------------------------- sparse pipeline
# DeepSeek-V3.2's sparse attention path, stage by stage, each stage an op of its own: the
# lightning indexer's logits (prefill form over keys laid end to end, decode form over a
# paged FP8 key cache), the top-k over them, request-local positions -> global KV slots,
# sparse MLA prefill, and the whole path composed (logits -> top-k -> slots -> sparse decode).
# In every stage token j of a unit (segment / request) with q_len q and kv_len n sees the
# bottom-right causal prefix of n - q + j + 1 positions of its own unit.

INDEX_HEAD_DIM = 128  # DeepSeek-V3.2 index_head_dim
INDEX_HEADS = 64  # DeepSeek-V3.2 index_n_heads
# The indexer's inputs: FP8 q with one scale per (token, head) (folded into the weights the
# kernels receive), FP8 keys with one FP32 scale per token (vLLM's indexer_k_quant_and_cache).
INDEXER_QUANT = Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax", per_token=True)
# What the stages without attention inputs declare (their inputs are FP32 logits or indices).
FP32_VALUES = Quant("fp32", "fp32")
UNPAGED = Placement()  # the placement of a case with no paged pool (read by generic code only)

TopkForm = Literal["decode", "prefill"]
LogitsProfile = Literal["distinct", "ties"]
IndexLayout = Literal["row_major", "ragged"]


class _PagedRequests:
    """Pipeline cases whose units are requests over one paged pool (the indexer-key cache
    and / or the latent pool), all read through the request's block table."""

    requests: tuple[Request, ...]
    page_size: int

    @property
    def units(self) -> tuple[Request, ...]:
        return self.requests

    @property
    def paging(self) -> Paging:
        return Paging(self.page_size)


class _NextN(_PagedRequests):
    """Pipeline cases whose requests all have one q_len (_check_next_n): next_n."""

    @property
    def next_n(self) -> int:
        return self.requests[0].q_len


def _check_units(units: tuple[Segment, ...] | tuple[Request, ...], what: str) -> None:
    if not units:
        raise ValueError(f"a {what} case needs at least one {'segment' if what == 'prefill' else 'request'}")
    for u in units:
        if u.q_len < 0 or u.kv_len < u.q_len or (isinstance(u, Segment) and u.context_len < 0):
            raise ValueError(f"bad {type(u).__name__.lower()} {u}: need 0 <= q_len <= kv_len")
    if sum(u.q_len for u in units) < 1:
        raise ValueError(f"a {what} case needs at least one query token")


def _check_next_n(requests: tuple[Request, ...]) -> None:
    """Decode-form indexer kernels take q as [batch, next_n]: one q_len >= 1 for all."""
    if len({r.q_len for r in requests}) != 1 or requests[0].q_len < 1:
        raise ValueError("every request needs the same q_len >= 1 (next_n: 1, or 2+ for MTP)")


def _check_indexer(num_heads: int, head_dim: int, quant: Quant, seed: int) -> None:
    _check_common(num_heads, seed)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be an integer >= 1, got {head_dim!r}")
    _check_index_format(quant.q)
    if quant.kv != quant.q or quant.scale != "amax" or not quant.per_token:
        raise ValueError("indexer inputs are one FP8 format for q and keys with amax scales per "
                         f"token (q per token and head): {INDEXER_QUANT}, not {quant}")


def _check_index_format(fmt_name: str) -> None:
    if fmt_name not in ("fp8_e4m3fn", "fp8_e4m3fnuz"):
        raise ValueError(f"indexer q / keys are fp8_e4m3fn or fp8_e4m3fnuz, not {fmt_name!r}")


def _check_topk(topk: int, valid_cap: int | None = None) -> None:
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
    if valid_cap is not None and not 0 <= valid_cap <= topk:
        raise ValueError("valid_cap must be in [0, topk]")


def _lengths_slug(lengths: tuple[int, ...], tag: str) -> str:
    return f"{tag}{lengths[0]}" if min(lengths) == max(lengths) else f"{tag}{min(lengths)}-{max(lengths)}"


@dataclass(frozen=True)
class IndexerCase(_CaseBase):
    """The lightning indexer's logits, prefill form (`mqa_logits`: DeepGEMM / AITER
    `fp8_mqa_logits`): the segments' keys (each segment's context, then its own tokens) laid
    end to end in one FP8 key tensor [S, head_dim] with per-token FP32 scales; query token
    j of a segment sees its segment's first context_len + j + 1 keys (the window [ks, ke)),
    every other column of its logits row is -inf.

        logits[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s] * k_scale[s])

    q is FP8 with one scale per (token, head), folded into the weights w the kernel receives
    (w = raw weight * q_scale * head_dim^-1/2 * heads^-1/2, as vLLM does)."""

    kind: ClassVar[str] = "indexer"
    op: ClassVar[Op] = Op.MQA_LOGITS
    segments: tuple[Segment, ...] = (Segment(64, 64),)
    num_heads: int = INDEX_HEADS
    head_dim: int = INDEX_HEAD_DIM
    quant: Quant = INDEXER_QUANT
    seed: int = 0
    placement: ClassVar[Placement] = UNPAGED
    paging: ClassVar[Paging | None] = None  # no paged pool

    def __post_init__(self) -> None:
        _check_indexer(self.num_heads, self.head_dim, self.quant, self.seed)
        _check_units(self.segments, "prefill")

    @property
    def units(self) -> tuple[Segment, ...]:
        return self.segments

    @property
    def slug(self) -> str:
        ctx = sum(s.context_len for s in self.segments)
        parts = ["idx", f"s{len(self.segments)}", f"q{self.total_q}", f"ctx{ctx}" if ctx else "",
                 f"empty{sum(s.q_len == 0 for s in self.segments)}" if self.has_empty else "",
                 f"h{self.num_heads}", f"d{self.head_dim}", self.quant.q.replace("fp8_", "")]
        return "-".join(p for p in parts if p)


@dataclass(frozen=True)
class PagedIndexerCase(_NextN, _CaseBase):
    """The lightning indexer's logits, decode form (`paged_mqa_logits`: DeepGEMM
    `fp8_paged_mqa_logits`, AITER `deepgemm_fp8_paged_mqa_logits`): every request has the same
    q_len (next_n: 1, or 2+ for MTP); its keys live in a paged FP8 key cache in the kernels'
    layout (a page: page_size x head_dim FP8 values, then page_size FP32 scales;
    mlacheck.indexer_cache), reached through the request's block table. Token j of a request
    of kv_len n sees its first n - next_n + j + 1 positions; logits rows are request-local
    [batch * next_n, max kv_len], -inf outside."""

    kind: ClassVar[str] = "indexer_paged"
    op: ClassVar[Op] = Op.PAGED_MQA_LOGITS
    requests: tuple[Request, ...] = (Request(1, 300),)
    num_heads: int = INDEX_HEADS
    head_dim: int = INDEX_HEAD_DIM
    page_size: int = 64
    quant: Quant = INDEXER_QUANT
    placement: Placement = Placement()
    seed: int = 0

    def __post_init__(self) -> None:
        _check_indexer(self.num_heads, self.head_dim, self.quant, self.seed)
        _check_page_size(self.page_size)
        _check_units(self.requests, "decode")
        _check_next_n(self.requests)

    @property
    def slug(self) -> str:
        parts = ["pidx", f"b{len(self.requests)}", f"n{self.next_n}" if self.next_n > 1 else "",
                 _lengths_slug(self.kv_lengths, "kv"), f"h{self.num_heads}", f"d{self.head_dim}",
                 f"p{self.page_size}", self.quant.q.replace("fp8_", ""), self.placement.slug]
        return "-".join(p for p in parts if p)


@dataclass(frozen=True)
class TopkCase(_CaseBase):
    """Top-k over indexer logits (`topk_indices`): per query row, the positions of the `topk`
    largest FP32 logits among those it sees, request-local (0 = its unit's first key), -1
    padded when it sees fewer. Rows as the indexer cases lay them out: `decode` hands the
    kernel request-local rows [tokens, max kv_len] with each row's length; `prefill` hands the
    batch-wide rows [tokens, sum kv_len] with each row's window [ks, ke) (the kernel returns
    positions relative to ks). `ties`: logits on a coarse grid, so many rows have exact ties
    at the k-th value (any choice among tied positions is correct)."""

    kind: ClassVar[str] = "topk"
    op: ClassVar[Op] = Op.TOPK
    requests: tuple[Request, ...] = (Request(1, 3000),)
    topk: int = 2048
    form: TopkForm = "decode"
    logits: LogitsProfile = "distinct"
    seed: int = 0
    num_heads: ClassVar[int] = 1
    quant: ClassVar[Quant] = FP32_VALUES
    placement: ClassVar[Placement] = UNPAGED
    paging: ClassVar[Paging | None] = None  # no paged pool

    def __post_init__(self) -> None:
        _check_common(1, self.seed)
        _check_units(self.requests, "decode")
        _check_topk(self.topk)
        if self.form not in ("decode", "prefill"):
            raise ValueError(f"form must be decode or prefill, not {self.form!r}")
        if self.logits not in ("distinct", "ties"):
            raise ValueError(f"logits must be distinct or ties, not {self.logits!r}")

    @property
    def units(self) -> tuple[Request, ...]:
        return self.requests

    @property
    def slug(self) -> str:
        parts = ["topk", f"b{len(self.requests)}", f"q{self.total_q}",
                 _lengths_slug(self.kv_lengths, "kv"),
                 f"empty{sum(r.q_len == 0 for r in self.requests)}" if self.has_empty else "",
                 f"k{self.topk}", self.form, "ties" if self.logits == "ties" else ""]
        return "-".join(p for p in parts if p)


@dataclass(frozen=True)
class IndexConversionCase(_PagedRequests, _CaseBase):
    """Request-local top-k positions -> global KV slots (`index_conversion`): per query token
    its request-local positions (-1 padded to topk, as top-k returns them; at most
    `valid_cap` valid ones when set) go through its request's block table to
    `page * page_size + offset` of the paged pool, -1 kept. `index_layout`: the buffer the
    sparse attention reads: row_major [tokens, topk] (-1 padded) or ragged (each token's
    valid slots back to back, with a [tokens + 1] indptr)."""

    kind: ClassVar[str] = Op.INDEX_CONVERSION.value  # the kind is spelt as its op
    op: ClassVar[Op] = Op.INDEX_CONVERSION
    requests: tuple[Request, ...] = (Request(1, 300),)
    topk: int = 2048
    valid_cap: int | None = None
    page_size: int = 64
    index_layout: IndexLayout = "row_major"
    placement: Placement = Placement()
    seed: int = 0
    num_heads: ClassVar[int] = 1
    quant: ClassVar[Quant] = FP32_VALUES

    def __post_init__(self) -> None:
        _check_common(1, self.seed)
        _check_page_size(self.page_size)
        _check_units(self.requests, "decode")
        _check_topk(self.topk, self.valid_cap)
        if self.index_layout not in ("row_major", "ragged"):
            raise ValueError(f"index_layout must be row_major or ragged, not {self.index_layout!r}")

    @property
    def slug(self) -> str:
        parts = ["conv", f"b{len(self.requests)}", f"q{self.total_q}",
                 _lengths_slug(self.kv_lengths, "kv"),
                 f"empty{sum(r.q_len == 0 for r in self.requests)}" if self.has_empty else "",
                 f"top{self.topk}", f"cap{self.valid_cap}" if self.valid_cap is not None else "",
                 f"p{self.page_size}", self.index_layout.replace("_", ""), self.placement.slug]
        return "-".join(p for p in parts if p)


@dataclass(frozen=True)
class SparsePrefillCase(_CaseBase):
    """Sparse MLA prefill (`mla_sparse_prefill`: FlashMLA `flash_mla_sparse_fwd`): absorbed q
    [T, H, 576], one flat latent KV [N, 1, 576] (the segments' latents laid end to end) and
    per query token `topk` global row indices into it, -1 padded (its request's visible
    positions, min(topk, visible, valid_cap) of them, in no order; `empty_rows` evenly spread
    tokens get none: output 0, LSE -inf). Outputs: out [T, H, 512], natural-log LSE and the
    max scaled score per row (max_logits)."""

    kind: ClassVar[str] = "sparse_prefill"
    op: ClassVar[Op] = Op.SPARSE_PREFILL
    sparse: ClassVar[bool] = True
    segments: tuple[Segment, ...] = (Segment(64, 192),)
    topk: int = 128
    valid_cap: int | None = None
    empty_rows: int = 0
    num_heads: int = 64
    quant: Quant = Quant("bf16", "bf16")
    profile: Profile = "realistic"
    dims: MLADims = DEEPSEEK_V3
    seed: int = 0
    placement: ClassVar[Placement] = UNPAGED
    paging: ClassVar[Paging | None] = None  # no paged pool
    return_lse: ClassVar[bool] = True  # out, LSE and max logits (not a field: no id change)

    def __post_init__(self) -> None:
        _check_common(self.num_heads, self.seed)
        _check_units(self.segments, "prefill")
        _check_topk(self.topk, self.valid_cap)
        if self.quant.q != self.quant.kv or self.quant.is_fp8:
            raise ValueError("sparse prefill takes q and latent KV in one of bf16 / fp16 / fp32, "
                             f"not {self.quant.q} / {self.quant.kv}")
        if not 0 <= self.empty_rows <= self.total_q:
            raise ValueError(f"empty_rows must be in [0, {self.total_q}] (the query tokens)")

    @property
    def units(self) -> tuple[Segment, ...]:
        return self.segments

    @property
    def slug(self) -> str:
        ctx = sum(s.context_len for s in self.segments)
        parts = ["spf", f"s{len(self.segments)}", f"q{self.total_q}", f"ctx{ctx}" if ctx else "",
                 f"top{self.topk}", f"cap{self.valid_cap}" if self.valid_cap is not None else "",
                 f"lonely{self.empty_rows}" if self.empty_rows else "", f"h{self.num_heads}",
                 self.quant.slug, "stress" if self.profile == "stress" else ""]
        return "-".join(p for p in parts if p)


@dataclass(frozen=True)
class SparsePipelineCase(_NextN, _CaseBase):
    """The DeepSeek-V3.2 decode path composed (`sparse_pipeline`): the paged indexer logits of
    every query token (next_n per request), its top-k (request-local, -1 padded), those
    positions as global slots of the paged latent pool, and sparse MLA decode over them. The
    indexer-key cache and the latent pool share one page table (vLLM's block table), as in
    serving. The verdict judges the selection tie-aware against the golden logits and the
    attention against the golden attention on the implementation's own selection."""

    kind: ClassVar[str] = Op.SPARSE_PIPELINE.value  # the kind is spelt as its op
    op: ClassVar[Op] = Op.SPARSE_PIPELINE
    sparse: ClassVar[bool] = True
    requests: tuple[Request, ...] = (Request(1, 300),)
    topk: int = 2048
    num_heads: int = 16
    index_heads: int = INDEX_HEADS
    page_size: int = 64
    quant: Quant = Quant("bf16", "bf16")
    index_fmt: str = "fp8_e4m3fn"
    placement: Placement = Placement()
    profile: Profile = "realistic"
    dims: MLADims = DEEPSEEK_V3
    seed: int = 0
    index_head_dim: ClassVar[int] = INDEX_HEAD_DIM
    layout: ClassVar[Layout] = layouts.LINEAR.name

    def __post_init__(self) -> None:
        _check_common(self.num_heads, self.seed)
        _check_common(self.index_heads, self.seed)
        _check_page_size(self.page_size)
        _check_units(self.requests, "decode")
        _check_next_n(self.requests)
        _check_pool_quant(self.quant)
        _check_topk(self.topk)
        _check_index_format(self.index_fmt)

    def attention_case(self) -> SparseDecodeCase:
        """The sparse decode stage as a case of its own (the same requests, pool and seed)."""
        return SparseDecodeCase(requests=self.requests, topk=self.topk, num_heads=self.num_heads,
                                page_size=self.page_size, quant=self.quant,
                                placement=self.placement, profile=self.profile, dims=self.dims,
                                seed=self.seed)

    def indexer_case(self) -> PagedIndexerCase:
        """The indexer stage as a case of its own (the same requests, pages and seed)."""
        fmt = self.index_fmt
        return PagedIndexerCase(requests=self.requests, num_heads=self.index_heads,
                                head_dim=self.index_head_dim, page_size=self.page_size,
                                quant=Quant(fmt, fmt, "amax", per_token=True),
                                placement=self.placement, seed=self.seed)

    @property
    def slug(self) -> str:
        parts = ["pipe", f"b{len(self.requests)}", f"n{self.next_n}" if self.next_n > 1 else "",
                 _lengths_slug(self.kv_lengths, "kv"), f"top{self.topk}", f"h{self.num_heads}",
                 f"ih{self.index_heads}", f"p{self.page_size}", self.quant.slug,
                 self.index_fmt.replace("fp8_", "idx-"), self.placement.slug,
                 "stress" if self.profile == "stress" else ""]
        return "-".join(p for p in parts if p)


# The pipeline ops (and the cases that carry them): what generic code asks to tell them
# from the attention ops.
PIPELINE_OPS: tuple[Op, ...] = (Op.MQA_LOGITS, Op.PAGED_MQA_LOGITS, Op.TOPK, Op.INDEX_CONVERSION,
                                Op.SPARSE_PREFILL, Op.SPARSE_PIPELINE)


Case = (PrefillCase | DecodeCase | SparseDecodeCase | IndexerCase | PagedIndexerCase | TopkCase
        | IndexConversionCase | SparsePrefillCase | SparsePipelineCase)
CASE_TYPES: dict[str, type] = {c.kind: c for c in (
    PrefillCase, DecodeCase, SparseDecodeCase, IndexerCase, PagedIndexerCase, TopkCase,
    IndexConversionCase, SparsePrefillCase, SparsePipelineCase)}

MAX_PAGE_SIZE = 1024  # largest page size any supported library uses (CK batch prefill)


def _check_page_size(page_size: int) -> None:
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be in 1..{MAX_PAGE_SIZE}, got {page_size}")


def _check_pool_quant(quant: Quant) -> None:
    if quant.per_token and quant.kv.startswith("fp8"):
        raise ValueError("per-token KV scales are not modelled for paged pools; use per-tensor")


def _check_requests(requests: tuple[Request, ...]) -> None:
    if not requests:
        raise ValueError("a decode case needs at least one request")
    for r in requests:
        if r.q_len < 0 or r.kv_len < r.q_len:
            raise ValueError(f"bad request {r}: need 0 <= q_len <= kv_len")
    if sum(r.q_len for r in requests) < 1:
        raise ValueError("a decode case needs at least one query token (all requests empty)")


# --------------------------------------------------------------------------- serialisation

_NESTED: dict[str, Any] = {
    "quant": Quant,
    "placement": Placement,
    "paging": Paging,
    "dims": MLADims,
}
_SEQUENCES: dict[str, type] = {"segments": Segment, "requests": Request}


def case_to_dict(case: Case) -> dict[str, Any]:
    d = dataclasses.asdict(case)
    d["kind"] = case.kind
    return d


def identity_dict(case: Case) -> dict[str, Any]:
    """case_to_dict without the later fields that still hold their defaults, at every level:
    a defaulted field added to a nested type (Quant, Placement, Request...) must not change
    existing ids and seeds either."""
    d = _identity(case)
    d["kind"] = case.kind
    return d


def _identity(value: Any) -> Any:
    """`dataclasses.asdict` (the same JSON) without each type's later fields at defaults."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        later = later_fields(type(value))
        return {f.name: _identity(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.name in later and getattr(value, f.name) == _default_of(f))}
    if isinstance(value, list | tuple):
        return [_identity(v) for v in value]
    if isinstance(value, dict):
        return {k: _identity(v) for k, v in value.items()}
    return value


def later_fields(cls: type) -> frozenset[str]:
    """The later fields of a case type and of every class it derives from: a subclass that
    names its own cannot drop a parent's (that would put it back into every id)."""
    return frozenset().union(*(vars(c).get("LATER_FIELDS", ()) for c in cls.__mro__))


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# The fields a case cannot do without: its batch. A case JSON without one would silently be
# the default batch (`dec-b1-kv256`), another case than the one meant.
REQUIRED: dict[str, tuple[str, ...]] = {
    kind: ("segments",) if any(f.name == "segments" for f in dataclasses.fields(cls))
    else ("requests",) for kind, cls in CASE_TYPES.items()}
# The fields of one segment / request: each an integer (q_len required; context_len 0).
_UNIT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "segments": (("q_len", "context_len"), ("q_len",)),
    "requests": (("q_len", "kv_len"), ("q_len", "kv_len")),
}


def case_from_dict(d: dict[str, Any]) -> Case:
    """Inverse of `case_to_dict`. Every problem of the input is found before any is raised:
    one ValueError, one line, naming each field and what it must be (required fields
    missing, unknown fields, values of the wrong type), then the case's own checks."""
    d = dict(d)
    kind = d.pop("kind", None)
    if kind not in CASE_TYPES:
        raise ValueError(f"unknown case kind {kind!r}; known: {', '.join(CASE_TYPES)}")
    cls = CASE_TYPES[kind]
    problems = field_problems(kind, d)
    if problems:
        raise ValueError(f"bad {kind} case: {'; '.join(problems)}")
    for key, sub in _NESTED.items():
        if key in d and d[key] is not None:
            d[key] = sub(**d[key])
    for key, sub in _SEQUENCES.items():
        if key in d:
            d[key] = tuple(sub(**x) if isinstance(x, dict) else sub(*x) for x in d[key])
    return cls(**d)


def field_problems(kind: str, d: dict[str, Any]) -> list[str]:
    """What is wrong with the fields of a `kind` case given as a mapping (no `kind` key):
    every problem, each naming its field (`requests[1].kv_len`) and the expected type."""
    cls = CASE_TYPES[kind]
    defaults = _defaults(cls)
    problems = [f"missing required field {k!r} (a list of [{', '.join(_UNIT_FIELDS[k][0])}] "
                "pairs)" for k in REQUIRED[kind] if k not in d]
    unknown = sorted(set(d) - set(defaults))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(unknown)} for a {kind} case; known: "
                        f"{', '.join(sorted(defaults))}")
    for key, value in d.items():
        if key in _SEQUENCES:
            problems += _unit_problems(key, value)
        elif key in _NESTED:
            if value is None and defaults[key] is None:
                continue
            if not isinstance(value, dict):
                problems.append(f"{key} must be a mapping of {_NESTED[key].__name__} fields, "
                                f"got {_shown(value)}")
                continue
            sub = _defaults(_NESTED[key])
            extra = sorted(set(value) - set(sub))
            if extra:
                problems.append(f"unknown {key} field(s) {', '.join(map(str, extra))}; "
                                f"known: {', '.join(sorted(sub))}")
            problems += [p for k, v in value.items() if k in sub
                         if (p := type_problem(f"{key}.{k}", v, sub[k]))]
        elif key in defaults:
            problem = type_problem(key, value, defaults[key])
            if problem:
                problems.append(problem)
    return problems


def _defaults(cls: type) -> dict[str, Any]:
    """Field -> default (MISSING for a required one) of a case or nested dataclass."""
    return {f.name: _default_of(f) for f in dataclasses.fields(cls)}


def _unit_problems(key: str, value: Any) -> list[str]:
    """`segments` / `requests`: a non-empty list of [a, b] pairs or {name: int} mappings."""
    names, required = _UNIT_FIELDS[key]
    if not isinstance(value, list | tuple) or not value:
        return [f"{key} must be a non-empty list of [{', '.join(names)}] pairs, got "
                f"{_shown(value)}"]
    problems = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if isinstance(item, dict):
            extra = sorted(set(item) - set(names))
            if extra:
                problems.append(f"{where}: unknown field(s) {', '.join(map(str, extra))}; "
                                f"known: {', '.join(names)}")
            problems += [f"{where}.{n} is required" for n in required if n not in item]
            fields = {n: item[n] for n in names if n in item}
        elif isinstance(item, list | tuple) and len(required) <= len(item) <= len(names):
            fields = dict(zip(names, item, strict=False))
        else:
            problems.append(f"{where} must be [{', '.join(names)}] (integers), got "
                            f"{_shown(item)}")
            continue
        problems += [p for n, v in fields.items() if (p := type_problem(f"{where}.{n}", v, 0))]
    return problems


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def type_problem(name: str, value: Any, default: Any) -> str:
    """'' when `value` has the type of the field whose default is `default`, else what is
    wrong ("kv_len must be an integer, got '37' (a string)"). bool is not an integer here:
    `16.0` or `true` for a head count would make another case id."""
    if default is None:  # an optional integer (valid_cap): null or an integer
        ok, expected = value is None or _is_int(value), "an integer or null"
    elif isinstance(default, bool):
        ok, expected = isinstance(value, bool), _TYPE_WORDS[bool]
    elif isinstance(default, int):
        ok, expected = _is_int(value), _TYPE_WORDS[int]
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        expected = _TYPE_WORDS[float]
    else:
        ok = isinstance(value, type(default))
        expected = _TYPE_WORDS.get(type(default), type(default).__name__)
    return "" if ok else f"{name} must be {expected}, got {_shown(value)}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value as the user wrote it, with its JSON type: `'37' (a string)`."""
    kind = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            list: "a list", tuple: "a list", dict: "a mapping", type(None): "null"}.get(
        type(value), type(value).__name__)
    text = repr(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


def case_from_json(text: str) -> Case:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"case is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("case JSON must be an object")
    return case_from_dict(data)


__all__ = [
    "CASE_TYPES",
    "DEEPSEEK_V3",
    "DISTRIBUTIONS",
    "FORMATS",
    "INDEXER_QUANT",
    "NO_YARN",
    "OPS",
    "Op",
    "PIPELINE_OPS",
    "Case",
    "DecodeCase",
    "IndexConversionCase",
    "IndexerCase",
    "PagedIndexerCase",
    "SparsePipelineCase",
    "SparsePrefillCase",
    "TopkCase",
    "MLADims",
    "Paging",
    "Placement",
    "PrefillCase",
    "Quant",
    "Request",
    "Segment",
    "SparseDecodeCase",
    "case_from_dict",
    "case_from_json",
    "case_to_dict",
    "softmax_scale",
]
