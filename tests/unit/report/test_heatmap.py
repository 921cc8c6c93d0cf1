"""The heat map's data lives with the report (issue 16 audit): the judge decides and draws
nothing; the harness records the pooled grid for a FAIL; non-finite rows are marked."""

from __future__ import annotations

import math

import torch

from mlacheck import golden, harness, judge
from mlacheck import inputs as inputs_mod
from mlacheck.backends.faults import make
from mlacheck.report import heatmap
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


def test_the_judge_records_no_heat_map_the_harness_does() -> None:
    case = DecodeCase(requests=(Request(1, 37), Request(1, 70)), num_heads=8, page_size=16)
    fault = make("unpad-heads-slice")
    inp = inputs_mod.build(case, "cpu")
    out = fault.run(case, inp)
    gold = golden.reference(inp, "exact", "fp32")
    v = judge.verdict(case, inp, out, gold, harness._baseline(case, inp), backend=fault.name)
    assert v.status == "FAIL" and "heatmap" not in v.metrics
    v = harness.run_case(case, make("unpad-heads-slice"))
    assert v.status == "FAIL" and len(v.metrics["heatmap"]) == 2  # tokens x heads
    assert len(v.metrics["heatmap"][0]) == 8 and v.metrics["heatmap_block"] == [1, 1]
