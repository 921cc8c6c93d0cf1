"""How the DeepSeek-V3.2 sparse-pipeline ops are judged (judge.verdict dispatches here).

- indexer logits (mqa_logits, paged_mqa_logits): every position the golden masks (-inf) is
  -inf, every other position is finite and within tolerances.logit_bound of the golden
  logit (an error scale from the logit's magnitude, the sum of |terms|) ("mask",
  "logit_error");
- top-k (topk_indices): the selection is a top-k of exactly the given logits, ties free
  (golden.topk.check_selection: no duplicate, masked or out-of-range position, -1 padding,
  min(k, visible) entries) ("selection"), recall and margin reported;
- index conversion: the same global slots per token as the golden (order free), and for the
  ragged layout the same offsets ("indptr", "slots");
- sparse prefill: the attention rules of mlacheck.judge (output rows, LSE, guards,
  quantisation loss) plus the max scaled score per row ("max_logits", the LSE's rule);
- the composed path: its selection judged tie-aware against the GOLDEN logits with the logit
  bound (a near-tie may go either way, a wrong selection fails here), and its attention
  against the golden attention on its OWN selection with the attention rules: on rows where
  the two selections agree that is the golden attention on the golden selection, elsewhere
  it moves by the near-tie allowance (metric `selection_allowance`, the largest such row
  distance), so a correct path never fails for a near-tie and a wrong one fails either way.

Every failure says where (request / segment and token rows) and, on the first line, along
which axis: "window" (positions outside the rows' windows), "all" (every unit: a global
cause), "rows", "selection", "slots", "max_logits".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from mlacheck import judge as attention_judge
from mlacheck import sparse_index
from mlacheck import tolerances as tol
from mlacheck.backends.base import Output
from mlacheck.golden import pipeline_ops
from mlacheck.golden.topk import check_selection
from mlacheck.ops import Op
from mlacheck.spec import Case
from mlacheck.verdict import Check, Verdict, Where, ranges

# Show at most this many problem rows in a check's detail.
DETAIL_ROWS = 3


def judge(v: Verdict, case: Case, inputs: Any, output: Output, gold: Any,
          baseline: Output | Sequence[Output], ideal: Any) -> None:
    """Fill v's checks, locations, metrics and diagnosis (the caller sets the status).
    `baseline`: one Output or a family of them (mlacheck.harness.baselines: the eager
    baseline, and where the attention rounds P the P-rounding family too)."""
    family = [baseline] if isinstance(baseline, Output) else list(baseline)
    if case.op in _FAMILY_JUDGES:
        _FAMILY_JUDGES[case.op](v, case, inputs, output, gold, family, ideal)
    else:
        _JUDGES[case.op](v, case, inputs, output, gold, family[0], ideal)
    # the guard rows: judge.verdict checks them for every op (a write outside the output is
    # diagnosed there, judge._non_row_diagnosis)


# --------------------------------------------------------------------------- locations


def _rows_where(case: Case, inputs: Any, bad: torch.Tensor, worst: torch.Tensor, bound: float,
                check: str) -> list[Where]:
    """Group bad rows [R] by unit (request / segment): token range and worst value."""
    cuts = inputs.row_bounds
    kv = list(case.kv_lengths)  # type: ignore[union-attr]
    found = []
    for u in range(len(cuts) - 1):
        blk = bad[cuts[u]:cuts[u + 1]]
        if not bool(blk.any()):
            continue
        tok = torch.nonzero(blk).flatten()
        found.append(Where(check, u, (cuts[u] + int(tok[0]), cuts[u] + int(tok[-1])),
                           (int(tok[0]), int(tok[-1])), [],
                           float(worst[cuts[u]:cuts[u + 1]][blk].max()), bound, kv_len=kv[u]))
    return found


def _units_of(inputs: Any, rows: torch.Tensor) -> list[int]:
    cuts = torch.tensor(inputs.row_bounds)
    return sorted(set((torch.searchsorted(cuts, rows, right=True) - 1).tolist()))


def _scope(case: Case, inputs: Any, bad_rows: torch.Tensor) -> str:
    """'every request' / 'requests 0,2 of 3' for rows [R] failing."""
    unit = case.unit_name
    live = [u for u in range(len(inputs.row_bounds) - 1)
            if inputs.row_bounds[u + 1] > inputs.row_bounds[u]]
    bad = _units_of(inputs, torch.nonzero(bad_rows).flatten())
    if len(bad) == len(live):
        return f"every {unit}" if len(live) > 1 else f"every row of the case's only {unit}"
    return f"{unit}{'s' if len(bad) > 1 else ''} {ranges(bad)} of {len(live)}"


# --------------------------------------------------------------------------- logits


def _logits(v: Verdict, case: Case, inputs: Any, output: Output, gold: Any, baseline: Output,
            ideal: Any) -> None:
    out = output.out.detach().cpu().float()
    g, mag = gold.out.detach().cpu().double(), gold.magnitude.detach().cpu().double()
    if tuple(out.shape) != tuple(g.shape):
        v.checks.append(Check("shape", False, detail=f"logits shape {tuple(out.shape)} != "
                                                     f"{tuple(g.shape)}"))
        return
    masked = torch.isneginf(g)
    k_masked = torch.isneginf(out)
    extra, missing = masked & ~k_masked, ~masked & k_masked
    wrong = extra | missing
    v.checks.append(Check("mask", not bool(wrong.any()), float(wrong.sum()), 0.0,
                          _mask_detail(extra, missing)))
    bound = tol.logit_bound(mag)
    visible = ~masked & ~k_masked
    err = (out.double() - g).abs()
    ratio = torch.where(visible, err / bound.clamp_min(1e-300), torch.zeros_like(err))
    ratio = torch.where(visible & ~torch.isfinite(out), torch.full_like(ratio, math.inf), ratio)
    ratio = torch.where(visible & (bound == 0) & (err == 0), torch.zeros_like(ratio), ratio)
    bad = ratio > 1.0
    worst = float(ratio.max()) if ratio.numel() else 0.0
    b = baseline.out.detach().cpu().double()
    b_ratio = torch.where(visible & torch.isfinite(b), (b - g).abs() / bound.clamp_min(1e-300),
                          torch.zeros_like(err)) if b.shape == g.shape else torch.zeros(1)
    v.checks.append(Check("logit_error", not bool(bad.any()), worst, 1.0,
                          f"{int(bad.sum())} of {int(visible.sum())} visible logits beyond "
                          f"{tol.LOGIT_BOUND_ROUNDOFFS:g} x 2^{int(math.log2(tol.LOGIT_ACCUM_ROUNDOFF))}"
                          f" x their magnitude (value: worst |error| / bound)"))
    v.metrics.update(worst_logit_ratio=worst, baseline_worst_logit_ratio=float(b_ratio.max()),
                     logits=int(visible.sum()), rows=int(out.shape[0]),
                     max_abs=float(err.masked_fill(~visible, 0).max()) if err.numel() else 0.0)
    usable = visible & torch.isfinite(out) & (g.abs() > 0)
    if bool(usable.any()):  # a scale applied twice / not at all shows as a constant ratio
        v.metrics["logit_ratio"] = float((out.double()[usable] / g[usable]).median())
    row_bad = (wrong | bad).any(1)
    row_worst = torch.where(wrong.any(1), torch.full_like(ratio[:, 0], math.inf),
                            ratio.amax(1)) if ratio.numel() else torch.zeros(0)
    if bool(extra.any()) or bool(missing.any()):
        v.where += _rows_where(case, inputs, wrong.any(1), row_worst, 0.0, "mask")
    if bool(bad.any()):
        v.where += _rows_where(case, inputs, bad.any(1), row_worst, 1.0, "logit_error")
    if bool(row_bad.any()):
        v.diagnosis, v.metrics["axis"] = _logits_diagnosis(case, inputs, extra, missing, bad,
                                                           v.metrics)


def _mask_detail(extra: torch.Tensor, missing: torch.Tensor) -> str:
    parts = []
    if bool(extra.any()):
        parts.append(f"{int(extra.sum())} positions the golden masks hold a value "
                     f"(in {int(extra.any(1).sum())} rows)")
    if bool(missing.any()):
        parts.append(f"{int(missing.sum())} visible positions are -inf")
    return "; ".join(parts)


def window_ends(inputs: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Each row's window [start, end) in its logits row's columns, and the page size the
    keys live in (0: unpaged)."""
    if hasattr(inputs, "k_end"):
        return inputs.k_start.long().cpu(), inputs.k_end.long().cpu(), 0
    vis = inputs.row_visible.long().cpu()
    return torch.zeros_like(vis), vis, inputs.pool.page_size


def _logits_diagnosis(case: Case, inputs: Any, extra: torch.Tensor, missing: torch.Tensor,
                      bad: torch.Tensor, metrics: dict[str, Any]) -> tuple[str, str]:
    if bool(extra.any()):
        start, end, ps = window_ends(inputs)
        rows, cols = torch.nonzero(extra, as_tuple=True)
        past = cols >= end[rows]
        one_past = cols == end[rows]
        words = [f"window: {int(extra.sum())} positions outside {int(extra.any(1).sum())} rows' "
                 f"windows hold values ({_scope(case, inputs, extra.any(1))})"]
        if bool(past.all()):
            words.append(f"all past the window end, {int(one_past.sum())} of them one past it")
            if ps and bool(past.any()):
                kv = torch.tensor(list(case.kv_lengths))[  # type: ignore[union-attr]
                    torch.as_tensor(inputs.row_request)[rows]]
                page_end = (kv + ps - 1) // ps * ps
                tail = (cols >= kv) & (cols < page_end)
                if bool(tail.all()):
                    words.append("every one in the partial last page's tail (past kv_len)")
        elif bool((cols < start[rows]).any()):
            words.append("some before the window start")
        return "; ".join(words), "window"
    if bool(missing.any()):
        return (f"window: {int(missing.sum())} visible positions masked "
                f"({_scope(case, inputs, missing.any(1))})"), "window"
    row_bad = bad.any(1)
    ratio = metrics.get("logit_ratio")
    hint = (f"; kernel / golden logit median ratio {ratio:.4g} (a scale applied twice or not "
            "at all?)" if isinstance(ratio, float) and abs(math.log(abs(ratio) + 1e-300)) > 0.2
            else "")
    share = f"{int(bad.sum())} of {metrics.get('logits', bad.numel())}"
    scope = _scope(case, inputs, row_bad)
    if scope.startswith("every"):
        return (f"{scope}: logits off in {int(row_bad.sum())} of {row_bad.numel()} rows "
                f"({share} positions): a global cause (scales, ReLU, weights){hint}"), "all"
    return f"rows of {scope}: logits off in {int(row_bad.sum())} rows{hint}", "rows"


# --------------------------------------------------------------------------- top-k


def _topk(v: Verdict, case: Case, inputs: Any, output: Output, gold: Any, baseline: Output,
          ideal: Any) -> None:
    sel = output.out.detach().cpu()
    if sel.dim() != 2 or sel.shape[0] != gold.out.shape[0] or sel.shape[1] < case.topk:  # type: ignore[union-attr]
        v.checks.append(Check("shape", False, detail=f"selection shape {tuple(sel.shape)}, "
                                                     f"expected [{gold.out.shape[0]}, "
                                                     f"{case.topk}]"))  # type: ignore[union-attr]
        return
    _selection(v, case, inputs, sel, gold.logits.detach().cpu(), tol.TOPK_LOGIT_BOUND)


def _selection(v: Verdict, case: Case, inputs: Any, sel: torch.Tensor, logits: torch.Tensor,
               bound: torch.Tensor | float) -> None:
    k = case.topk  # type: ignore[union-attr]
    rep = check_selection(sel, logits, bound, k)
    bad = ~rep.ok
    v.checks.append(Check("selection", rep.all_ok, float(bad.sum()), 0.0,
                          "; ".join(rep.problems[:DETAIL_ROWS])))
    finite = torch.isfinite(rep.margin)
    v.metrics.update(
        rows=int(bad.numel()),
        recall_min=float(rep.recall.min()) if rep.recall.numel() else 1.0,
        recall_mean=float(rep.recall.mean()) if rep.recall.numel() else 1.0,
        margin_min=float(rep.margin[finite].min()) if bool(finite.any()) else math.inf)
    if bool(bad.any()):
        worst = torch.where(bad, torch.ones_like(rep.margin), torch.zeros_like(rep.margin))
        v.where += _rows_where(case, inputs, bad, worst, 0.0, "selection")
        first = rep.problems[0] if rep.problems else ""
        v.diagnosis = (f"selection: {int(bad.sum())} of {bad.numel()} rows are not a top-{k} "
                       f"of their logits ({_scope(case, inputs, bad)}); {first}")
        v.metrics["axis"] = "selection"


# --------------------------------------------------------------------------- conversion


def _conversion(v: Verdict, case: Case, inputs: Any, output: Output, gold: Any,
                baseline: Output, ideal: Any) -> None:
    want = gold.out.detach().cpu().long()
    t = want.shape[0]
    if case.index_layout == "ragged":  # type: ignore[union-attr]
        indptr = output.extra.get("indptr")
        if indptr is None:
            v.checks.append(Check("indptr", False, detail="no indptr returned with the ragged "
                                                           "buffer"))
            return
        indptr = indptr.detach().cpu().long()
        ok = tuple(indptr.shape) == tuple(gold.indptr.shape) and torch.equal(indptr,
                                                                             gold.indptr.long())
        v.checks.append(Check("indptr", ok, detail="" if ok else
                              _indptr_detail(indptr, gold.indptr.long())))
        if not ok:
            bad_rows = _indptr_rows(indptr, gold.indptr.long(), t)
            v.where += _rows_where(case, inputs, bad_rows, bad_rows.double(), 0.0, "indptr")
            v.diagnosis = (f"slots: the ragged offsets are wrong from token "
                           f"{int(torch.nonzero(bad_rows).flatten()[0])} on "
                           f"({_scope(case, inputs, bad_rows)}): indptr "
                           f"{_head(indptr)} instead of {_head(gold.indptr)}")
            v.metrics["axis"] = "slots"
            return
        got = sparse_index.from_ragged(
            sparse_index.Ragged(output.out.detach().cpu().long()[: int(indptr[-1])], indptr),
            case.topk)  # type: ignore[union-attr]
    else:
        got = output.out.detach().cpu().long()
        if got.dim() != 2 or got.shape[0] != t:
            v.checks.append(Check("shape", False, detail=f"slots shape {tuple(got.shape)} != "
                                                         f"{tuple(want.shape)}"))
            return
    same = sparse_index.same_sets(got, want)
    bad = ~same
    v.checks.append(Check("slots", bool(same.all()), float(bad.sum()), 0.0,
                          _slots_detail(got, want, bad)))
    v.metrics.update(rows=t)
    if bool(bad.any()):
        v.where += _rows_where(case, inputs, bad, bad.double(), 0.0, "slots")
        v.diagnosis = (f"slots: {int(bad.sum())} of {t} tokens' slots differ "
                       f"({_scope(case, inputs, bad)}){_slots_pattern(got, want, bad)}")
        v.metrics["axis"] = "slots"


def _head(x: torch.Tensor, n: int = 6) -> str:
    vals = x.flatten().tolist()
    return "[" + ", ".join(map(str, vals[:n])) + (", ...]" if len(vals) > n else "]")


def _indptr_detail(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"indptr of {got.numel()} entries, expected {want.numel()}"
    first = int(torch.nonzero(got != want).flatten()[0])
    return f"indptr[{first}] = {int(got[first])}, expected {int(want[first])}"


def _indptr_rows(got: torch.Tensor, want: torch.Tensor, t: int) -> torch.Tensor:
    bad = torch.ones(t, dtype=torch.bool)
    if got.shape == want.shape:
        differ = (got[1:] != want[1:]) | (got[:-1] != want[:-1])
        bad = differ
    return bad


def _slots_detail(got: torch.Tensor, want: torch.Tensor, bad: torch.Tensor) -> str:
    out = []
    for t in torch.nonzero(bad).flatten()[:DETAIL_ROWS].tolist():
        g = set(got[t][got[t] >= 0].tolist())
        w = set(want[t][want[t] >= 0].tolist())
        extra, lost = sorted(g - w), sorted(w - g)
        out.append(f"token {t}: {len(g)} slots, {len(w)} expected"
                   + (f"; extra {extra[:3]}" if extra else "") + (f"; missing {lost[:3]}" if lost else ""))
    return "; ".join(out)


def _slots_pattern(got: torch.Tensor, want: torch.Tensor, bad: torch.Tensor) -> str:
    """A word on what the wrong rows have in common: padding made slots, a constant shift."""
    rows = torch.nonzero(bad).flatten()
    short = (want[rows] < 0).any(1)
    if bool(short.all()) and bool((got[rows] >= 0).sum(1).gt((want[rows] >= 0).sum(1)).all()):
        return ": only tokens with -1 padding, which got extra slots (-1 converted to a slot?)"
    return ""


# --------------------------------------------------------------------------- sparse prefill


def _sparse_prefill(v: Verdict, case: Case, inputs: Any, output: Output, gold: Any,
                    family: Sequence[Output], ideal: Any) -> None:
    attention_judge._judge_numerics(v, case, inputs, output, gold, family, ideal)
    baseline = family[0]  # the eager one: every family member's max logits are the same
    got = output.extra.get("max_logits")
    if got is None:  # an op's output, no capability's: left out only with a stated reason
        check = attention_judge.unreturned_output_check(
            "max_logits", "max logits", output.metadata, MAX_LOGITS_REQUIRED)
        v.checks.append(check)
        if not check.passed:
            _max_logits_alone(v, "none returned, no reason said (Output.metadata['max_logits'])")
        return
    bad = _check_row_scalar("max_logits", got.detach().cpu(), gold.max_logits.detach().cpu(),
                            baseline.extra.get("max_logits"), v.checks)
    if bad is not None and bool(bad.any()):
        rows = bad.any(1)
        v.where += _rows_where(case, inputs, rows, rows.double(), 0.0, "max_logits")
        _max_logits_alone(v, f"{int(bad.sum())} rows ({_scope(case, inputs, rows)})")


# Why a sparse prefill's max_logits is required of every backend (SparsePrefillCase: FlashMLA's
# flash_mla_sparse_fwd returns out, max_logits and LSE).
MAX_LOGITS_REQUIRED = "a sparse prefill's outputs are out, LSE and max_logits"


def _max_logits_alone(v: Verdict, what: str) -> None:
    """The diagnosis of a max_logits failure where every other check passes."""
    if all(c.passed for c in v.checks if c.name != "max_logits"):
        v.diagnosis = f"max_logits only (the outputs and LSE are right): {what}"
        v.metrics["axis"] = "max_logits"


def _check_row_scalar(name: str, got: torch.Tensor, gold: torch.Tensor,
                      baseline: torch.Tensor | None, checks: list[Check]) -> torch.Tensor | None:
    """A per-row score ([T, H], -inf where a row sees nothing) held to the LSE's rule: within
    LSE_FACTOR x the baseline's error + LSE_FLOOR, -inf exactly where the golden has it."""
    if tuple(got.shape) != tuple(gold.shape):
        checks.append(Check(name, False, detail=f"{name} shape {tuple(got.shape)} != "
                                                f"{tuple(gold.shape)}"))
        return None
    x, g = got.double(), gold.double()
    g_empty = torch.isneginf(g)
    diff = (x - g).abs().masked_fill(g_empty, 0.0)
    diff = torch.where(torch.isfinite(x) | g_empty, diff, torch.full_like(diff, math.inf))
    diff = diff.masked_fill(torch.isneginf(x) != g_empty, math.inf)
    b = baseline.detach().cpu().double() if baseline is not None else g
    b_diff = (b - g).abs().masked_fill(g_empty | ~torch.isfinite(b), 0.0)
    bound = tol.LSE_FACTOR * float(b_diff.max() if b_diff.numel() else 0.0) + tol.LSE_FLOOR
    bad = diff > bound
    checks.append(Check(name, not bool(bad.any()), float(diff.max()) if diff.numel() else 0.0,
                        bound, f"{int(bad.sum())} rows; bound = {tol.LSE_FACTOR:g} x baseline "
                               f"{float(b_diff.max()) if b_diff.numel() else 0.0:.3g} + floor"))
    return bad


# --------------------------------------------------------------------------- composed path


def _pipeline(v: Verdict, case: Case, inputs: Any, output: Output, gold: Any,
              family: Sequence[Output], ideal: Any) -> None:
    slots = output.extra.get("slots")
    if slots is None:
        v.checks.append(Check("selection", False, detail="the path returned no selection "
                                                         "(Output.extra['slots'])"))
        return
    slots = slots.detach().cpu().long()
    local = local_positions(inputs, slots)
    _selection(v, case, inputs, local, gold.logits.detach().cpu(),
               tol.logit_bound(gold.magnitude.detach().cpu().double()))
    selection_diagnosis = v.diagnosis
    gold_slots = gold_slots_of(inputs, gold.selection)
    ref = gold
    differ = ~sparse_index.same_sets(slots, gold_slots)
    if bool(differ.any()):
        ref = pipeline_ops.attention_on_slots(inputs, slots.to(inputs.device))
    v.metrics["selection_differs_rows"] = int(differ.sum())
    v.metrics["selection_allowance"] = (
        float(attention_judge.row_errors(ref.out.detach().cpu(), gold.out.detach().cpu())
              .nan_to_num(0.0).max()) if bool(differ.any()) else 0.0)
    bases = [_baseline_on_own_selection(inputs, b, gold, gold_slots, slots, ref) for b in family]
    twin_case = inputs.case.attention_case()
    twin = inputs.attention_with(torch.full_like(local, -1))
    attention_judge._judge_numerics(v, twin_case, twin, output, ref, bases, None)
    if selection_diagnosis:
        v.diagnosis, v.metrics["axis"] = selection_diagnosis, "selection"


def local_positions(inputs: Any, slots: torch.Tensor) -> torch.Tensor:
    """Global slots [T, K] -> request-local positions of each token's own request (-1 kept);
    a slot outside the request's live positions becomes the logits width (out of range)."""
    idx = inputs.indexer
    width = idx.width
    table = idx.block_table.long().cpu()
    ps = inputs.case.page_size
    req = idx.row_request.long()
    lens = idx.context_lens.long().cpu()
    n_slots = idx.pool.num_pages * ps
    out = torch.full_like(slots, -1)
    for b in torch.unique(req).tolist():
        rows = torch.nonzero(req == b).flatten()
        pos = torch.arange(int(lens[b]))
        where = torch.full((n_slots,), width, dtype=torch.long)
        where[table[b, pos // ps] * ps + pos % ps] = pos
        s = slots[rows]
        inside = (s >= 0) & (s < n_slots)
        mapped = torch.where(inside, where[s.clamp(0, n_slots - 1)], torch.full_like(s, width))
        out[rows] = torch.where(s < 0, torch.full_like(s, -1), mapped)
    return out


def gold_slots_of(inputs: Any, selection: torch.Tensor) -> torch.Tensor:
    idx = inputs.indexer
    req = sparse_index.token_requests(idx.qo_indptr.cpu())
    return sparse_index.to_global_slots(selection.cpu(), req, idx.block_table.cpu(),
                                        inputs.case.page_size, idx.context_lens.cpu())


def _baseline_on_own_selection(inputs: Any, baseline: Output, gold: Any,
                               gold_slots: torch.Tensor, slots: torch.Tensor,
                               ref: Any) -> Output:
    """The baseline's output as a bound for the kernel's: its rounding error only. Rows where
    the baseline selected other slots than the golden (near-ties, or than the kernel) are
    replaced by the reference's own rows (they measure a selection, not rounding)."""
    b_slots = baseline.extra.get("slots")
    out, lse = baseline.out.detach().cpu().clone(), baseline.lse
    if b_slots is None:
        return Output(ref.out.detach().cpu().clone(), ref.lse, metadata=dict(baseline.metadata))
    b_slots = b_slots.detach().cpu().long()
    other = ~sparse_index.same_sets(b_slots, gold_slots) | ~sparse_index.same_sets(b_slots, slots)
    if bool(other.any()):
        out[other] = ref.out.detach().cpu()[other].to(out.dtype)
        if lse is not None:
            lse = lse.detach().cpu().clone()
            lse[other] = ref.lse.detach().cpu()[other].to(lse.dtype)
    return Output(out, lse, metadata=dict(baseline.metadata))  # which baseline (harness)


_JUDGES = {
    Op.MQA_LOGITS: _logits,
    Op.PAGED_MQA_LOGITS: _logits,
    Op.TOPK: _topk,
    Op.INDEX_CONVERSION: _conversion,
}
# The ops whose attention is bounded by the whole baseline family (harness.baselines).
_FAMILY_JUDGES = {Op.SPARSE_PREFILL: _sparse_prefill, Op.SPARSE_PIPELINE: _pipeline}
