"""The heat map's data (mlacheck.heatmap): the judge records the pooled grid for a FAIL and
draws nothing (the report draws it); non-finite rows are marked."""

from __future__ import annotations

import math

import torch

from mlacheck import golden, harness, heatmap, judge
from mlacheck import inputs as inputs_mod
from mlacheck.backends.faults import make
from mlacheck.spec import DecodeCase, Request


def test_grid_max_pools_and_marks_non_finite_rows() -> None:
    err = torch.zeros(600, 4, dtype=torch.float64)
    err[5, 1] = 0.5
    err[599, 3] = float("nan")
    grid = heatmap.grid(err)
    ft, fh = heatmap.block(tuple(err.shape))
    assert (ft, fh) == (math.ceil(600 / heatmap.MAX_CELLS[0]), 1)
    assert len(grid) == math.ceil(600 / ft) and len(grid[0]) == 4
    assert grid[5 // ft][1] == 0.5  # the worst row of the block wins
    assert grid[599 // ft][3] == heatmap.NONFINITE and grid[0][0] == 0.0


def test_the_judge_records_the_heat_map_of_a_fail() -> None:
    case = DecodeCase(requests=(Request(1, 37), Request(1, 70)), num_heads=8, page_size=16)
    fault = make("unpad-heads-slice")
    inp = inputs_mod.build(case, "cpu")
    out = fault.run(case, inp)
    gold = golden.reference(inp, "exact", "fp32")
    v = judge.verdict(case, inp, out, gold, harness._baseline(case, inp), backend=fault.name)
    assert v.status == "FAIL" and v.metrics["heatmap_block"] == [1, 1]
    passing = judge.verdict(case, inp, gold_output(gold), gold, harness._baseline(case, inp))
    assert passing.status == "PASS" and "heatmap" not in passing.metrics
    v = harness.run_case(case, make("unpad-heads-slice"))
    assert v.status == "FAIL" and len(v.metrics["heatmap"]) == 2  # tokens x heads
    assert len(v.metrics["heatmap"][0]) == 8 and v.metrics["heatmap_block"] == [1, 1]


def gold_output(gold):  # noqa: ANN001, ANN201 - the golden itself as a kernel's output
    from mlacheck.backends.base import Output

    return Output(gold.out.to(torch.bfloat16).clone(), gold.lse.clone())
