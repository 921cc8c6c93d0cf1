"""benchmarks/suite_throughput.py's timeline: what a worker pays once for a backend shows even
where no kernel ran (a SKIP)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "suite_throughput.py"


@pytest.fixture(scope="module")
def st():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("suite_throughput", _PATH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(worker: str, backend: str, started: float, wall: float, kernel: float | None,
         case: str = "c") -> dict:
    timings = {"kernel": kernel} if kernel is not None else {}
    return {"worker": worker, "backend": backend, "started": started, "wall": wall,
            "timings": timings, "case_id": case, "status": "PASS" if kernel else "SKIP"}


def test_first_item_of_a_backend_counts_skips(st) -> None:  # noqa: ANN001
    """As on the H100 (2026-11-26): each worker's first aiter-triton item, a SKIP, took ~6 s
    (the library's import), its first kernel call 0.5 s; the kernel-only view missed it."""
    recs = []
    for w in ("gw0", "gw1"):
        recs += [_rec(w, "aiter-triton", 100.0, 6.0, None),        # first: a SKIP, 6 s
                 _rec(w, "aiter-triton", 106.0, 0.6, 0.5),         # first kernel call
                 _rec(w, "aiter-triton", 107.0, 0.02, 0.013),
                 _rec(w, "aiter-triton", 108.0, 0.001, None)]
    tl = st.timeline(recs)
    assert tl["first_item_vs_median_s"]["aiter-triton"] == {
        "first_mean": 6.0, "first_max": 6.0, "median": 0.02}
    assert tl["first_kernel_vs_median_s"]["aiter-triton"]["first_mean"] == 0.5
    assert tl["workers"] == 2


def test_a_backend_run_once_per_worker_has_no_median(st) -> None:  # noqa: ANN001
    tl = st.timeline([_rec("gw0", "torch", 1.0, 1.0, 0.5)])
    assert tl["first_item_vs_median_s"] == {}


def test_the_time_outside_the_items(st) -> None:  # noqa: ANN001
    """Issue 27: the fixed cost of a run, split at the session's start (its run header), and
    when each worker's first item began, both counted from the process's start; none of it
    without the process's start and end."""
    recs = [_rec("gw0", "torch", 103.0, 2.0, 1.0), _rec("gw0", "torch", 105.0, 5.0, 1.0),
            _rec("gw1", "torch", 104.5, 1.0, 1.0)]
    tl = st.timeline(recs, session_started=101.5, spawned=100.0, ended=111.3)
    assert tl["outside_items_s"] == {"to_session": 1.5, "session_to_first_item": 1.5,
                                     "to_first_item": 3.0, "after_last_item": 1.3}
    assert tl["worker_first_item_at_s"] == {"gw0": 3.0, "gw1": 4.5}
    assert tl["span_s"] == 7.0
    assert "outside_items_s" not in st.timeline(recs)
