"""One case through the pipeline: inputs -> backend -> golden -> baseline -> judge.

The kernel runs before the reference is allocated (FlashMLA's test kit does the same), so a
kernel that reads memory it does not own meets poison, not a golden's leftovers.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

import torch

from mlacheck import golden, judge
from mlacheck import inputs as inputs_mod
from mlacheck.backends.base import Backend, Output, skip_reason
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.judge import CRASH, SKIP, Verdict
from mlacheck.spec import Case

BASELINE = TorchBackend(name="baseline")


class DeviceError(RuntimeError):
    """The device context may be poisoned (device-side assert, memory fault): stop the worker."""


DEVICE_ERROR_MARKERS = (
    "device-side assert", "illegal memory access", "memory access fault", "hipErrorIllegalAddress",
    "CUDA error: an illegal", "unspecified launch failure", "HIP error: an illegal",
)


@dataclass(frozen=True)
class RunOptions:
    device: str = "cpu"
    golden_precision: str = "fp32"
    ideal: bool = True


def run_case(case: Case, backend: Backend, opts: RunOptions = RunOptions()) -> Verdict:
    base = Verdict(case.id, backend.name, case.op, SKIP, case=judge.json.loads(case.to_json()))
    why = skip_reason(backend, case, opts.device)
    if why:
        base.reason = why
        return base
    t: dict[str, float] = {}
    clock = time.perf_counter()
    inp = inputs_mod.build(case, opts.device)
    _sync(opts.device)
    t["inputs"], clock = time.perf_counter() - clock, time.perf_counter()
    try:
        out = backend.run(case, inp)
        _sync(opts.device)
    except Exception as e:  # the implementation under test failed: CRASH, with its reason
        base.status = CRASH
        base.reason = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        base.metrics["traceback"] = traceback.format_exc(limit=8)
        if any(m in str(e) for m in DEVICE_ERROR_MARKERS):
            raise DeviceError(base.reason) from e
        return base
    t["kernel"], clock = time.perf_counter() - clock, time.perf_counter()
    gold = golden.reference(inp, "exact", opts.golden_precision)
    ideal = golden.reference(inp, "ideal", opts.golden_precision) if opts.ideal else None
    _sync(opts.device)
    t["golden"], clock = time.perf_counter() - clock, time.perf_counter()
    baseline = _baseline(case, inp, backend, out)
    t["baseline"], clock = time.perf_counter() - clock, time.perf_counter()
    v = judge.verdict(case, inp, out, gold, baseline, ideal, backend.name)
    t["judge"] = time.perf_counter() - clock
    v.timings = t
    meta_check = out.metadata.get("validation")
    if meta_check:  # a backend's own metadata problems (e.g. persistent schedule) fail the case
        v.checks.append(judge.Check("metadata", False, detail="; ".join(meta_check)))
        v.status, v.reason = judge.FAIL, ", ".join(c.name for c in v.failed_checks)
    return v


def _baseline(case: Case, inp: inputs_mod.Inputs, backend: Backend, out: Output) -> Output:
    """The same-precision baseline, run on its own copy of the output buffer."""
    if type(backend) is TorchBackend and backend.numerics == BASELINE.numerics:
        return Output(out.out.clone(), None if out.lse is None else out.lse.clone())
    saved = inp.out.full.clone()
    res = BASELINE.run(case, inp)
    res = Output(res.out.clone(), res.lse)
    inp.out.full.copy_(saved)
    return res


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
