"""Top-k selection over indexer logits: the reference selection and a tie-aware check.

An implementation computes the logits with rounding errors, then selects; where golden
logits are closer than those errors, any order between them is correct. So a selection is
judged against the golden logits L and a per-position error bound E (what the judge derives
from the logits' magnitudes), never by comparing index sets exactly:

    a selected set S of row r is CORRECT  <=>  it is a top-k set of SOME logits within E of L
      <=>  no duplicate, no masked (-inf) or out-of-range position, |S| = min(k, valid),
           and  min over j in S of (L_j + E_j)  >=  max over valid i not in S of (L_i - E_i).

The last difference is the *margin* (>= 0: consistent; < 0: by how much not). This implies
what one would ask of a top-k by hand: every chosen position's logit is within the error
bounds of the k-th largest, and every position clearly above it (by more than the bounds)
is chosen. Recall against the reference selection is reported beside it: below 1 it only
says how many near-ties went the other way.

Index rows are [R, k] of request-local positions, -1 padded, in any order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlacheck.golden.core import score_block_elements


def reference_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[R, k] int64: each row's k largest logits' positions, largest first, ties to the lower
    position (a stable sort), -1 where the row has fewer than k unmasked positions."""
    rows, width = logits.shape
    out = torch.full((rows, k), -1, dtype=torch.int64, device=logits.device)
    if width == 0 or k == 0:
        return out
    order = torch.sort(logits, dim=1, descending=True, stable=True)
    take = min(k, width)
    pos = order.indices[:, :take]
    keep = torch.isfinite(order.values[:, :take]) | (order.values[:, :take] > 0)
    out[:, :take] = torch.where(keep, pos, torch.full_like(pos, -1))
    return out


@dataclass
class SelectionReport:
    """Per row: whether the selection is correct, and the numbers that say why."""

    ok: torch.Tensor  # [R] bool
    margin: torch.Tensor  # [R] float64; +inf when nothing is left to compare
    recall: torch.Tensor  # [R] float64, |S & S_ref| / |S_ref| (1 for an empty reference)
    chosen: torch.Tensor  # [R] valid distinct positions chosen
    expected: torch.Tensor  # [R] min(k, unmasked positions)
    masked: torch.Tensor  # [R] chosen positions that are masked (-inf) or out of range
    duplicates: torch.Tensor  # [R] repeated positions
    bad_padding: torch.Tensor  # [R] entries < -1 (padding other than -1)
    problems: list[str] = field(default_factory=list)  # the first few failing rows, in words

    @property
    def all_ok(self) -> bool:
        return bool(self.ok.all())


MAX_PROBLEMS = 8


def check_selection(selected: torch.Tensor, logits: torch.Tensor,
                    bound: torch.Tensor | float, k: int,
                    budget: int | None = None) -> SelectionReport:
    """Judge `selected` [R, k'] (k' >= k allowed: extra columns must be -1) against golden
    `logits` [R, W] (-inf = masked) with per-position error `bound` ([R, W] or a scalar;
    0 demands exact order, ties still free). Rows in blocks of `budget` elements."""
    rows, width = logits.shape
    if selected.shape[0] != rows:
        raise ValueError(f"{selected.shape[0]} selected rows for {rows} logit rows")
    dev = logits.device
    sel = selected.to(dev).long()
    parts: list[dict[str, torch.Tensor]] = []
    block = max(1, (budget or score_block_elements(torch.float64)) // max(1, width))
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        e = bound[r0:r1] if isinstance(bound, torch.Tensor) and bound.dim() else bound
        parts.append(_check_block(sel[r0:r1], logits[r0:r1].double(), e, k))
    cat = {name: torch.cat([p[name] for p in parts]) for name in parts[0]} if parts else {}
    if not cat:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return SelectionReport(empty.bool(), empty.double(), empty.double(), empty, empty, empty,
                               empty, empty)
    report = SelectionReport(**cat)
    report.problems = _describe(report, selected.shape[1], k)
    return report


def _check_block(sel: torch.Tensor, lg: torch.Tensor, bound: torch.Tensor | float, k: int
                 ) -> dict[str, torch.Tensor]:
    rows, width = lg.shape
    dev = lg.device
    e = bound.to(dev).double() if isinstance(bound, torch.Tensor) else torch.full_like(lg, bound)
    e = e.expand_as(lg)
    unmasked = torch.isfinite(lg) | (lg > 0)  # +inf is a (broken) value, not a mask
    in_range = (sel >= 0) & (sel < width)
    safe = torch.where(in_range, sel, torch.zeros_like(sel))
    hit_masked = in_range & ~unmasked.gather(1, safe)
    masked = ((sel >= width) | hit_masked).sum(1)
    bad_padding = (sel < -1).sum(1)
    good = in_range & ~hit_masked
    chosen_map = torch.zeros((rows, width), dtype=torch.int64, device=dev)
    chosen_map.scatter_add_(1, safe, good.long())
    duplicates = (chosen_map - 1).clamp(min=0).sum(1)
    chosen = chosen_map > 0
    n_chosen = chosen.sum(1)
    expected = unmasked.sum(1).clamp(max=k)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=dev)
    low_chosen = torch.where(chosen, lg + e, inf).amin(1)
    high_left = torch.where(unmasked & ~chosen, lg - e, -inf).amax(1)
    margin = torch.where(torch.isinf(low_chosen) | torch.isinf(high_left), inf,
                         low_chosen - high_left)
    ok = ((masked == 0) & (duplicates == 0) & (bad_padding == 0) & (n_chosen == expected)
          & (margin >= 0))
    ref = torch.zeros((rows, width), dtype=torch.bool, device=dev)
    ref_idx = reference_topk(lg, k)
    ref.scatter_(1, ref_idx.clamp(min=0), ref_idx >= 0)
    n_ref = ref.sum(1)
    recall = torch.where(n_ref > 0, (ref & chosen).sum(1).double() / n_ref.clamp(min=1),
                         torch.ones_like(margin))
    return {"ok": ok, "margin": margin, "recall": recall, "chosen": n_chosen,
            "expected": expected, "masked": masked, "duplicates": duplicates,
            "bad_padding": bad_padding}


def _describe(r: SelectionReport, columns: int, k: int) -> list[str]:
    out: list[str] = []
    for row in torch.nonzero(~r.ok).flatten()[:MAX_PROBLEMS].tolist():
        why = []
        if int(r.masked[row]):
            why.append(f"{int(r.masked[row])} masked or out-of-range position(s) chosen")
        if int(r.duplicates[row]):
            why.append(f"{int(r.duplicates[row])} duplicate position(s)")
        if int(r.bad_padding[row]):
            why.append(f"{int(r.bad_padding[row])} entries below -1 (padding is -1)")
        if int(r.chosen[row]) != int(r.expected[row]):
            why.append(f"{int(r.chosen[row])} valid positions chosen, {int(r.expected[row])} "
                       f"expected (min(k={k}, unmasked))")
        if float(r.margin[row]) < 0:
            why.append(f"a chosen position is below an unchosen one by {-float(r.margin[row]):.3g} "
                       "beyond the logit error bounds")
        out.append(f"row {row}: " + "; ".join(why) + f" (recall {float(r.recall[row]):.3f})")
    return out
