"""Where a failure lives: which rows, and along which axis the bug acts (the report's heat map
of the rows is mlacheck/heatmap.py).

`localise` groups bad rows [T, H] by request (decode) or segment (prefill): token range,
heads, worst error, pages and pool bytes. `diagnose` reads the pattern of the bad rows and
names the axis a kernel engineer should look along, for the first line of the failure card:

- heads: a subset of heads fails wherever it fails (padding, head mapping);
- requests / segments: whole requests fail while others pass; what the failing ones share
  and the passing ones do not is said (a partial last page, a tile-multiple kv length, pages
  past 2^31, an empty neighbour, ...);
- KV positions / pages: the kernel's output for a failing request equals attention over
  other KV positions: a prefix of its kv (the golden re-run on truncated kv: the named
  positions were dropped), or its kv read on to its last page's end with the pool's real tail
  contents (NaN or finite sentinel poison: the tail was read). A tail read is not claimed when
  a passing request's poisoned tail shows the kernel does not read tails; the requests no
  candidate explains are named as such;
- pool region: exactly the requests with live pages past 2^31 / 2^32 bytes fail;
- tokens: some tokens of a request fail in every head (MTP rows, one-token segments);
- rows: anything else (named by request, tokens and heads).

The KV test re-runs the golden for at most MAX_KV_PROBES failing (and passing) requests on a
few candidate kv lengths each, only on FAIL, so it costs a fraction of the case's own golden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlacheck import boundaries
from mlacheck import tolerances as tol
from mlacheck.golden.core import Operand, attend, per_tensor
from mlacheck.inputs import DecodeInputs, Inputs
from mlacheck.kvcache import byte_region
from mlacheck.spec import Case
from mlacheck.verdict import Where, ranges

# Failing requests whose kv the KV-attribution test re-runs (the worst first).
MAX_KV_PROBES = 4
# A truncated-kv golden explains a request when its worst row error against the kernel is
# within this fraction of the row bound (the kernel then computed exactly that attention).
EXPLAINED_FRACTION = 1.0


def localise(inputs: Inputs, bad: torch.Tensor, err: torch.Tensor, bound: float,
             check: str) -> list[Where]:
    """Group bad rows [T, H] by request: token range, heads, worst error, pages and bytes."""
    cuts = inputs.row_bounds
    pool = inputs.paged_pool
    kv_lens = inputs.case.kv_lengths
    found = []
    for r in range(len(cuts) - 1):
        blk = bad[cuts[r] : cuts[r + 1]]
        if not blk.any():
            continue
        tok = torch.nonzero(blk.any(1)).flatten()
        heads = torch.nonzero(blk.any(0)).flatten().tolist()
        w = Where(
            check, r, (cuts[r] + int(tok[0]), cuts[r] + int(tok[-1])), (int(tok[0]), int(tok[-1])),
            heads, float(err[cuts[r] : cuts[r + 1]][blk].max()), bound, kv_len=kv_lens[r],
        )
        if pool is not None:
            w.pages = pool.table.pages_of(r).tolist()
            lo, hi = pool.byte_range(r)
            w.bytes, w.region = (lo, hi), byte_region(lo, hi, inputs.case.placement.offset_bits)
        found.append(w)
    return found


@dataclass(frozen=True)
class Diagnosis:
    axis: str  # heads | requests | segments | kv | pool | tokens | rows | all
    text: str


def units_phrase(case: Case, units: list[int]) -> str:
    """'request 2' / 'requests 1-3'."""
    unit = case.unit_name
    return f"{unit} {units[0]}" if len(units) == 1 else f"{unit}s {ranges(units)}"


def diagnose(case: Case, inputs: Inputs, bad: torch.Tensor, err: torch.Tensor,
             out: torch.Tensor, bound: float, explain_kv: bool = True) -> Diagnosis | None:
    """The axis along which the bad rows [T, H] lie (see the module docstring).
    `explain_kv`: try KV positions (only meaningful where output rows failed their bound:
    rows that fail the LSE alone are explained by the golden itself)."""
    if not bool(bad.any()):
        return None
    unit = case.unit_name
    cuts = inputs.row_bounds
    n_units = len(cuts) - 1
    h = bad.shape[1]
    rows_of = [bad[cuts[u] : cuts[u + 1]] for u in range(n_units)]
    live = [u for u in range(n_units) if cuts[u + 1] > cuts[u]]
    bad_units = [u for u in live if bool(rows_of[u].any())]
    good_units = [u for u in live if u not in bad_units]
    whole = [u for u in bad_units if bool(rows_of[u].all())]
    bad_heads = sorted(set(torch.nonzero(bad.any(0)).flatten().tolist()))

    kv_first = (_kv_attribution(case, inputs, bad_units, good_units, out, bound)
                if explain_kv else "")
    if kv_first:  # a proven explanation beats any row pattern
        return Diagnosis("kv", f"KV positions: {kv_first}")
    if len(bad_heads) < h and all(
            set(torch.nonzero(rows_of[u].any(0)).flatten().tolist()) <= set(bad_heads)
            for u in bad_units) and _same_heads_per_row(bad, bad_heads):
        where = f"{len(bad_units)} of {len(live)} {unit}s" if good_units else f"every {unit}"
        return Diagnosis("heads", f"heads {ranges(bad_heads)} of {h} ({where})")

    if whole and len(whole) == len(bad_units):
        if not good_units:
            if len(live) == 1:
                props = ", ".join(k for k, on in _properties(case, inputs, live[0]).items() if on)
                return Diagnosis(f"{unit}s", f"{unit} {live[0]} (all its rows; the case's only "
                                             f"{unit}" + (f": {props}" if props else "") + ")")
            return Diagnosis("all", f"every {unit}, every head: a global cause (scale, format, "
                                    "softmax, accumulation, LSE convention)")
        pool = _pool_region(case, inputs, bad_units, good_units)
        if pool:
            return Diagnosis("pool", pool)
        shared = _shared(case, inputs, bad_units, good_units)
        names = f"{units_phrase(case, bad_units)} of {len(live)} (all their rows)"
        return Diagnosis(f"{unit}s", names + (f"; they share {shared}" if shared else ""))

    partial = [u for u in bad_units if _tokens_pattern(rows_of[u])]
    if partial and len(partial) == len(bad_units):
        toks = "; ".join(f"{unit} {u} tokens "
                         f"{ranges(torch.nonzero(rows_of[u].any(1)).flatten().tolist())}"
                         for u in partial[:6])
        return Diagnosis("tokens", f"tokens (all heads): {toks}")
    return Diagnosis("rows", f"rows of {units_phrase(case, bad_units)}, heads {ranges(bad_heads)}")


# What a systematic failure (rows judged together) suggests, on the first line of its card.
SYSTEMATIC_CAUSE = ("no row beyond its own bound: precision lost in part of the accumulation, "
                    "a scale off by a fraction of a percent, a key masked")


def diagnose_systematic(case: Case, inputs: Inputs, rows: torch.Tensor, err: torch.Tensor,
                        b_err: torch.Tensor, floor: float,
                        largest: tuple[int, int, float] | None) -> Diagnosis:
    """The axis of a failure of the rows judged together (the judge's rms_error and
    max_abs_error): the requests / segments whose own rows' RMS error is beyond
    tol.RMS_FACTOR x the baseline's on the same rows (floored like the check), or, when only
    the largest element fails, its row. `rows`: finite rows; `largest`: (token, head, ratio
    to the baseline's largest) when max_abs_error failed."""
    unit = case.unit_name
    cuts = inputs.row_bounds
    kv = case.kv_lengths
    ratio: dict[int, float] = {}
    raised = []
    for u in range(len(cuts) - 1):
        sel = rows[cuts[u] : cuts[u + 1]]
        if not bool(sel.any()):
            continue
        k = rms(err[cuts[u] : cuts[u + 1]][sel])
        b = rms(b_err[cuts[u] : cuts[u + 1]][sel])
        ratio[u] = k / b if b else float("inf")
        if k > max(tol.RMS_FACTOR * b, floor):
            raised.append(u)
    live = sorted(ratio)
    if largest is not None and not raised:
        t, h, r = largest
        u = max(i for i in range(len(cuts) - 1) if cuts[i] <= t)
        return Diagnosis("rows", f"rows of {unit} {u} (kv {kv[u]}): the largest element error "
                                 f"(token {t}, head {h}) is {r:.2f}x the baseline's largest; "
                                 "no row beyond its own bound")
    if len(live) == 1:
        u = live[0]
        return Diagnosis(f"{unit}s", f"{unit} {u} (kv {kv[u]}; the case's only {unit}): its "
                                     f"rows' errors are {ratio[u]:.2f}x the baseline's (RMS); "
                                     f"{SYSTEMATIC_CAUSE}")
    if not raised or raised == live:
        lo, hi = min(ratio.values()), max(ratio.values())
        return Diagnosis("all", f"every {unit}, every head: the rows' errors are {lo:.2f}-"
                                f"{hi:.2f}x the baseline's (RMS), a global cause; "
                                f"{SYSTEMATIC_CAUSE}")
    others = [u for u in live if u not in raised]
    shared = _shared(case, inputs, raised, others)
    return Diagnosis(f"{unit}s", f"{units_phrase(case, raised)} of {len(live)} (kv "
                                 f"{ranges(sorted({kv[u] for u in raised}), 6)}): their rows' "
                                 f"errors are {min(ratio[u] for u in raised):.2f}-"
                                 f"{max(ratio[u] for u in raised):.2f}x the baseline's (RMS), "
                                 f"the others' at most {max(ratio[u] for u in others):.2f}x"
                                 + (f"; they share {shared}" if shared else "")
                                 + f"; {SYSTEMATIC_CAUSE}")


def rms(x: torch.Tensor) -> float:
    """Root mean square (0 for an empty tensor)."""
    return float(x.double().pow(2).mean().sqrt()) if x.numel() else 0.0


def _tokens_pattern(rows: torch.Tensor) -> bool:
    """Some tokens of a unit fail across (most of) the heads, others do not fail at all."""
    tokens = rows.any(1)
    if bool(tokens.all()):
        return False
    return bool((rows[tokens].float().mean() >= 0.5).item())


# A head bug fails the same heads in every failing token: at least this share of the failing
# tokens must fail in exactly the union of failing heads (data-dependent misses of a KV bug
# scatter over heads and give no such agreement).
HEAD_AGREEMENT = 0.9


def _same_heads_per_row(bad: torch.Tensor, heads: list[int]) -> bool:
    """The failing heads are a head property: failing tokens agree on which heads fail."""
    rows = bad[bad.any(1)]
    if not len(heads) or rows.numel() == 0:
        return False
    union = torch.zeros(bad.shape[1], dtype=torch.bool)
    union[heads] = True
    agree = (rows == union).all(1).float().mean()
    return bool(agree >= HEAD_AGREEMENT)


def _pool_region(case: Case, inputs: Inputs, bad: list[int], good: list[int]) -> str:
    pool = inputs.paged_pool
    if pool is None:
        return ""
    signed, unsigned = case.placement.wraps  # 2^31, 2^32 (or a scale model's)
    for limit in (unsigned, signed):
        past = {u for u in bad + good if pool.byte_range(u)[1] > limit}
        if past and past == set(bad):
            name = f"2^{limit.bit_length() - 1}"
            return (f"pool region: exactly the {case.unit_name}s with live pages past {name} "
                    f"bytes fail ({case.unit_name}s {ranges(bad)}; the others sit below)")
    return ""


def shared_properties(case: Case, inputs: Inputs, units: list[int]) -> str:
    """Properties every one of `units` has (e.g. an empty request before them)."""
    props = [_properties(case, inputs, u) for u in units]
    return ", ".join([k for k in props[0] if all(p.get(k) for p in props)][:4]) if props else ""


def _shared(case: Case, inputs: Inputs, bad: list[int], good: list[int]) -> str:
    """Properties every failing unit has and no passing one does."""
    props = [_properties(case, inputs, u) for u in bad + good]
    pb, pg = props[: len(bad)], props[len(bad):]
    common = [k for k in pb[0] if all(p.get(k) for p in pb) and not any(p.get(k) for p in pg)]
    return ", ".join(common[:4])


def _properties(case: Case, inputs: Inputs, u: int) -> dict[str, bool]:
    lens = case.kv_lengths
    qs = case.q_lengths
    kv, q = lens[u], qs[u]
    out: dict[str, bool] = {}
    ps = _page_size(case)
    if ps and ps > 1:
        out["a partial last page"] = bool(kv % ps)
        out["a full last page"] = not kv % ps
    for m in boundaries.TILE_SIZES[::-1]:
        if kv and kv % m == 0:
            out[f"a kv length that is a multiple of {m}"] = True
            break
    for n in boundaries.LONG_KV[::-1]:
        if kv > n:
            out[f"kv longer than {n}"] = True
            break
    if q > 1:
        out["more than one query token"] = True
    if q == 1 and len(qs) > 1:
        out["a single query token"] = True
    if u > 0 and any(x == 0 for x in qs[:u]):
        out["an empty request/segment before them"] = True
    if kv > q:
        out["cached context"] = True
    pool = inputs.paged_pool
    if pool is not None and pool.table.pages_of(u).numel():
        top = int(pool.table.pages_of(u).max())
        for bits in (16, 15):
            if top >= 1 << bits:
                out[f"page ids up to {top} (past 2^{bits})"] = True
                break
    return out


def _page_size(case: Case) -> int:
    """Tokens per page (1 for an unpaged prefill: no page has a tail)."""
    return case.paging.page_size if case.paging else 1


def _kv_attribution(case: Case, inputs: Inputs, bad: list[int], good: list[int],
                    out: torch.Tensor, bound: float) -> str:
    """Name the KV positions that explain the failing requests' outputs: the golden re-run on
    the request's kv read on to its last page's end (the pool's real tail contents: NaN or a
    finite sentinel), or on a prefix (dropped positions). A tail read is not claimed when a
    passing request's poisoned tail shows the kernel does not read tails (the cause is then
    elsewhere: the pages, the pool region). '' when no probed request is explained."""
    if case.sparse or not bad:  # a top-k's positions are no prefix of the kv
        return ""
    cuts = inputs.row_bounds

    def rows(u: int) -> torch.Tensor:
        return out[cuts[u] : cuts[u + 1]]

    tails_read = not any(_tail_contradicted(case, inputs, u, rows(u), bound)
                         for u in good[:MAX_KV_PROBES])
    found, unexplained = [], []
    for u in bad[:MAX_KV_PROBES]:
        hit = (_tail_read(case, inputs, u, rows(u), bound) if tails_read else None) or \
            _explaining_prefix(case, inputs, u, rows(u), bound)
        if hit is None:
            unexplained.append(u)
        else:
            found.append(hit)
    if not found:
        return ""
    rest = (f"; {units_phrase(case, unexplained)}: not explained by "
            f"{'its' if len(unexplained) == 1 else 'their'} KV positions" if unexplained else "")
    return "; ".join(found) + rest


def _explains(ref: torch.Tensor, got: torch.Tensor, bound: float) -> bool:
    """The kernel's rows `got` are attention `ref`: the kernel computed exactly that attention.

    Every row `ref` has non-finite is non-finite in `got`, and `got`'s finite rows are within
    the row bound of `ref`'s. When the positions read hold non-finite values, `got` may be
    non-finite in more rows than `ref`: a kernel multiplies masked-out probabilities (0) by
    the NaN values all the same (0 x NaN = NaN), the golden leaves them out."""
    ref = ref.to(got.device)  # the golden runs on the case's device; the judge's rows may not
    ref_bad, got_bad = ~torch.isfinite(ref).all(-1), ~torch.isfinite(got).all(-1)
    if bool((ref_bad & ~got_bad).any()):
        return False
    if bool((got_bad & ~ref_bad).any()) and not bool(ref_bad.any()):
        return False
    fin = ~got_bad
    if not bool(fin.any()):
        return True
    g, o = ref[fin].double(), got[fin].double()
    rel = (o - g).norm(dim=-1) / g.norm(dim=-1).clamp_min(1e-6)
    return float(rel.max()) <= EXPLAINED_FRACTION * bound


def _tail_reference(case: Case, inputs: Inputs, u: int) -> torch.Tensor | None:
    """Attention of unit u over its kv read on to its last page's end (None: no partial
    last page, or no paged pool to read a tail from)."""
    ps, kv = _page_size(case), case.kv_lengths[u]
    if ps <= 1 or not kv % ps or inputs.paged_pool is None:
        return None
    q, k, v = _operands(case, inputs, u, whole_pages=True)
    return attend(q, k, v, case.softmax_scale, case.causal,
                  case.soft_cap, dtype=torch.float32).out


def _tail_contradicted(case: Case, inputs: Inputs, u: int, got: torch.Tensor,
                       bound: float) -> bool:
    """Passing unit u has a poisoned tail that, read, would have changed its output."""
    ref = _tail_reference(case, inputs, u)
    return ref is not None and not _explains(ref, got, bound)


def _tail_read(case: Case, inputs: Inputs, u: int, got: torch.Tensor, bound: float
               ) -> str | None:
    ref = _tail_reference(case, inputs, u)
    if ref is None or not _explains(ref, got, bound):
        return None
    ps, kv = _page_size(case), case.kv_lengths[u]
    fill = kv % ps
    pool = inputs.paged_pool
    last = int(pool.table.pages_of(u)[-1]) if pool is not None else -1
    return (f"{case.unit_name} {u}: tokens {kv}..{kv - fill + ps - 1} past its kv_len, the "
            f"poisoned tail of its last page (page {last}, {fill}/{ps} used) were read")


def _candidate_prefixes(kv: int, page_size: int) -> list[int]:
    """Prefix lengths a kernel that drops kv positions plausibly attends to."""
    cands = set()
    if page_size > 1:
        pages = -(-kv // page_size)
        cands |= {(pages - 1) * page_size + 1, (pages - 1) * page_size}
    for m in boundaries.TILE_SIZES:
        if kv > m:
            cands |= {kv - m, (kv - 1) // m * m}
    cands |= {n for n in boundaries.LONG_KV if n < kv}
    cands |= {kv - 1}
    return sorted(n for n in cands if 0 < n < kv)


def _explaining_prefix(case: Case, inputs: Inputs, u: int, got: torch.Tensor,
                       bound: float) -> str | None:
    lens = case.kv_lengths
    kv, ps = lens[u], _page_size(case)
    if not torch.isfinite(got).all():
        return None
    q, k, v = _operands(case, inputs, u)
    for n in _candidate_prefixes(kv, ps):
        ref = attend(q, k.view(lambda x, n=n: x[:n]),
                     v if isinstance(v, int) else v.view(lambda x, n=n: x[:n]),
                     case.softmax_scale, case.causal,
                     case.soft_cap, dtype=torch.float32).out
        if _explains(ref, got, bound):
            where = _page_words(case, inputs, u, n, kv, ps)
            return (f"{case.unit_name} {u} attends to tokens 0..{n - 1} only: tokens "
                    f"{n}..{kv - 1} of its kv ({where}) are not attended")
    return None


def _page_words(case: Case, inputs: Inputs, u: int, n: int, kv: int, ps: int) -> str:
    if not ps:
        return f"the last {kv - n}"
    pool = inputs.paged_pool
    first_page, last_page = n // ps, (kv - 1) // ps
    ids = pool.table.pages_of(u)[first_page : last_page + 1].tolist() if pool is not None else []
    span = "the last page" if first_page == last_page == -(-kv // ps) - 1 else (
        f"pages {first_page}..{last_page} of the request")
    return f"{span}, page id{'s' if len(ids) > 1 else ''} {ranges(ids, 6)}"


def _operands(case: Case, inputs: Inputs, u: int, whole_pages: bool = False
              ) -> tuple[Operand, Operand, Operand | int]:
    """Request u's q, K, V as the exact golden reads them (whole_pages: K, V read on to the
    last page's end, as a kernel reading past kv_len sees them; paged pools only)."""
    cuts = inputs.row_bounds
    if isinstance(inputs, DecodeInputs):
        q = Operand(inputs.q.stored, per_tensor(inputs.q.scale)).view(
            lambda x: x[cuts[u] : cuts[u + 1]])
        kv = Operand(inputs.pool.gather(u, dequant=False, whole_pages=whole_pages),
                     per_tensor(inputs.pool.scale))
        return q, kv, case.dims.kv_lora_rank
    kc = inputs.cu_seqlens_k.tolist()
    q = Operand(inputs.q.stored, per_tensor(inputs.q.scale)).view(
        lambda x: x[cuts[u] : cuts[u + 1]])
    if inputs.k_pool is not None and inputs.v_pool is not None:
        k_pool, v_pool = inputs.k_pool, inputs.v_pool
        return (q, Operand(k_pool.gather(u, dequant=False, whole_pages=whole_pages),
                           per_tensor(k_pool.scale)),
                Operand(v_pool.gather(u, dequant=False, whole_pages=whole_pages),
                        per_tensor(v_pool.scale)))
    k = Operand(inputs.k.stored, per_tensor(inputs.k.scale)).view(lambda x: x[kc[u] : kc[u + 1]])
    v = Operand(inputs.v.stored, per_tensor(inputs.v.scale)).view(lambda x: x[kc[u] : kc[u + 1]])
    return q, k, v


__all__ = ["Diagnosis", "diagnose", "localise", "shared_properties"]
