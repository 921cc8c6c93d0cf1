"""Metrics, the tolerance policy and localisation: how a verdict is decided.

The judge sees only normalised tensors (out [T, H, Dv], LSE [T, H] natural log): adapters
normalise, the judge never does. Every check is per row (row = one token x one head), so one
corrupted request, head or page fails the case, and every failure says where.

The judge owns a verdict end to end: `verdict` (a kernel that ran), `skipped`, `crashed` and
`suite_error` build every verdict the pipeline returns, labelled with its documented finding
(mlacheck.known). For a FAIL the judge itself asks for what sharpens the diagnosis: probes,
through the `rerun` the harness gives it (mlacheck.probes), and the heat map's data
(mlacheck.heatmap). Nothing is written into a verdict after the judge returns it: what the
run measured (timings, device memory) lies beside it (mlacheck.harness.CaseResult).
"""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mlacheck import counterfactual, fp8, heatmap, known, probes
from mlacheck import tolerances as tol
from mlacheck.backends.base import Output
from mlacheck.golden.core import Result
from mlacheck.inputs import Inputs, PrefillInputs
from mlacheck.kvcache import byte_region
from mlacheck.localise import (
    Diagnosis,
    diagnose,
    diagnose_systematic,
    localise,
    rms,
    shared_properties,
    units_phrase,
)
from mlacheck.ops import Op
from mlacheck.probes import Probes, Rerun
from mlacheck.spec import PIPELINE_OPS, Case
from mlacheck.verdict import CRASH, ERROR, FAIL, PASS, SKIP, Check, Verdict, Where, ranges

# The baseline (harness.PEAK_ROUNDED_BASELINE, named so in its Output's metadata
# "baseline") that bounds nothing itself: FP8 rows take their allowance for the rounding of
# their largest weight from it (_fp8_row_bounds).
PEAK_ROUNDED = "baseline-peak-rounded"

# --------------------------------------------------------------------------- metrics


def row_errors(out: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per row (token x head): ||o - g|| / max(||g||, tiny), fp64 [T, H]."""
    o, g = out.double(), gold.double()
    norm = g.norm(dim=-1).clamp_min(tol.TINY_ROW_NORM * g.shape[-1] ** 0.5)
    return (o - g).norm(dim=-1) / norm


def row_max_abs(out: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    return (out.double() - gold.double()).abs().amax(dim=-1)


def row_cosine_distance(out: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    return 1 - torch.nn.functional.cosine_similarity(out.double(), gold.double(), dim=-1)


def tensor_rel_l2(out: torch.Tensor, gold: torch.Tensor) -> float:
    g = gold.double()
    return float((out.double() - g).norm() / g.norm().clamp_min(tol.TINY_ROW_NORM))


# The full-size passes over an output (every element, in fp64) run where the output is (the
# case's GPU) in slices of about this many elements, and only per-row results [T, H] come to
# the host. On the H100 nightly they ran on the host: the judge took 186 s summed over the
# items, the longest case 74-90 s and the largest worker 13.6 GiB. The 16k-token, 128-head
# prefill has 268M output elements: each of about a dozen passes is a 2 GiB fp64 copy, at
# 2.5e-8 s per element and pass on 2 CPU threads (measured here) ~80 s. A slice of 2^24
# elements keeps each fp64 temporary at 128 MiB (a few live at once: a fraction of the
# 0.5 GiB per-case overhead footprint.CASE_OVERHEAD allows for).
SLICE_ELEMENTS = 1 << 24


def _row_slices(t: torch.Tensor) -> list[slice]:
    per_row = max(1, t[0].numel()) if t.dim() and t.shape[0] else 1
    step = max(1, SLICE_ELEMENTS // per_row)
    return [slice(i, i + step) for i in range(0, t.shape[0], step)] or [slice(0, 0)]


def by_rows(fn: Any, *ts: torch.Tensor) -> torch.Tensor:
    """fn (a per-row function of [T, ...] tensors) over slices of rows, computed where the
    tensors are; the concatenated per-row result on the CPU."""
    return torch.cat([fn(*(t[s] for t in ts)).cpu() for s in _row_slices(ts[0])])


def finite_rows(t: torch.Tensor) -> torch.Tensor:
    """[T, H]: the rows (token x head) whose every element is finite, on the CPU."""
    return by_rows(lambda x: torch.isfinite(x).all(-1), t)


def masked_rel_l2(out: torch.Tensor, gold: torch.Tensor, keep: torch.Tensor,
                  nan_to_num: bool = False) -> float:
    """tensor_rel_l2(out * keep, gold * keep) for a [T, H] row mask (`nan_to_num`: of
    torch.nan_to_num(out)), computed in row slices where the tensors are (a NaN in a kept
    row, or where `keep` is 0, stays NaN, as in the unsliced product)."""
    num = den = torch.zeros((), dtype=torch.float64)
    for s in _row_slices(out):
        k = keep[s].to(out.device).unsqueeze(-1)
        o = torch.nan_to_num(out[s]) if nan_to_num else out[s]
        o, g = (o * k).double(), (gold[s] * k).double()
        num = num + (o - g).square().sum().cpu()
        den = den + g.square().sum().cpu()
    return float(num.sqrt() / den.sqrt().clamp_min(tol.TINY_ROW_NORM))


# --------------------------------------------------------------------------- verdict


def verdict(
    case: Case,
    inputs: Inputs,
    output: Output,
    gold: Result,
    baseline: Output | Sequence[Output],
    ideal: Result | None = None,
    backend: str = "",
    repeats: Repeats | None = None,
    implementation: Mapping[str, Any] | None = None,
    rerun: Rerun | None = None,
) -> Verdict:
    """Judge one case: the kernel's output against the golden, bounded by the baseline (one
    per legitimate way to round P, mlacheck.harness.baselines: the bound is held to their
    worst, so a correct kernel of any of those families passes); its
    own schedule metadata (when the backend validated one) and, with `repeats`, determinism.
    `implementation`: what ran (versions), completed with what the backend reported.
    `rerun`: the kernel on other inputs, for the probes of a FAIL (none: no probes)."""
    v = _new(case, backend, PASS, implementation_record(implementation or {}, output.metadata))
    failing = None
    if output.wrote_into_guarded:
        # the guard rows around the output buffer: here, once for every op (the sparse
        # prefill and the composed path judge their attention with _judge_numerics too), and
        # before the op's own checks, whose "only" diagnoses (max_logits only, the outputs
        # right) read every check made so far
        viol = inputs.out.violations()
        v.checks.append(Check("guards", not viol, float(len(viol)), 0.0, "; ".join(viol)))
    if case.op in PIPELINE_OPS:  # logits, selections, slots: judged by their own rules
        from mlacheck import pipeline_judge

        pipeline_judge.judge(v, case, inputs, output, gold, baseline, ideal)
    else:
        failing = _judge_numerics(v, case, inputs, output, gold, baseline, ideal)
    problems = output.metadata.get("validation")
    if problems:  # the backend's own schedule (e.g. AITER persistent metadata) is wrong
        v.checks.append(Check("metadata", False, detail="; ".join(problems)))
    if repeats is not None:
        v.where += _check_determinism(inputs, output, repeats, v.checks)
    if any(not c.passed for c in v.checks):
        v.status = FAIL
        v.reason = ", ".join(c.name for c in v.failed_checks)
        _diagnose_checks(v)
        if failing is not None:
            _name_the_semantics(v, case, inputs, output, gold, failing)
        _localise_further(v, inputs, output, gold, rerun)
    return with_known_label(v, case)


def _name_the_semantics(v: Verdict, case: Case, inputs: Inputs, output: Output, gold: Result,
                        failing: torch.Tensor) -> None:
    """A global failure: which alternative semantics the kernel computed (mlacheck.
    counterfactual). Never decides the verdict: a failure here is noted, nothing more."""
    try:
        lse = output.lse.detach() if output.lse is not None else None
        counterfactual.name_the_semantics(v, case, inputs, output.out.detach(), lse, gold,
                                          failing)
    except Exception as e:  # noqa: BLE001 - a diagnosis never decides a verdict
        v.metrics["counterfactual_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]


def skipped(case: Case, backend: str, reason: str,
            implementation: Mapping[str, Any] | None = None) -> Verdict:
    """The backend cannot run the case here (a capability, the machine's memory): why."""
    v = _new(case, backend, SKIP, dict(implementation or {}))
    v.reason = reason
    return v


def crashed(case: Case, backend: str, error: BaseException,
            implementation: Mapping[str, Any] | None = None) -> Verdict:
    """The implementation under test raised: CRASH, with its first line and traceback."""
    v = _new(case, backend, CRASH, dict(implementation or {}))
    v.reason = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    v.metrics["traceback"] = _traceback(error)
    return with_known_label(v, case)


def suite_error(case: Case, backend: str, stage: str, error: BaseException,
                implementation: Mapping[str, Any] | None = None) -> Verdict:
    """mlacheck itself failed while `stage` (building inputs, the references, judging):
    ERROR, never charged to the kernel."""
    v = _new(case, backend, ERROR, dict(implementation or {}))
    v.reason = f"suite error while {stage}: {type(error).__name__}: {error}".splitlines()[0][:500]
    v.metrics["traceback"] = _traceback(error)
    return v


def _new(case: Case, backend: str, status: str, implementation: dict[str, Any]) -> Verdict:
    return Verdict(case.id, backend, case.op, status, case=json.loads(case.to_json()),
                   implementation=implementation)


def _traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__,
                                              limit=8))


def _localise_further(v: Verdict, inputs: Inputs, output: Output, gold: Result,
                      rerun: Rerun | None) -> None:
    """Where a FAIL lies beyond its rows: the probes, when its axis is one they sharpen, and
    the heat map's data. Never decides the verdict: a failure here is noted, nothing more."""
    try:
        axis = v.metrics.get("axis")
        # (the sparse-pipeline ops localise by their own rules: mlacheck.pipeline_judge)
        if rerun is not None and axis in PROBED_AXES and v.op not in PIPELINE_OPS:
            refine_diagnosis(v, inputs, gold, probes.collect(inputs, rerun, axis in ALONE_AXES))
        if (output.out.dim() == 3  # the heat map's [T, H] rows: attention outputs only
                and tuple(output.out.shape) == tuple(gold.out.shape)):
            v.metrics.update(heatmap.metrics(by_rows(
                row_errors, output.out.detach(), gold.out.detach().to(output.out.device))))
    except Exception as e:  # noqa: BLE001 - localisation never decides a verdict
        v.metrics["localisation_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]


def with_known_label(v: Verdict, case: Case) -> Verdict:
    """Label a verdict about the kernel (PASS / FAIL / CRASH) with the documented finding
    (mlacheck.known) that matches its backend and case: KNOWN when it fails, XPASS when it
    passes, unless the rule is not strict (a finding whose visibility depends on the draw:
    a pass there is just a PASS), and only a failure of the status the rule documents
    (KnownFailure.fails_as). SKIP and ERROR say nothing about the kernel and are never
    labelled."""
    rule = known.lookup(v.backend, case) if v.executed else None
    if rule is None or (v.kernel_failed and v.status not in rule.fails_as):
        return v  # a failure the rule does not describe is not the finding
    if rule.strict or v.kernel_failed:
        v.known_failure, v.known_rule = rule.finding, rule.name
    return v


# Output.metadata entries that are the judge's inputs, not a description of the implementation.
_JUDGED_METADATA = ("validation", "validation_note")
_DROP = object()


def implementation_record(ran: Mapping[str, Any], metadata: Mapping[str, Any]
                          ) -> dict[str, Any]:
    """`ran` (versions) plus the JSON-sized part of what the backend reported about its run:
    scalars, short lists and dicts of them (tensors and schedule dumps stay out of results)."""

    def small(x: Any, depth: int = 0) -> Any:
        if x is None or isinstance(x, str | int | float | bool):
            return x
        if isinstance(x, list | tuple) and len(x) <= 16:
            kept = [small(i, depth + 1) for i in x]
            return kept if all(k is not _DROP for k in kept) else _DROP
        if isinstance(x, dict) and depth < 3:
            kept = {str(k): small(i, depth + 1) for k, i in x.items()}
            return {k: i for k, i in kept.items() if i is not _DROP}
        return _DROP

    reported = {k: x for k, x in ((k, small(x)) for k, x in metadata.items()
                                  if k not in _JUDGED_METADATA) if x is not _DROP}
    return {**ran, **reported}


# Golden LSEs this close to 0 are left out of the ratio (it would be meaningless there).
LSE_RATIO_MIN = 1e-3


def _diagnose_checks(v: Verdict) -> None:
    """Failures whose axis is a check rather than a row pattern come first on the card: the
    schedule (metadata), the LSE alone, guard rows, repeated runs. A proven KV explanation
    (the golden re-run on other KV positions reproduces the output) stays first, the schedule
    problem after it: a wrong kv length shows in both, and the KV words say what was read."""
    failed = {c.name for c in v.failed_checks}
    if "metadata" in failed:
        detail = next(c.detail for c in v.failed_checks if c.name == "metadata")
        schedule = f"schedule: {detail.split('; ')[0]}"
        if v.metrics.get("axis") == "kv":
            v.diagnosis = f"{v.diagnosis}; {schedule}"
            return
        rows = f"; rows: {v.diagnosis}" if v.diagnosis else ""
        v.diagnosis, v.metrics["axis"] = f"{schedule}{rows}", "schedule"
    elif failed == {"lse"}:  # which LSE convention: mlacheck.counterfactual says
        ratio = v.metrics.get("lse_ratio")
        v.diagnosis = (f"LSE only (the outputs are right): kernel LSE / golden LSE = "
                       f"{ratio:.6g} in the median row; {v.diagnosis}" if ratio else
                       f"LSE only (the outputs are right); {v.diagnosis}")
        v.metrics["axis"] = "lse"
    elif not v.diagnosis:
        v.diagnosis, v.metrics["axis"] = _non_row_diagnosis(v)


def _non_row_diagnosis(v: Verdict) -> tuple[str, str]:
    """The axis of a failure no output row shows: guard rows, the schedule, repeated runs."""
    failed = {c.name: c for c in v.failed_checks}
    if "guards" in failed:
        return f"output rows: writes outside the output ({failed['guards'].detail})", "output"
    if "metadata" in failed:
        return f"schedule: {failed['metadata'].detail.split('; ')[0]}", "schedule"
    if "determinism" in failed:
        return f"runs: {failed['determinism'].detail}", "runs"
    return "", ""


@dataclass
class Repeats:
    """The kernel run again on freshly built identical inputs: outputs, or why a run failed."""

    outputs: list[Output]
    problem: str = ""


def _check_determinism(inputs: Inputs, first: Output, repeats: Repeats,
                       checks: list[Check]) -> list[Where]:
    """Every repeat's output (and LSE) must be bitwise identical to the first run's."""
    ref_out = bits(first.out.detach().cpu())
    ref_lse = None if first.lse is None else bits(first.lse.detach().cpu())
    differ = torch.zeros(ref_out.shape[:2], dtype=torch.bool)
    problem = repeats.problem
    for run, again in enumerate(repeats.outputs, 2):
        out = bits(again.out.detach().cpu())
        if out.shape != ref_out.shape:
            problem = f"run {run} returned shape {tuple(out.shape)}, run 1 {tuple(ref_out.shape)}"
            break
        diff = out != ref_out  # attention [T, H, D]; the sparse-path ops' outputs have 1-2 dims
        differ |= diff.flatten(2).any(-1) if diff.dim() > 2 else diff
        if ref_lse is not None and again.lse is not None:
            lse = bits(again.lse.detach().cpu())
            if lse.shape == ref_lse.shape:
                differ |= (lse != ref_lse).reshape(differ.shape)
    n = int(differ.sum())
    runs = len(repeats.outputs) + 1
    detail = problem or (f"{n} of {differ.numel()} rows differ bitwise across {runs} runs "
                         "on identical inputs" if n else "")
    checks.append(Check("determinism", not (n or problem), float(n), 0.0, detail))
    return localise(inputs, differ, differ.double(), 0.0, "determinism") if n else []


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of a float tensor: bitwise comparison, NaN payloads included."""
    return fp8.as_ints(t)


def _judge_numerics(v: Verdict, case: Case, inputs: Inputs, output: Output, gold: Result,
                    baselines: Output | Sequence[Output], ideal: Result | None
                    ) -> torch.Tensor | None:
    """The numeric checks; the rows [T, H] some check failed (None: the shape is wrong)."""
    checks, where = v.checks, v.where
    # full-size tensors stay where they are (the case's device): by_rows brings rows home
    out = output.out.detach()
    g_out, g_lse = gold.out.detach(), gold.lse.detach().cpu()
    family = [baselines] if isinstance(baselines, Output) else list(baselines)
    # the peak-rounded baseline bounds nothing itself: it gives FP8 rows their allowance
    peak = [b.out.detach().to(out.device) for b in family
            if b.metadata.get("baseline") == PEAK_ROUNDED]
    family = [b for b in family if b.metadata.get("baseline") != PEAK_ROUNDED]
    baseline = family[0]  # the eager one: its LSE (every family's LSE is the same quantity)
    b_outs = [b.out.detach().to(out.device) for b in family]

    expect = tuple(g_out.shape)
    if tuple(out.shape) != expect:
        checks.append(Check("shape", False, detail=f"output shape {tuple(out.shape)} != {expect}"))
        return None
    g_out = g_out.to(out.device)

    # NaN/Inf exactly where the golden has them (row level); those rows leave the numeric checks.
    k_bad = ~finite_rows(out)
    g_bad = ~finite_rows(g_out)
    mismatch = k_bad ^ g_bad
    checks.append(Check("nonfinite", not bool(mismatch.any()), float(mismatch.sum()), 0.0,
                        _nonfinite_detail(k_bad, g_bad)))
    if mismatch.any():
        where += localise(inputs, mismatch, torch.full(mismatch.shape, float("inf")), 0.0, "nonfinite")
    finite = ~(k_bad | g_bad)

    # Per-row error vs the exact golden, bounded by the baseline's worst row: over every row
    # where the golden and the baseline are finite, whatever the kernel returned there (a
    # kernel's NaN rows must not shrink the bound its other rows, and its probes, are held to).
    q_fmt, p_fmt = case.quant.q, tol.compute_format(case.quant.q, case.quant.kv)
    # Which of the P-rounding family (harness.baselines) bounds what. A correct kernel that
    # rounds the row's largest weight (P / l, or a lazily rescaled max) errs by |v| x that
    # rounding on a row one key dominates. With FP8 P (3 mantissa bits) that moves whole rows:
    # every check takes the family's worse. With 16-bit P it shows in single elements only
    # (an outlier V channel under a dominant key: torch-lazy reached 4.4x the eager
    # baseline's largest element error, fp16, premerge seed 2, while its rows and RMS stayed
    # within the eager bounds over 20 seeds): the largest-element check takes the family, the
    # row, tensor and RMS checks keep the eager baseline, whose bounds caught faults the
    # family's lose (fault:kv-clamp-8k on one 8193-key request; one request slightly off).
    rows_outs = b_outs if p_fmt.startswith("fp8") else b_outs[:1]
    err = by_rows(row_errors, out, g_out).masked_fill(~finite, 0.0)
    base = max(_worst_row(b, g_out, g_bad) for b in rows_outs)
    floor = tol.row_floor(q_fmt)
    bound = min(tol.ROW_FACTOR * base + floor, tol.ROW_BUDGET[p_fmt])
    detail = (f"bound = min({tol.ROW_FACTOR:g} x baseline worst row {base:.3g} + floor "
              f"{floor:.3g}, budget {tol.ROW_BUDGET[p_fmt]:.3g})")
    row_bound = torch.full_like(err, bound)
    if p_fmt.startswith("fp8") and peak:  # per row: see tolerances.PEAK_ROUNDOFFS
        row_bound, detail = _fp8_row_bounds(b_outs[0], peak[0], g_out, g_bad, bound, floor)
    bad = err > row_bound
    # the row closest to (or furthest past) its own bound is the one the check reports
    at = int(torch.argmax(err / row_bound.clamp_min(torch.finfo(torch.float64).tiny))) \
        if err.numel() else 0
    worst = float(err.flatten()[at]) if err.numel() else 0.0
    case_bound, bound = bound, float(row_bound.flatten()[at]) if err.numel() else bound
    checks.append(Check("row_error", not bool(bad.any()), worst, bound,
                        f"{int(bad.sum())} of {int(finite.sum())} rows; {detail}"))
    if bad.any():
        where += localise(inputs, bad, err, bound, "row_error")

    # Tensor-wide relative L2 (on finite rows).
    t_err = masked_rel_l2(out, g_out, finite)
    t_base = max(masked_rel_l2(b, g_out, finite, nan_to_num=True) for b in rows_outs)
    t_bound = tol.TENSOR_FACTOR * t_base + floor
    checks.append(Check("tensor_rel_l2", t_err <= t_bound, t_err, t_bound))

    # The rows together, without the row floor: errors small on every row but systematic.
    b_fin = finite.clone()  # finite: the kernel's and the golden's rows
    for b in b_outs:
        b_fin &= finite_rows(b)
    systematic = _check_systematic(case, inputs, out, g_out, rows_outs, b_outs, err, b_fin,
                                   checks, v.metrics)

    # LSE (natural log), where the case asks for it.
    wants_lse = case.return_lse
    failing = mismatch | bad  # every row some check fails: what diagnose() reads
    if wants_lse and output.lse is not None:
        found, lse_bad = _check_lse(inputs, output.lse.detach().cpu(), g_lse, baseline, checks,
                                    case_bound if tol.LSE_WITHIN_ROW_BOUND else 0.0,
                                    v.metrics)
        where += found
        if lse_bad is not None:
            failing |= lse_bad.reshape(failing.shape)
    elif wants_lse:
        # only a backend whose capability takes LSE runs a case that requires it
        # (Capability.why_not): dropping it takes a reason (e.g. the AITER adapter's note on a
        # library version whose LSE is known wrong)
        checks.append(unreturned_output_check(
            "lse", "LSE", output.metadata,
            "the case requires the LSE and the backend's capability declares one"
            if case.requires_lse else ""))

    # What quantisation costs: error vs the golden on unquantised inputs. A correct kernel loses
    # what the baseline loses on the same quantised inputs (ill-conditioned stress inputs lose
    # a lot in every format); beyond that and beyond the format's budget is the kernel's own
    # loss. Non-finite output where the unquantised golden is finite always fails: the cast
    # itself overflowed (unit-scale FP8, bug class 7).
    if ideal is not None:
        found, ideal_bad = _check_ideal(case, inputs, out, rows_outs, ideal, p_fmt, checks,
                                        v.metrics)
        where += found
        failing |= ideal_bad

    v.metrics.update(
        worst_row=worst, bound=bound, baseline_worst_row=base, tensor_rel_l2=t_err,
        baseline_tensor_rel_l2=t_base,
        max_abs=float(by_rows(row_max_abs, out, g_out).masked_fill(~finite, 0).max()),
        max_cosine_distance=float(by_rows(row_cosine_distance, out, g_out)
                                  .masked_fill(~finite, 0).max()),
        rows=int(err.numel()),
    )
    pool = inputs.paged_pool
    if pool is not None:  # where the live pages really sit (a >2 GB case must reach 2^31)
        top = max(pool.byte_range(r)[1] for r in range(pool.table.batch))
        v.metrics.update(pool_bytes=pool.nbytes, live_top_byte=top,
                         live_region=byte_region(0, top, case.placement.offset_bits))
    if any(not c.passed for c in checks):
        found_axis = diagnose(case, inputs, failing, err, out.cpu(), bound,
                              explain_kv=bool((mismatch | bad).any())) or systematic
        if found_axis is not None:
            v.diagnosis, v.metrics["axis"] = found_axis.text, found_axis.axis
    return failing


def _fp8_row_bounds(eager: torch.Tensor, peak: torch.Tensor, g_out: torch.Tensor,
                    g_bad: torch.Tensor, case_bound: float, floor: float
                    ) -> tuple[torch.Tensor, str]:
    """Each FP8 row's bound [T, H] and its description: the smaller of the case-wide bound
    (the P-rounding family's worst row) and max(ROW_FACTOR x the eager baseline's worst row
    + floor, FP8_OWN_ROW_FACTOR x the eager baseline's error on the row + the allowance for
    rounding the row's largest weight (with its near ties) + floor), the allowance being how
    far the peak-rounded baseline moves the row from the eager one (relative to the golden
    row): a kernel that rounds the largest weight has room for that rounding where the row
    carries it, not on every row (tolerances.PEAK_ROUNDOFFS)."""
    e_err = _baseline_row_errors(eager, g_out, g_bad)
    e_worst = float(e_err.max()) if e_err.numel() else 0.0

    def allowance(p: torch.Tensor, e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        norm = g.double().norm(dim=-1).clamp_min(tol.TINY_ROW_NORM * g.shape[-1] ** 0.5)
        return (p.double() - e.double()).norm(dim=-1) / norm

    allow = by_rows(allowance, peak, eager, g_out)
    allow = torch.where(torch.isfinite(allow), allow, torch.full_like(allow, math.inf))
    own = tol.FP8_OWN_ROW_FACTOR * e_err + allow + floor
    row_bound = torch.minimum(torch.full_like(e_err, case_bound),
                              torch.clamp(own, min=tol.ROW_FACTOR * e_worst + floor))
    return row_bound, (f"bound per row = min(the family's {case_bound:.3g}, max({tol.ROW_FACTOR:g} x "
                       f"eager worst row {e_worst:.3g} + floor {floor:.3g}, "
                       f"{tol.FP8_OWN_ROW_FACTOR:g} x eager row + largest-weight rounding + floor))")


def _check_systematic(case: Case, inputs: Inputs, out: torch.Tensor, g_out: torch.Tensor,
                      b_outs: list[torch.Tensor], element_outs: list[torch.Tensor],
                      err: torch.Tensor, rows: torch.Tensor, checks: list[Check],
                      metrics: dict[str, Any]) -> Diagnosis | None:
    """The rows judged together against the baseline's, without the row floor (errors small
    on every row but systematic): the RMS of the row errors, and FlashAttention's rule on the
    largest element error; where P has 16 bits or more (tol.SYSTEMATIC_P_FORMATS). `rows`:
    where the kernel, the golden and every baseline are finite. The RMS is bounded by the
    baselines `b_outs`, the largest element by the worst of `element_outs` (the P-rounding
    family: a correct kernel of any family passes; see _judge_numerics for why they differ).
    Returns the failure's axis (which requests carry the excess) when either check fails."""
    n = int(rows.sum())
    if n == 0 or tol.compute_format(case.quant.q, case.quant.kv) not in tol.SYSTEMATIC_P_FORMATS:
        return None
    out_fmt = tol.output_format(case.quant.q)
    b_errs = [by_rows(row_errors, b, g_out) for b in b_outs]
    rms_k, rms_b = rms(err[rows]), max(rms(e[rows]) for e in b_errs)
    rms_floor = tol.RMS_FLOOR_ROUNDOFFS * tol.OUTPUT_ROUNDOFF[out_fmt]
    rms_bound = max(tol.RMS_FACTOR * rms_b, rms_floor)
    rms_ok = rms_k <= rms_bound
    checks.append(Check("rms_error", rms_ok, rms_k, rms_bound,
                        f"RMS of {n} rows' errors = {_ratio(rms_k, rms_b)} the baseline's "
                        f"{rms_b:.3g}; bound = max({tol.RMS_FACTOR:g} x baseline, floor "
                        f"{rms_floor:.3g}) (FlashAttention's 2x on the rows' RMS, no row floor)"))

    # per-row largest element errors [T, H] (row slices, where the tensors are)
    d_k = by_rows(row_max_abs, out, g_out).masked_fill(~rows, 0.0)
    a_k = float(d_k.max())
    a_b = max(float(by_rows(row_max_abs, b, g_out).masked_fill(~rows, 0.0).max())
              for b in element_outs)
    g_max = float(by_rows(lambda g: g.double().abs().amax(-1), g_out).masked_fill(~rows, 0.0).max())
    kind = "prefill" if Op(case.op).unit == "segment" else "decode"  # decode: from a KV cache
    factor = tol.MAX_ABS_FACTOR[kind]
    abs_floor = tol.MAX_ABS_FLOOR_ULPS * tol.OUTPUT_ULP[out_fmt] * g_max
    abs_bound = max(factor * a_b, abs_floor)
    t, h = divmod(int(torch.argmax(d_k)), d_k.shape[1])  # (torch.unravel_index: ~3 s to import)
    abs_ok = a_k <= abs_bound
    checks.append(Check("max_abs_error", abs_ok, a_k, abs_bound,
                        f"largest |out - golden| (token {t}, head {h}) = {_ratio(a_k, a_b)} the "
                        f"baseline's largest {a_b:.3g}; bound = max({factor:g} x baseline, "
                        f"{tol.MAX_ABS_FLOOR_ULPS:g} output ulp at max |golden| {abs_floor:.3g}) "
                        f"(FlashAttention's {kind} rule)"))
    metrics.update(rms_error=rms_k, baseline_rms_error=rms_b, max_abs_error=a_k,
                   baseline_max_abs_error=a_b)
    if rms_ok and abs_ok:
        return None
    b_err = torch.stack(b_errs).amax(0).masked_fill(~rows, 0.0)  # the family's worst, per row
    return diagnose_systematic(case, inputs, rows, err, b_err, rms_floor,
                               None if abs_ok else (t, h, a_k / a_b if a_b else math.inf))


def _ratio(value: float, base: float) -> str:
    return f"{value:.3g} ({value / base:.2f}x)" if base > 0 else f"{value:.3g} (baseline exact)"


def _check_ideal(case: Case, inputs: Inputs, out: torch.Tensor, b_outs: list[torch.Tensor],
                 ideal: Result, p_fmt: str, checks: list[Check], metrics: dict[str, Any]
                 ) -> tuple[list[Where], torch.Tensor]:
    i_out = ideal.out.detach().to(out.device)
    i_fin = finite_rows(i_out)
    i_err = by_rows(row_errors, out, i_out)
    i_err = torch.where(torch.isfinite(i_err), i_err, torch.full_like(i_err, float("inf")))
    b_worst = 0.0
    for b_out in b_outs:  # the worst of the baseline families
        b_err = by_rows(row_errors, b_out, i_out).masked_fill(~i_fin, 0.0)
        b_err = torch.where(torch.isfinite(b_err), b_err, torch.zeros_like(b_err))
        b_worst = max(b_worst, float(b_err.max()) if b_err.numel() else 0.0)
    budget = tol.IDEAL_BUDGET[p_fmt]
    bound = max(budget, tol.ROW_FACTOR * b_worst + tol.row_floor(case.quant.q))
    lost = i_fin & ~finite_rows(out)
    bad = ((i_err > bound) & i_fin) | lost
    overflow = input_overflow(inputs)
    metrics["ideal_worst_row"] = float(i_err.masked_fill(~i_fin, 0).max()) if i_err.numel() else 0.0
    metrics["baseline_ideal_worst_row"] = b_worst
    metrics["inputs_overflowed"] = overflow
    detail = (f"{int(bad.sum())} rows; bound = max(budget {budget:.3g}, {tol.ROW_FACTOR:g} x baseline "
              f"{b_worst:.3g} + floor)")
    if int(lost.sum()):
        detail += f"; {int(lost.sum())} rows NaN/Inf where the unquantised golden is finite"
    if overflow:
        detail += f"; {overflow} input elements beyond the format's max before the cast"
    checks.append(Check("quantisation_loss", not bool(bad.any()), metrics["ideal_worst_row"], bound,
                        detail))
    return (localise(inputs, bad, i_err, bound, "quantisation_loss") if bad.any() else []), bad


def _baseline_row_errors(b_out: torch.Tensor, g_out: torch.Tensor, g_bad: torch.Tensor
                         ) -> torch.Tensor:
    """A baseline's row errors [T, H], 0 where it or the golden is not finite."""
    return by_rows(row_errors, b_out, g_out).masked_fill(g_bad | ~finite_rows(b_out), 0.0)


def _worst_row(b_out: torch.Tensor, g_out: torch.Tensor, g_bad: torch.Tensor) -> float:
    """A baseline's worst row error over the rows where it and the golden are finite."""
    b_err = _baseline_row_errors(b_out, g_out, g_bad)
    return float(b_err.max()) if b_err.numel() else 0.0


def input_overflow(inputs: Inputs) -> int:
    """Input elements whose magnitude exceeded the stored format's max (saturated or NaN)."""
    from mlacheck import fp8

    if isinstance(inputs, PrefillInputs):
        qs = [inputs.q, inputs.k, inputs.v]
    elif isinstance(inputs.kv, list):
        qs = [inputs.q, *inputs.kv]
    else:  # sparse prefill: one flat latent KV
        qs = [inputs.q, inputs.kv]
    n = 0
    for t in qs:
        f = fp8.fmt(t.fmt)
        if f.is_fp8:
            n += int(((t.ideal.float() / t.scale).abs() > f.max).sum())
    return n


def unreturned_output_check(name: str, what: str, metadata: Mapping[str, Any],
                            required: str) -> Check:
    """The check `name` of an output (`what`) the backend did not return. Where the case
    requires it (`required` says why; "" where it is optional) and the backend said no reason
    in `Output.metadata[name]`, a FAIL: an output dropped silently is never a pass. Otherwise
    "not checked", with the backend's reason in the detail."""
    why = metadata.get(name)
    if required and not why:
        return Check(name, False, detail=f"{required}, but the backend returned none and said "
                                         f"no reason (Output.metadata[{name!r}])")
    return Check(name, True, detail=f"backend returns no {what} (capability); not checked"
                                    + (f": {why}" if why else ""))


def _check_lse(inputs: Inputs, lse: torch.Tensor, g_lse: torch.Tensor, baseline: Output,
               checks: list[Check], row_bound: float, metrics: dict[str, Any]
               ) -> tuple[list[Where], torch.Tensor | None]:
    if tuple(lse.shape) != tuple(g_lse.shape):
        checks.append(Check("lse", False, detail=f"LSE shape {tuple(lse.shape)} != {tuple(g_lse.shape)}"))
        return [], None
    lse, g = lse.double(), g_lse.double()
    g_empty = torch.isneginf(g)
    same_empty = torch.isneginf(lse) == g_empty
    diff = (lse - g).abs().masked_fill(g_empty, 0.0)
    diff = torch.where(torch.isfinite(lse) | g_empty, diff, torch.full_like(diff, float("inf")))
    diff = diff.masked_fill(~same_empty, float("inf"))
    b = baseline.lse.detach().cpu().double() if baseline.lse is not None else g
    b_diff = (b - g).abs().masked_fill(g_empty | ~torch.isfinite(b), 0.0)
    own = tol.LSE_FACTOR * float(b_diff.max()) + tol.LSE_FLOOR
    bound = max(own, row_bound)
    bad = diff > bound
    usable = torch.isfinite(lse) & torch.isfinite(g) & (g.abs() > LSE_RATIO_MIN)
    if bool(usable.any()):  # a units mix-up shows as a constant ratio (base 2: 1.4427)
        metrics["lse_ratio"] = float((lse[usable] / g[usable]).median())
    checks.append(Check("lse", not bool(bad.any()), float(diff.max()), bound,
                        f"{int(bad.sum())} rows; natural-log LSE; bound = max({tol.LSE_FACTOR:g} x "
                        f"baseline {float(b_diff.max()):.3g} + floor, output row bound {row_bound:.3g})"))
    return (localise(inputs, bad, diff, bound, "lse") if bad.any() else []), bad


def _nonfinite_detail(k_bad: torch.Tensor, g_bad: torch.Tensor) -> str:
    extra, missing = int((k_bad & ~g_bad).sum()), int((g_bad & ~k_bad).sum())
    parts = []
    if extra:
        parts.append(f"{extra} rows NaN/Inf where the golden is finite (reads poisoned pages/tails?)")
    if missing:
        parts.append(f"{missing} rows finite where the golden is NaN/Inf")
    return "; ".join(parts)


# Diagnoses a probe can sharpen: whole requests / segments failing, or every row (each unit
# run alone, and the pages relocated), and KV positions (the pages relocated: a KV position
# explanation holds wherever the pages sit; when the same tokens on low pages pass, the
# placement is the cause, e.g. a 32-bit offset wrap whose wrong pages hold NaN like a tail).
ALONE_AXES = frozenset({"all", "requests", "segments"})
PROBED_AXES = ALONE_AXES | {"kv"}


def _passes(got: Output, gold_out: torch.Tensor, bound: float) -> bool:
    out = got.out.detach()
    if tuple(out.shape) != tuple(gold_out.shape) or not bool(finite_rows(out).all()):
        return False
    return (float(by_rows(row_errors, out, gold_out.to(out.device)).max()) <= bound
            if out.numel() else True)


# Checks a probe does not re-judge (it compares output rows with the row bound): a failure of
# these alone is not cleared by a probe that passes (the LSE, the rows judged together).
NOT_PROBED = frozenset({"lse", "rms_error", "max_abs_error"})


def refine_diagnosis(v: Verdict, inputs: Inputs, gold: Result, probes: Probes) -> None:
    """What the probes show: a batch that fails where each unit passes alone, or pages that
    fail where the same tokens on low pages pass."""
    if {c.name for c in v.failed_checks} <= NOT_PROBED:
        return
    bound = float(v.metrics.get("bound", 0.0))
    g = gold.out.detach()  # compared where it is (_passes)
    case = inputs.case
    unit = case.unit_name
    if probes.relocated is not None and _passes(probes.relocated, g, bound):
        pool = inputs.paged_pool
        assert pool is not None
        top = int(pool.table.indices.max())
        top_byte = (top + 1) * pool.page_bytes
        v.diagnosis = (f"pool region / pages: the same tokens on pages "
                       f"0..{pool.table.indices.numel() - 1} pass, so page placement is "
                       f"mishandled (live page ids up to {top}"
                       f"{' (past 2^16)' if top >= 1 << 16 else ' (past 2^15)' if top >= 1 << 15 else ''}"
                       f", bytes up to {top_byte:#x}, "
                       f"{byte_region(0, top_byte, case.placement.offset_bits)})")
        v.metrics["axis"] = "pool"
        return
    cuts = inputs.row_bounds
    alone = {u: _passes(o, g[cuts[u] : cuts[u + 1]], bound) for u, o in probes.alone.items()}
    if alone and all(alone.values()) and v.metrics.get("axis") in ALONE_AXES:
        failing = [w.request for w in v.where]
        units = sorted(set(failing)) or sorted(alone)
        shared = shared_properties(case, inputs, units)
        fails, passes = ("fails", "passes") if len(units) == 1 else ("fail", "pass")
        v.diagnosis = (f"{units_phrase(case, units)} {fails} in the batch but {passes} alone "
                       f"(probed "
                       f"{ranges(sorted(alone))}): the batch indexing (offsets of {unit}s in "
                       f"qo_indptr / cu_seqlens / the page table) is wrong"
                       + (f"; the failing ones share {shared}" if shared else ""))
        v.metrics["axis"] = f"{unit}s"
