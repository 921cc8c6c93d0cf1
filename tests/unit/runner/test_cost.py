"""mlacheck.cost's GPU calibration: the measured (backend, op) factors scale the kernel
estimate on GPUs only, and benchmarks/calibrate_cost.py derives them from a results file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from mlacheck import cost
from mlacheck.matrices import load
from mlacheck.ops import Op

ROOT = Path(__file__).resolve().parents[3]


def _bench():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("calibrate_cost", ROOT / "benchmarks" / "calibrate_cost.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_factor_applies_on_gpus_only() -> None:
    (backend, op), factor = next(iter(cost.KERNEL_CALIBRATION.items()))
    case = next(mc.case for mc in load("nightly").cases
                if mc.case.op == op and cost.kernel_s(mc.case, backend, "cuda", calibrated=False) > 0)
    raw = cost.kernel_s(case, backend, "cuda", calibrated=False)
    assert cost.kernel_s(case, backend, "cuda") == raw * factor
    assert cost.kernel_s(case, backend, "cpu") == cost.kernel_s(case, backend, "cpu", calibrated=False)


def test_the_long_sparse_prefill_of_the_model_is_estimated_long() -> None:
    """The H100 nightly's longest case (aiter-model's sparse prefill, 62.6 s of kernel) was
    estimated at ~0.1 s and started late; calibrated, it is the first case of the nightly."""
    cases = [mc.case for mc in load("nightly").cases]
    backends = ["torch", "aiter-model", "aiter-triton"]
    first = max(cases, key=lambda c: cost.case_s(c, backends))
    assert first.op == Op.SPARSE_PREFILL and cost.case_s(first, backends) > 30


def test_calibration_is_the_median_measured_over_estimated(tmp_path: Path) -> None:
    bench = _bench()
    cases = [mc.case for mc in load("nightly").cases if mc.case.op == Op.PREFILL
             and cost.kernel_s(mc.case, "torch", "cuda", calibrated=False) >= bench.MIN_ESTIMATE_S]
    picked = cases[:bench.MIN_ITEMS]
    factors = [2.0, 4.0, 8.0][:len(picked)] + [8.0] * (len(picked) - 3)
    lines = [json.dumps({"case_id": c.id, "backend": "torch", "status": "PASS",
                         "timings": {"kernel": f * cost.kernel_s(c, "torch", "cuda", calibrated=False)}})
             for c, f in zip(picked, factors, strict=True)]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    got = bench.ratios(str(tmp_path / "r.jsonl"), "nightly", 0)
    assert sorted(round(x, 6) for x in got[("torch", str(Op.PREFILL))]) == sorted(factors)
