"""Counterfactual diagnosis: which other semantics did the kernel compute?

When a failure is global — every row fails, or every row of some request / segment — the
row pattern can only say "a global cause (scale, format, softmax, ...)". The judge then
re-runs the golden under a small catalogue of alternative semantics, each a convention a
kernel or its caller plausibly got wrong, and names the one whose result matches the
kernel's (with the residual against the row bound), or says that none did. The LSE-base
check was the first of these: kernel LSE = golden LSE / ln 2.

The catalogue (`alternatives`; each only where the case can tell it from the truth):

- causal mask aligned top-left (query i sees keys j <= i) instead of bottom-right;
- softmax scale 1/sqrt(d_qk) without YaRN's mscale^2, 1/sqrt(576) (the latent width: AITER
  and FlashMLA decode defaults), 1/sqrt(512), 1/sqrt(128) (AITER's FP8 prefill default);
- soft cap not applied;
- FP8 dequantisation scale ignored, applied twice or inverted; the inputs cast to FP8 with a
  unit scale from the unquantised values (the amax scale never applied);
- e4m3fnuz bits read as e4m3fn (x2), and e4m3fn read as e4m3fnuz (/2);
- V taken from K's first v_head channels (the absorbed-latent convention) in MHA prefill;
- LSE in base 2.

A match must explain every row of the probed units (the smallest failing ones, and one
passing unit, which a global convention must leave right or change as it changes the
others) within the row bound, as the KV-position test of mlacheck.localise does. The golden
re-runs cost a few unit-sized references, only on FAIL, only for units under
MAX_SCORES_PROBED score elements.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlacheck import fp8
from mlacheck.golden import decode as golden_decode
from mlacheck.golden import prefill as golden_prefill
from mlacheck.golden.core import Operand, Result, attend
from mlacheck.golden.sparse import sparse_attention
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs
from mlacheck.spec import Case, PrefillCase
from mlacheck.verdict import Verdict, ranges

# Failing units re-run under each alternative (the cheapest), plus one passing unit.
MAX_FAILING_PROBED = 2
# A unit whose attention has more score elements (q rows x kv x heads) than this is not
# re-run: about a second of fp32 golden per alternative on a CPU core.
MAX_SCORES_PROBED = 1 << 24
# The diagnosis axes whose failures are tried (a failure along heads, pages or the pool
# region is no convention of the whole kernel).
TRIED_AXES = frozenset({"all", "requests", "segments", "rows", "kv", "lse"})
AXIS = "semantics"


@dataclass(frozen=True)
class Term:
    """One operand of a unit as the golden reads it, with its format and unquantised values."""

    stored: Operand
    fmt: str
    ideal: Operand


# How an alternative reads one stored operand (None: as the golden does).
Reading = Callable[[Term], Operand]


@dataclass(frozen=True)
class Alternative:
    name: str  # a short id, recorded in the verdict's metrics
    words: str  # what the kernel would have computed, for the card
    scale: float | None = None  # the softmax scale used (None: the case's)
    top_left: bool = False  # causal mask aligned top-left
    no_soft_cap: bool = False
    v_from_k: bool = False  # V = K's first v_head channels (prefill)
    reading: Reading | None = None
    lse_base2: bool = False  # the LSE, natural / ln 2 (compared on the LSE alone)


@dataclass(frozen=True)
class Match:
    alternative: Alternative
    residual: float  # worst row's error against the alternative, in units of the bound
    units: tuple[int, ...]  # the units probed


# --------------------------------------------------------------------------- the catalogue


def alternatives(case: Case, inputs: Inputs) -> list[Alternative]:
    """The alternative semantics this case can tell from its own (each differs from it)."""
    out: list[Alternative] = []
    dims, scale = case.dims, case.softmax_scale
    units = inputs.row_bounds
    q_lens = [units[u + 1] - units[u] for u in range(len(units) - 1)]
    kv_lens = case.kv_lengths
    if not case.sparse and case.causal and any(
            0 < q < kv for q, kv in zip(q_lens, kv_lens, strict=True)):
        out.append(Alternative("causal-top-left", "the causal mask aligned top-left (query i "
                               "sees keys j <= i) instead of bottom-right", top_left=True))
    seen = {round(scale, 9)}
    for name, value, why in (
            ("scale-no-mscale", 1 / math.sqrt(dims.qk_head),
             f"1/sqrt({dims.qk_head}) (YaRN's mscale^2 left out)"),
            ("scale-latent", 1 / math.sqrt(dims.latent),
             f"1/sqrt({dims.latent}), the latent width (AITER / FlashMLA decode default)"),
            ("scale-kv-lora", 1 / math.sqrt(dims.kv_lora_rank), f"1/sqrt({dims.kv_lora_rank})"),
            ("scale-v-head", 1 / math.sqrt(dims.v_head),
             f"1/sqrt({dims.v_head}) (AITER's FP8 prefill default)")):
        if round(value, 9) not in seen:
            seen.add(round(value, 9))
            out.append(Alternative(name, f"softmax scale {why} = {value:.4g} instead of the "
                                         f"model's {scale:.4g}", scale=value))
    if case.soft_cap > 0:
        out.append(Alternative("soft-cap-ignored", f"no soft cap (the case's is "
                                                   f"{case.soft_cap:g})", no_soft_cap=True))
    fp8_terms = [f for f in (case.quant.q, case.quant.kv) if fp8.fmt(f).is_fp8]
    if fp8_terms and case.quant.scale == "amax":
        out += [
            Alternative("fp8-scale-ignored", "the FP8 inputs read without their dequantisation "
                        "scales (x 1)", reading=_scaled(lambda s: 1.0)),
            Alternative("fp8-scale-twice", "the FP8 dequantisation scales applied twice "
                        "(x scale^2)", reading=_scaled(lambda s: s * s)),
            Alternative("fp8-scale-reciprocal", "the FP8 dequantisation scales inverted "
                        "(/ scale)", reading=_scaled(lambda s: 1 / s)),
            Alternative("fp8-unit-cast", "the inputs cast to FP8 with a unit scale from the "
                        "unquantised values (the amax scales never applied; overflow "
                        "saturates in e4m3fn, is NaN in e4m3fnuz)", reading=_unit_cast)]
    if "fp8_e4m3fnuz" in fp8_terms:
        out.append(Alternative("fnuz-read-as-fn", "the e4m3fnuz inputs' bits read as e4m3fn "
                               "(values x 2)", reading=_read_as("fp8_e4m3fnuz", "fp8_e4m3fn")))
    if "fp8_e4m3fn" in fp8_terms:
        out.append(Alternative("fn-read-as-fnuz", "the e4m3fn inputs' bits read as e4m3fnuz "
                               "(values / 2)", reading=_read_as("fp8_e4m3fn", "fp8_e4m3fnuz")))
    if isinstance(case, PrefillCase):
        out.append(Alternative("v-from-k", f"V taken from K's first {dims.v_head} channels "
                               "(the absorbed latent's convention) instead of V",
                               v_from_k=True))
    out.append(Alternative("lse-base2", "the LSE in base 2 (natural LSE / ln 2)",
                           lse_base2=True))
    return out


def _scaled(new: Callable[[torch.Tensor | float], torch.Tensor | float]) -> Reading:
    def read(t: Term) -> Operand:
        if not fp8.fmt(t.fmt).is_fp8:
            return t.stored
        return Operand(t.stored.data, new(t.stored.scale))

    return read


def _unit_cast(t: Term) -> Operand:
    if not fp8.fmt(t.fmt).is_fp8:
        return t.stored
    return Operand(fp8.quantize(t.ideal.data, t.fmt, 1.0), 1.0)


def _read_as(stored_fmt: str, read_fmt: str) -> Reading:
    dtype = fp8.fmt(read_fmt).dtype

    def read(t: Term) -> Operand:
        if t.fmt != stored_fmt:
            return t.stored
        return Operand(t.stored.data.view(torch.uint8).view(dtype), t.stored.scale)

    return read


# --------------------------------------------------------------------------- the judge step


def name_the_semantics(v: Verdict, case: Case, inputs: Inputs, out: torch.Tensor,
                       lse: torch.Tensor | None, gold: Result, failing: torch.Tensor) -> None:
    """The judge's step for a FAIL: when its failure is global, say which alternative
    semantics the kernel's output matches (the card's first line; axis `semantics`), or
    that none did. `failing` [T, H]: every row some check failed. `out` / `lse` may be on
    the case's device: only the probed units' rows are brought to the CPU."""
    axis = v.metrics.get("axis")
    if axis not in TRIED_AXES or (axis != "lse" and not _global(inputs, failing)):
        return
    failed = {c.name for c in v.failed_checks}
    only_lse = failed == {"lse"}
    probed = _probed(case, inputs, failing)
    if not probed:
        return
    tried, found = [], None
    for alt in alternatives(case, inputs):
        if alt.lse_base2 != only_lse:
            continue  # an LSE convention explains an LSE-only failure, and nothing else
        tried.append(alt.name)
        residual = _residual(alt, v, case, inputs, out, lse, gold, probed)
        if residual is not None and residual <= 1.0:
            found = Match(alt, residual, tuple(probed))
            break
    if found is None:
        if tried:
            v.diagnosis += ("; " if v.diagnosis else "") + (
                f"no alternative semantics matches the output (tried: {', '.join(tried)})")
        return
    alt = found.alternative
    unit = case.unit_name
    # what the row pattern said stays when it adds to the cause (the units and what they
    # share, the KV positions); "a global cause" and the LSE ratio are what this replaces
    before = {"all": "", "lse": "the outputs are right"}.get(str(axis), v.diagnosis)
    v.diagnosis = (f"semantics: the kernel matches {alt.words} (worst row "
                   f"{found.residual:.2g} x the bound, {unit}s {ranges(found.units)} re-run)"
                   + (f"; {before}" if before else ""))
    v.metrics["axis"] = AXIS
    v.metrics["semantics"] = {"name": alt.name, "residual": found.residual}


def _global(inputs: Inputs, failing: torch.Tensor) -> bool:
    """Every live unit has failing rows, or some unit fails in every row."""
    cuts = inputs.row_bounds
    live = [failing[cuts[u] : cuts[u + 1]] for u in range(len(cuts) - 1) if cuts[u + 1] > cuts[u]]
    return bool(live) and (all(bool(b.any()) for b in live) or any(bool(b.all()) for b in live))


def _probed(case: Case, inputs: Inputs, failing: torch.Tensor) -> list[int]:
    """The cheapest failing units and the cheapest passing one, each small enough; all units
    of a sparse case (its golden runs on the whole batch)."""
    cuts = inputs.row_bounds
    n = len(cuts) - 1
    heads = failing.shape[1]
    kv = case.kv_lengths
    cost = {u: (cuts[u + 1] - cuts[u]) * kv[u] * heads for u in range(n) if cuts[u + 1] > cuts[u]}
    if case.sparse:
        topk = case.topk * int(cuts[-1]) * heads  # type: ignore[operator]
        return list(cost) if topk <= MAX_SCORES_PROBED else []
    small = sorted((c, u) for u, c in cost.items() if c <= MAX_SCORES_PROBED)
    bad = [u for _, u in small if bool(failing[cuts[u] : cuts[u + 1]].any())]
    good = [u for _, u in small if u not in bad]
    return sorted(bad[:MAX_FAILING_PROBED] + good[:1]) if bad else []


def _residual(alt: Alternative, v: Verdict, case: Case, inputs: Inputs, out: torch.Tensor,
              lse: torch.Tensor | None, gold: Result, units: list[int]) -> float | None:
    """The worst probed row's distance to the alternative, in units of the bound (None: the
    alternative does not explain some probed unit at all, e.g. NaN where it has none)."""
    cuts = inputs.row_bounds
    if alt.lse_base2:
        check = next((c for c in v.checks if c.name == "lse"), None)
        if lse is None or check is None or not check.bound:
            return None
        worst = 0.0
        for u in units:
            got = lse[cuts[u] : cuts[u + 1]].detach().cpu().double()
            want = gold.lse[cuts[u] : cuts[u + 1]].detach().cpu().double() / math.log(2.0)
            fin = torch.isfinite(want)
            if not bool((torch.isfinite(got) == fin).all()):
                return None
            if bool(fin.any()):
                worst = max(worst, float((got[fin] - want[fin]).abs().max()) / check.bound)
        return worst
    bound = float(v.metrics.get("bound") or 0.0)
    if bound <= 0:
        return None
    refs = _references(alt, case, inputs, units)
    worst = 0.0
    for u in units:
        got = out[cuts[u] : cuts[u + 1]].detach().cpu()  # a unit's rows: small
        ref = refs[u].detach().cpu()
        ref_bad, got_bad = ~torch.isfinite(ref).all(-1), ~torch.isfinite(got).all(-1)
        # as mlacheck.localise reads NaN: each of the alternative's non-finite rows is
        # non-finite in the kernel's; the kernel may have more only where the alternative's
        # inputs hold NaN at all (0 x NaN in a masked position is NaN to a kernel)
        if bool((ref_bad & ~got_bad).any()) or (bool((got_bad & ~ref_bad).any())
                                                and not bool(ref_bad.any())):
            return None
        fin = ~(ref_bad | got_bad)
        if bool(fin.any()):
            g, o = ref[fin].double(), got[fin].double()
            rel = (o - g).norm(dim=-1) / g.norm(dim=-1).clamp_min(1e-6)
            worst = max(worst, float(rel.max()) / bound)
    return worst


def _references(alt: Alternative, case: Case, inputs: Inputs,
                units: list[int]) -> dict[int, torch.Tensor]:
    """The output rows of each unit under the alternative (fp32)."""
    scale = case.softmax_scale if alt.scale is None else alt.scale
    read = alt.reading or (lambda t: t.stored)
    if isinstance(inputs, PrefillInputs):
        qs, ks, vs = golden_prefill.operands(inputs, "exact")
        iq, ik, iv = golden_prefill.operands(inputs, "ideal")
        q_fmt, kv_fmt = case.quant.q, case.quant.kv
        found = {}
        for u in units:
            q = read(Term(qs[u], q_fmt, iq[u]))
            k = read(Term(ks[u], kv_fmt, ik[u]))
            v: Operand | int = case.dims.v_head if alt.v_from_k else read(Term(vs[u], kv_fmt,
                                                                               iv[u]))
            if alt.top_left:
                sq = q.data.shape[0]
                k = k.view(lambda x, n=sq: x[:n])
                v = v if isinstance(v, int) else v.view(lambda x, n=sq: x[:n])
            cap = 0.0 if alt.no_soft_cap else case.soft_cap
            found[u] = attend(q, k, v, scale, case.causal, cap, dtype=torch.float32).out
        return found
    assert isinstance(inputs, DecodeInputs)
    cuts = inputs.row_bounds
    q_all = Term(golden_decode.query_operand(inputs, "exact"), case.quant.q,
                 golden_decode.query_operand(inputs, "ideal"))
    rank = case.dims.kv_lora_rank
    if case.sparse:
        res = _sparse(alt, inputs, q_all, scale, read)
        return {u: res[cuts[u] : cuts[u + 1]] for u in units}
    found = {}
    for u in units:
        q = read(Term(q_all.stored.view(lambda x, a=cuts[u], b=cuts[u + 1]: x[a:b]),
                      case.quant.q, q_all.ideal.view(lambda x, a=cuts[u], b=cuts[u + 1]: x[a:b])))
        kv = read(Term(golden_decode.kv_operand(inputs, "exact", u), case.quant.kv,
                       golden_decode.kv_operand(inputs, "ideal", u)))
        if alt.top_left:
            kv = kv.view(lambda x, n=q.data.shape[0]: x[:n])
        found[u] = attend(q, kv, rank, scale, True, dtype=torch.float32).out
    return found


def _sparse(alt: Alternative, inputs: DecodeInputs, q: Term, scale: float,
            read: Reading) -> torch.Tensor:
    """The whole sparse batch under the alternative, on its golden's own rows."""
    case = inputs.case
    kv = read(Term(golden_decode.sparse_kv(inputs, "exact"), case.quant.kv,
                   golden_decode.sparse_kv(inputs, "ideal")))
    return sparse_attention(read(q), kv, golden_decode.sparse_rows(inputs), scale,
                            case.dims.kv_lora_rank, torch.float32).out


__all__ = ["AXIS", "Alternative", "Match", "alternatives", "name_the_semantics"]
