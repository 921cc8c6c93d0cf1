"""t-wise coverage of case features: factors, their levels, and covering arrays over them.

A bug that needs two features at once (FP8 KV and 32 heads; a soft cap and a paged pool with a
poisoned partial page; MTP and a short last KV split) escapes a matrix that covers each
feature alone: an audit found several classes reached by one or two premerge cases, never
next to FP8 or MTP. Here each op's features are factors with a few levels, read off any case
(`signature`), so a matrix's pairs (t-tuples) of levels can be counted and the uncovered ones
named (`mlacheck list --coverage --pairs MATRIX`); and a matrix group can be a covering array
over them (`covering: 2` in the YAML: every feasible pair of levels in some case), built here
by a deterministic greedy construction and realised into cases (`covering_cases`).

Pairs that no case can have are declared, with the reason, in IMPOSSIBLE (data): the rest
must be covered (tests/unit/matrices/test_matrix_pairs.py requires premerge to cover them).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlacheck import layouts
from mlacheck.spec import (
    DISTRIBUTIONS,
    PIPELINE_OPS,
    Case,
    Op,
)

DECODE, SPARSE, PREFILL, PAGED = Op.DECODE, Op.SPARSE_DECODE, Op.PREFILL, Op.PAGED_PREFILL
OPS: tuple[str, ...] = (DECODE, SPARSE, PREFILL, PAGED)

# Head counts per rank: 128 / TP for TP 1..16, the padded counts below 16, Kimi-style 48 and
# its TP-2 / TP-4 relatives 24 and 96 (AITER folds multiples of 16 into groups of 16).
HEADS: tuple[int, ...] = (8, 12, 16, 24, 32, 48, 64, 96, 128)
FORMATS: tuple[str, ...] = ("bf16", "fp16", "fp8_e4m3fn", "fp8_e4m3fnuz")
# A split-K partition (vLLM's paged attention v2, FlashDecoding) and the kv length past which
# split-KV kernels split long requests many ways.
KV_PARTITION = 512
KV_LONG = 4096
BIG_BATCH = 33  # past 32 requests: batch-indexed buffers and grids sized for <= 32
# Sparse top-k sizes from this on take several kv tiles per token (V3.2's 2048 among them;
# covering cases use 256, the named V3.2 groups 2048: every token costs topk keys).
LARGE_TOPK = 256


@dataclass(frozen=True)
class Factor:
    """One feature of a case: its levels and which level a case has (None: does not apply)."""

    name: str
    levels: tuple[str, ...]
    of: Callable[[Case], str | None]
    why: str = ""


# --------------------------------------------------------------------------- reading cases


def _heads(case: Case) -> str | None:
    return str(case.num_heads) if case.num_heads in HEADS else None


def _format(case: Case) -> str | None:
    return case.quant.kv if case.quant.kv in FORMATS else None


def _fp8(case: Case) -> str | None:
    """How an FP8 case is scaled: both amax, both unit, per token, or bf16 q over FP8 KV."""
    q = case.quant
    if not q.kv.startswith("fp8"):
        return None
    if not q.q.startswith("fp8"):
        return "kv-only"
    if q.per_token:
        return "per-token"
    return q.scale


def _page_family(case: Case) -> str | None:
    if case.paging is None:
        return None
    ps = case.paging.page_size
    if ps & (ps - 1):
        return "npot"
    return "1" if ps == 1 else "pow2" if ps <= 64 else "large"


def _layout(case: Case) -> str | None:
    return case.paging.layout if case.paging is not None else None


def _units(case: Case) -> str:
    n = len(case.units)
    return "1" if n == 1 else "2-32" if n < BIG_BATCH else "33+"


def _mtp(case: Case) -> str | None:
    lens = [n for n in case.q_lengths if n > 0]
    if max(lens) <= 1:
        return "1"
    return "uniform" if len(set(lens)) == 1 else "mixed"


def _empty(case: Case) -> str:
    return "some" if case.has_empty else "none"


def _kv(case: Case) -> str:
    top = max(case.kv_lengths)
    return "short" if top <= KV_PARTITION else "medium" if top <= KV_LONG else "long"


def _tail(case: Case) -> str | None:
    """What poisons a paged pool's partial pages (no pool: no tail)."""
    return case.placement.tail_poison if case.paging is not None else None


def _context(case: Case) -> str | None:
    """Some unit has cached context: kv past its own query tokens."""
    context = any(kv > q for q, kv in zip(case.q_lengths, case.kv_lengths, strict=True))
    return "some" if context else "none"


def _rare(case: Case) -> str | None:
    if not case.requires_lse:
        return "no-lse"
    return "no-yarn" if case.dims.rope_factor <= 1.0 else "default"


def _topk(case: Case) -> str | None:
    if case.topk is None:
        return None
    if case.valid_cap is not None and case.valid_cap < case.topk:
        return "valid-cap"
    longest = max(kv for q, kv in zip(case.q_lengths, case.kv_lengths, strict=True) if q > 0)
    return "kv>=topk" if longest >= case.topk else "kv<topk"


def _topk_size(case: Case) -> str | None:
    if case.topk is None:
        return None
    return "large" if case.topk >= LARGE_TOPK else "small"


_HEADS = Factor("heads", tuple(map(str, HEADS)), _heads,
                "head counts per rank (128 / TP, padded below 16, Kimi's 48 and kin)")
_FORMAT = Factor("format", FORMATS, _format, "the KV element format")
_DIST = Factor("distribution", DISTRIBUTIONS, lambda c: c.distribution,
               "input distribution (mlacheck.distributions)")
_PAGE = Factor("page", ("1", "pow2", "large", "npot"), _page_family,
               "page size family: 1, 2..64, 128..1024, not a power of two")
_LAYOUT = Factor("layout", layouts.NAMES, _layout, "KV page layout")
_TAIL = Factor("tail", ("nan", "sentinel"), _tail, "what poisons a partial last page's tail")
_EMPTY = Factor("empty", ("none", "some"), _empty, "q_len-0 requests / segments")
# the varlen prefill batch's factors, paged or not
_VARLEN = (
    Factor("causal", ("true", "false"), lambda c: str(c.causal).lower(), "causal mask"),
    Factor("segments", ("1", "2-32", "33+"), _units, "segments in the varlen batch"),
    Factor("context", ("none", "some"), _context, "segments with cached context"),
    _EMPTY,
    Factor("soft_cap", ("off", "on"), lambda c: "on" if c.soft_cap else "off",
           "soft-capped scores"),
)
_FP8 = Factor("fp8", ("amax", "unit", "kv-only"), _fp8, "how FP8 inputs are scaled")
_BATCH = Factor("batch", ("1", "2-32", "33+"), _units, "requests (segments) in the batch")
_MTP = Factor("mtp", ("1", "uniform", "mixed"), _mtp, "query tokens per request")

FACTORS: dict[str, tuple[Factor, ...]] = {
    DECODE: (
        _HEADS, _FORMAT,
        _FP8,
        _PAGE, _LAYOUT, _BATCH, _MTP, _EMPTY,
        Factor("kv", ("short", "medium", "long"), _kv,
               f"longest kv: <= {KV_PARTITION} (one split-K partition), <= {KV_LONG}, more"),
        _DIST, _TAIL,
    ),
    SPARSE: (
        _HEADS, _FORMAT,
        _FP8,
        _PAGE, _LAYOUT, _BATCH, _MTP, _EMPTY,
        Factor("topk", ("kv<topk", "kv>=topk", "valid-cap"), _topk,
               "sparse lengths below topk, reaching it, or capped (valid_cap)"),
        Factor("topk_size", ("small", "large"), _topk_size,
               f"topk below {LARGE_TOPK} (one or two 64-key tiles) or more (V3.2: 2048)"),
        _DIST, _TAIL,
    ),
    PREFILL: (
        _HEADS, _FORMAT,
        Factor("fp8", ("amax", "unit", "per-token", "kv-only"), _fp8,
               "how FP8 inputs are scaled"),
        *_VARLEN,
        Factor("rare", ("default", "no-lse", "no-yarn"), _rare,
               "rarely taken paths: no LSE output, the softmax scale without YaRN"),
        _DIST,
    ),
    PAGED: (
        _HEADS, _FORMAT,
        _FP8,
        *_VARLEN,
        _PAGE, _LAYOUT, _TAIL, _DIST,
    ),
}


@dataclass(frozen=True)
class Impossible:
    """Levels no valid case of `op` has together, and why."""

    ops: tuple[str, ...]
    levels: tuple[tuple[str, str], ...]  # ((factor, level), (factor, level))
    reason: str


_NOT_FP8 = "bf16 / fp16 inputs have no FP8 scale policy"
IMPOSSIBLE: tuple[Impossible, ...] = (
    *(Impossible(OPS, (("format", f), ("fp8", p)), _NOT_FP8)
      for f in ("bf16", "fp16") for p in ("amax", "unit", "per-token", "kv-only")),
    Impossible((DECODE, SPARSE, PAGED), (("layout", "vectorized"), ("page", "1")),
               "a vectorized page packs 16 bytes per vector along the page: page size 1 has "
               "no room for one (layouts.page_size_problem)"),
    Impossible((DECODE, SPARSE), (("batch", "1"), ("empty", "some")),
               "a batch of one empty request has no query token (not a valid case)"),
    Impossible((DECODE, SPARSE), (("batch", "1"), ("mtp", "mixed")),
               "mixed query lengths need two requests"),
    Impossible((PREFILL, PAGED), (("segments", "1"), ("empty", "some")),
               "a batch of one empty segment has no query token (not a valid case)"),
)

Level = tuple[str, str]  # (factor, level)


def factors(op: str) -> tuple[Factor, ...]:
    try:
        return FACTORS[op]
    except KeyError:
        raise ValueError(f"no factors for op {op!r}; known: {', '.join(FACTORS)}") from None


def signature(case: Case) -> dict[str, str]:
    """The levels a case has, factor by factor (factors that do not apply left out). The
    sparse-pipeline ops (spec.PIPELINE_OPS) have no factors here: none."""
    if case.op in PIPELINE_OPS:
        return {}
    out = {}
    for f in factors(case.op):
        level = f.of(case)
        if level is not None:
            out[f.name] = level
    return out


@functools.cache
def _forbidden(op: str) -> frozenset[frozenset[Level]]:
    return frozenset(frozenset(i.levels) for i in IMPOSSIBLE if op in i.ops)


def impossible_reason(op: str, combo: Iterable[Level]) -> str | None:
    """Why these levels cannot occur together in a case of `op` (None: they can)."""
    s = set(combo)
    for i in IMPOSSIBLE:
        if op in i.ops and set(i.levels) <= s:
            return i.reason
    return None


def required(op: str, strength: int = 2) -> list[tuple[Level, ...]]:
    """Every t-tuple of levels (of distinct factors, in factor order) a case of `op` can have."""
    fs = factors(op)
    out = []
    for group in itertools.combinations(fs, strength):
        for values in itertools.product(*(f.levels for f in group)):
            combo = tuple((f.name, v) for f, v in zip(group, values, strict=True))
            if not _contains_forbidden(op, combo):
                out.append(combo)
    return out


def _contains_forbidden(op: str, combo: Sequence[Level]) -> bool:
    forbidden = _forbidden(op)
    return any(frozenset(p) in forbidden for p in itertools.combinations(combo, 2))


def covered(cases: Iterable[Case], op: str, strength: int = 2) -> set[tuple[Level, ...]]:
    names = [f.name for f in factors(op)]
    seen: set[tuple[Level, ...]] = set()
    for case in cases:
        if case.op != op:
            continue
        sig = signature(case)
        present = [(n, sig[n]) for n in names if n in sig]
        seen.update(itertools.combinations(present, strength))
    return seen


def uncovered(cases: Iterable[Case], op: str, strength: int = 2) -> list[tuple[Level, ...]]:
    """The feasible t-tuples of `op` that no case covers, in factor order."""
    have = covered(cases, op, strength)
    return [c for c in required(op, strength) if c not in have]


def impossible_count(op: str, strength: int = 2) -> int:
    """t-tuples of `op` excluded because they contain an impossible pair."""
    fs = factors(op)
    n = 0
    for group in itertools.combinations(fs, strength):
        for values in itertools.product(*(f.levels for f in group)):
            n += _contains_forbidden(op, tuple((f.name, v) for f, v in
                                               zip(group, values, strict=True)))
    return n


# --------------------------------------------------------------------------- input scales

# The closest two per-tensor FP8 scales of a case must differ by this factor: a kernel that
# dequantises one tensor with the other's scale is then wrong by >= 40 % on every row, far
# past any FP8 row bound (~6-12 %). Equal scales (the old unit-variance inputs: q / kv
# 0.98-1.00 on every premerge case) hide such a mix-up entirely.
MIN_SCALE_SPREAD = 1.4


@dataclass(frozen=True)
class ScaleReport:
    case_id: str
    scales: dict[str, float]  # tensor -> dequantisation scale (per token: the median row's)
    spread: float | None  # closest two FP8 per-tensor amax scales, larger / smaller
    whole: bool  # every tensor measured whole (else its leading rows)
    why_none: str = ""

    @property
    def text(self) -> str:
        vals = " ".join(f"{k} {v:.3g}" for k, v in self.scales.items())
        spread = f"closest {self.spread:.2f}x" if self.spread is not None else self.why_none
        return f"{vals}  {spread}" + ("" if self.whole else " (leading rows)")


def scale_report(case: Case) -> ScaleReport:
    """The FP8 scales a case's quantised inputs get and how far apart they are."""
    from mlacheck import inputs  # torch: only where scales are asked for

    if case.op in PIPELINE_OPS:  # no MLA q / kv: their inputs are mlacheck/pipeline_inputs.py's
        return ScaleReport(case.id, {}, None, True, "sparse-pipeline op (not measured here)")
    scales, whole = inputs.input_scales(case)
    fp8 = {name: v for name, v in scales.items()
           if (case.quant.q if name == "q" else case.quant.kv).startswith("fp8")}
    why = ""
    if case.quant.scale == "unit":
        why = "unit scales (no per-tensor scale to mix up)"
    elif case.quant.per_token:
        why = "per-token scales (medians shown)"
    elif len(fp8) < 2:
        why = "one FP8 tensor"
    spread = None
    if not why:
        spread = min(max(a, b) / min(a, b) for a, b in itertools.combinations(fp8.values(), 2))
    return ScaleReport(case.id, scales, spread, whole, why)


# --------------------------------------------------------------------------- construction


# Rows built once are stored next to the matrices (one JSON file per op, strength and seed,
# named by the digest of what they were built from): loading a matrix reads them instead of
# building them again (seconds for 3-wise). `python -m mlacheck.coverage` rewrites them;
# tests/unit/matrices/test_matrix_pairs.py checks that they are current.
STORE = Path(__file__).parent / "matrices" / "covering"
# Candidate rows the greedy construction compares per row (more: smaller arrays, slower).
CANDIDATES = {2: 12, 3: 3}
CONSTRUCTION = "greedy-aetg-1"  # change when the algorithm changes: stored rows are rebuilt


def covering_array(op: str, strength: int = 2, seed: int = 0) -> list[dict[str, str]]:
    """Rows (factor -> level) covering every feasible t-tuple of `op`'s levels, none with an
    impossible pair: the stored rows when they were built from the current factors, else
    built now (construct)."""
    stored = _stored(op, strength, seed)
    rows = stored if stored is not None else construct(op, strength, seed)
    return [dict(r) for r in rows]


def store_path(op: str, strength: int, seed: int) -> Path:
    return STORE / f"{op}-t{strength}-s{seed}.json"


def digest(op: str, strength: int, seed: int) -> str:
    """What the rows are a function of: the factors, their levels, the impossible pairs, the
    construction and its parameters."""
    parts = [CONSTRUCTION, op, strength, seed, CANDIDATES[strength],
             [(f.name, f.levels) for f in factors(op)],
             sorted(sorted(i.levels) for i in IMPOSSIBLE if op in i.ops)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=32)
def _stored(op: str, strength: int, seed: int) -> tuple[tuple[Level, ...], ...] | None:
    try:
        doc = json.loads(store_path(op, strength, seed).read_text())
    except (OSError, ValueError):
        return None
    if doc.get("digest") != digest(op, strength, seed):
        return None
    names = [f.name for f in factors(op)]
    return tuple(tuple((n, row[n]) for n in names if n in row) for row in doc["rows"])


def write_stored(op: str, strength: int, seed: int = 0) -> Path:
    """Build the rows and store them (what `python -m mlacheck.coverage` does)."""
    rows = construct(op, strength, seed)
    path = store_path(op, strength, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = ",\n".join("  " + json.dumps(dict(r)) for r in rows)
    path.write_text(f'{{"digest": "{digest(op, strength, seed)}", "op": "{op}", '
                    f'"strength": {strength}, "seed": {seed},\n "rows": [\n{body}\n]}}\n')
    _stored.cache_clear()
    return path


@functools.lru_cache(maxsize=16)
def construct(op: str, strength: int = 2, seed: int = 0) -> tuple[tuple[Level, ...], ...]:
    """Greedy (AETG-style): each row starts from an uncovered tuple and adds, factor by factor
    in a shuffled order, the level that completes most uncovered tuples (ties: the level used
    least so far); the best of CANDIDATES[strength] rows is kept. Deterministic per seed."""
    candidates = CANDIDATES[strength]
    fs = factors(op)
    names = [f.name for f in fs]
    order = {n: i for i, n in enumerate(names)}
    todo = set(required(op, strength))
    rnd = random.Random(seed)
    used: dict[Level, int] = {}
    rows: list[tuple[Level, ...]] = []
    while todo:
        pending = sorted(todo)
        best: dict[str, str] | None = None
        best_gain = -1
        for _ in range(candidates):
            start = pending[rnd.randrange(len(pending))]
            row = dict(start)
            rest = [n for n in names if n not in row]
            rnd.shuffle(rest)
            for name in rest:
                f = fs[order[name]]
                scored = []
                for level in f.levels:
                    if any(frozenset({(name, level), (m, v)}) in _forbidden(op)
                           for m, v in row.items()):
                        continue
                    gain = _gain(row, (name, level), todo, strength, order)
                    scored.append((-gain, used.get((name, level), 0), f.levels.index(level),
                                   level))
                if scored:  # none: the factor does not apply (e.g. fp8 scaling of bf16)
                    row[name] = min(scored)[3]
            gain = _row_cover(row, todo, strength, order)
            if gain > best_gain:
                best, best_gain = row, gain
        assert best is not None and best_gain > 0
        items = tuple(sorted(best.items(), key=lambda kv: order[kv[0]]))
        rows.append(items)
        for lv in items:
            used[lv] = used.get(lv, 0) + 1
        todo -= set(itertools.combinations(items, strength))
    return tuple(rows)


def _gain(row: dict[str, str], new: Level, todo: set[tuple[Level, ...]], strength: int,
          order: dict[str, int]) -> int:
    """Uncovered tuples completed by adding `new` to the levels already in `row`."""
    have = list(row.items())
    n = 0
    for others in itertools.combinations(have, strength - 1):
        combo = tuple(sorted((*others, new), key=lambda kv: order[kv[0]]))
        n += combo in todo
    return n


def _row_cover(row: dict[str, str], todo: set[tuple[Level, ...]], strength: int,
               order: dict[str, int]) -> int:
    items = sorted(row.items(), key=lambda kv: order[kv[0]])
    return sum(c in todo for c in itertools.combinations(items, strength))


# --------------------------------------------------------------------------- realisation
# A row of levels becomes a case: the lengths are built to have exactly the row's levels
# (tests check signature(case) == row) and to stay cheap (WORK_BUDGET; premerge's CPU budget
# is a test in tests/unit/matrices/test_matrix_pairs.py).

# Score rows x keys one case may compute (query rows x heads x keys seen): ~0.1 s of CPU per
# reference at the largest. Lengths are halved (never below what a level needs) past it.
WORK_BUDGET = 1 << 19
# Pools of a paged prefill case stay below this (K and V: page x heads x 192 x bytes).
PAGED_POOL_BUDGET = 64 << 20
# Short kv lengths, around tiles (63 / 129 / 257 / 385 / 449 / 511 are one off a multiple of
# 64 or 128), all within one split-K partition.
_SHORT_KV = (63, 129, 200, 257, 300, 385, 449, 511)
_MEDIUM_KV = (1025, 2049, 3073)  # one past a multiple of 64: short last tile for MTP
_LONG_KV = 4161  # 65 x 64 + 1: past KV_LONG


def covering_cases(op: str, strength: int = 2, seed: int = 0) -> list[dict[str, Any]]:
    """The covering array of `op`, each row realised as case fields (spec.case_from_dict,
    without `kind`)."""
    realise = _REALISERS[op]
    return [realise(row, i) for i, row in enumerate(covering_array(op, strength, seed))]


def _quant(row: dict[str, str], r: int) -> dict[str, Any]:
    fmt, how = row["format"], row.get("fp8")
    if how is None:
        return {"q": fmt, "kv": fmt}
    if how == "kv-only":
        return {"q": "bf16", "kv": fmt, "scale": ("amax", "unit")[r % 2]}
    if how == "per-token":
        return {"q": fmt, "kv": fmt, "scale": "amax", "per_token": True}
    return {"q": fmt, "kv": fmt, "scale": how}


def _pick_page_size(row: dict[str, str], r: int, kv_fmt: str, largest: int = 1024) -> int:
    family, layout = row["page"], row.get("layout", "linear")
    vectorized = layout != "linear"
    if family == "1":
        return 1
    if family == "pow2":
        return (16, 64, 32)[r % 3]
    if family == "large":
        return max(128, min(largest, (1024, 256, 512)[r % 3]))
    vec = 16 // (1 if kv_fmt.startswith("fp8") else 2)
    choices = (48, 80) if vectorized else (53, 48, 100)  # not powers of two (vec divides 48, 80)
    size = choices[r % len(choices)]
    return size if size % vec == 0 or not vectorized else 48


def _pick_q_lens(row: dict[str, str], n: int, r: int, heads: int) -> list[int]:
    """Query tokens per request for the row's MTP level; few where the batch or the head
    count is large (the output, and the judge's work, grows with tokens x heads)."""
    mtp = row.get("mtp", "1")
    big = n >= BIG_BATCH or heads >= 64
    if mtp == "1":
        return [1] * n
    if mtp == "uniform":
        return [2 if big else 2 + r % 3] * n
    if big:  # ones and twos, one request at 4
        lens = [1 + (i % 4 == 1) for i in range(n)]
        lens[-1] = 4
        return lens
    lens = [1 + (i + r) % 4 for i in range(n)]
    if len(set(lens)) == 1:  # n == 1 cannot be mixed (an impossible pair); keep two lengths
        lens[-1] = 1 if lens[0] > 1 else 2
    return lens


def _unit_count(row: dict[str, str], key: str, r: int) -> int:
    return {"1": 1, "2-32": 3 + r % 3, "33+": BIG_BATCH}[row[key]]


def _add_empty(pairs: list[list[int]], first: int, last: int) -> list[list[int]]:
    """Empty units (q_len 0) before and after the others, holding `first` / `last` cached
    tokens (a padded slot, a request decoding nothing this step)."""
    return [[0, first], *pairs, [0, last]]


def _shrink(pairs: list[list[int]], heads: int, fixed: set[int], cap: int | None = None
            ) -> None:
    """Halve the kv of units not in `fixed` until the case's work (query rows x keys each
    sees, at most `cap` of them: sparse top-k) fits WORK_BUDGET."""
    def work() -> int:
        return sum(q * heads * (kv if cap is None else min(kv, cap)) for q, kv in pairs)
    for _ in range(8):
        if work() <= WORK_BUDGET:
            return
        for i, (q, kv) in enumerate(pairs):
            if i not in fixed and q > 0:
                pairs[i][1] = max(q, kv // 2 + 1)


def _decode_requests(row: dict[str, str], r: int, heads: int) -> list[list[int]]:
    n = _unit_count(row, "batch", r)
    qs = _pick_q_lens(row, n, r, heads)
    pairs = [[q, max(q, _SHORT_KV[(3 * i + r) % len(_SHORT_KV)])] for i, q in enumerate(qs)]
    mtp_at = next((i for i, q in enumerate(qs) if q > 1), None)
    key = mtp_at if mtp_at is not None else n // 2
    regime = row["kv"]
    if regime == "medium":
        pairs[key][1] = _MEDIUM_KV[r % len(_MEDIUM_KV)]
    elif regime == "long":
        pairs[key][1] = _LONG_KV
    elif mtp_at is not None:
        pairs[key][1] = 449  # 7 x 64 + 1: the MTP request's last tile has one key
    _shrink(pairs, heads, {key})
    return _add_empty(pairs, 0, 40) if row["empty"] == "some" else pairs


def _realise_decode(row: dict[str, str], r: int) -> dict[str, Any]:
    heads = int(row["heads"])
    quant = _quant(row, r)
    return {
        "requests": _decode_requests(row, r, heads), "num_heads": heads, "quant": quant,
        "page_size": _pick_page_size(row, r, quant["kv"]), "layout": row["layout"],
        "distribution": row["distribution"], "placement": {"tail_poison": row["tail"]},
    }


def _realise_sparse(row: dict[str, str], r: int) -> dict[str, Any]:
    heads = int(row["heads"])
    quant = _quant(row, r)
    topk = LARGE_TOPK if row["topk_size"] == "large" else (64, 128)[r % 2]
    n = _unit_count(row, "batch", r)
    qs = _pick_q_lens(row, n, r, heads)
    # most requests below topk; the first and the last carry the row's topk level
    pairs = [[q, max(q, _SHORT_KV[(3 * i + r) % len(_SHORT_KV)] * topk // 512)]
             for i, q in enumerate(qs)]
    fields: dict[str, Any] = {}
    regime = row["topk"]
    if regime == "kv<topk":
        pairs[0][1] = max(qs[0], topk - 1)
    else:
        pairs[0][1] = topk if regime == "kv>=topk" else topk + 1 + r
        pairs[-1][1] = max(pairs[-1][1], topk + 1)
        if regime == "valid-cap":
            fields["valid_cap"] = (topk // 2, 0, topk - 1)[r % 3]
    _shrink(pairs, heads, {0, n - 1}, cap=topk)
    if row["empty"] == "some":
        pairs = _add_empty(pairs, 0, min(300, topk - 1))
    return {
        "requests": pairs, "topk": topk, "num_heads": heads, "quant": quant,
        "page_size": _pick_page_size(row, r, quant["kv"]), "layout": row["layout"],
        "distribution": row["distribution"], "placement": {"tail_poison": row["tail"]},
        **fields,
    }


def _segments(row: dict[str, str], r: int, heads: int) -> list[list[int]]:
    n = _unit_count(row, "segments", r)
    many = n >= BIG_BATCH
    q_menu = (3, 1, 8, 5) if many else (37, 20, 48, 5, 64, 17)
    ctx_menu = (9, 0, 20, 3) if many else (40, 0, 130, 9, 257)
    with_context = row["context"] == "some"
    pairs = [[q_menu[(i + r) % len(q_menu)],
              ctx_menu[(2 * i + r) % len(ctx_menu)] if with_context else 0] for i in range(n)]
    if with_context:
        pairs[0][1] = max(pairs[0][1], 21)
        if n > 1:
            pairs[-1] = [1, 60 + r]  # a one-token segment with context
    if row["empty"] == "some":
        pairs = [[0, 20 if with_context else 0], *pairs, [0, 0]]
    for _ in range(8):  # halve queries and context past the budget (work: q x heads x kv)
        if sum(q * heads * (q + c) for q, c in pairs) <= WORK_BUDGET:
            break
        for p in pairs:
            p[0] = max(1, p[0] // 2) if p[0] > 1 else p[0]
            p[1] = p[1] // 2 if p[1] > 21 else p[1]  # (a first context of 21+ stays context)
    return pairs


def _prefill_fields(row: dict[str, str], r: int) -> dict[str, Any]:
    heads = int(row["heads"])
    fields: dict[str, Any] = {
        "segments": _segments(row, r, heads), "num_heads": heads, "quant": _quant(row, r),
        "causal": row["causal"] == "true", "distribution": row["distribution"],
    }
    if row["soft_cap"] == "on":
        fields["soft_cap"] = 30.0
    rare = row.get("rare", "default")
    if rare == "no-lse":
        fields["return_lse"] = False
    elif rare == "no-yarn":
        fields["dims"] = {"rope_factor": 1.0}
    return fields


def _realise_prefill(row: dict[str, str], r: int) -> dict[str, Any]:
    return _prefill_fields(row, r)


def _realise_paged(row: dict[str, str], r: int) -> dict[str, Any]:
    fields = _prefill_fields(row, r)
    heads, kv_fmt = fields["num_heads"], fields["quant"]["kv"]
    per_token = heads * (192 + 128) * (1 if kv_fmt.startswith("fp8") else 2)  # K and V bytes
    largest = 1024  # a page per segment plus the spare pages within PAGED_POOL_BUDGET
    while largest > 128 and (len(fields["segments"]) + 8) * largest * per_token \
            > PAGED_POOL_BUDGET:
        largest //= 2
    size = _pick_page_size(row, r, kv_fmt, largest)
    live = [seg for seg in fields["segments"] if seg[0] > 0]
    if size > 1 and all((q + c) % size == 0 for q, c in live):  # no partial last page yet:
        seg = live[0]                                             # give one a poisoned tail
        if seg[0] > 1:
            seg[0] -= 1
        else:
            seg[1] += 1
    fields["paging"] = {"page_size": size, "layout": row["layout"]}
    fields["placement"] = {"tail_poison": row["tail"]}
    return fields


_REALISERS: dict[str, Callable[[dict[str, str], int], dict[str, Any]]] = {
    DECODE: _realise_decode, SPARSE: _realise_sparse, PREFILL: _realise_prefill,
    PAGED: _realise_paged,
}


__all__ = [
    "FACTORS",
    "IMPOSSIBLE",
    "MIN_SCALE_SPREAD",
    "OPS",
    "Factor",
    "Impossible",
    "ScaleReport",
    "covered",
    "covering_array",
    "covering_cases",
    "factors",
    "impossible_reason",
    "required",
    "scale_report",
    "signature",
    "uncovered",
]


def main(argv: list[str] | None = None) -> int:
    """Rebuild the stored covering arrays the packaged matrices use."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--strength", type=int, action="append", default=None)
    a = p.parse_args(argv)
    for t in a.strength or [2, 3]:
        for op in OPS:
            path = write_stored(op, t)
            print(f"{path}: {len(construct(op, t, 0))} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
