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
    # >= 2: run the backend that many times, each on freshly built inputs, and FAIL a
    # `determinism` check when any output (or LSE) differs bitwise from the first run's.
    repeat: int = 1


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
    if opts.repeat > 1:
        clock = time.perf_counter()
        _check_determinism(case, backend, opts, inp, out, v)
        v.timings["determinism"] = time.perf_counter() - clock
    return v


def _check_determinism(case: Case, backend: Backend, opts: RunOptions, inp: inputs_mod.Inputs,
                       first: Output, v: Verdict) -> None:
    """Run again on fresh inputs: outputs (and LSE) must be bitwise identical to the first."""
    ref_out = _bits(first.out.detach().cpu())
    ref_lse = None if first.lse is None else _bits(first.lse.detach().cpu())
    differ = torch.zeros(ref_out.shape[:2], dtype=torch.bool)
    problem = ""
    for run in range(2, opts.repeat + 1):
        try:
            again = backend.run(case, inputs_mod.build(case, opts.device))
            _sync(opts.device)
        except Exception as e:
            problem = f"run {run} raised {type(e).__name__}: {e}".splitlines()[0][:300]
            break
        out = _bits(again.out.detach().cpu())
        if out.shape != ref_out.shape:
            problem = f"run {run} returned shape {tuple(out.shape)}, run 1 {tuple(ref_out.shape)}"
            break
        differ |= (out != ref_out).flatten(2).any(-1)
        if ref_lse is not None and again.lse is not None:
            lse = _bits(again.lse.detach().cpu())
            if lse.shape == ref_lse.shape:
                differ |= (lse != ref_lse).reshape(differ.shape)
    n = int(differ.sum())
    detail = problem or (f"{n} of {differ.numel()} rows differ bitwise across {opts.repeat} runs "
                         "on identical inputs" if n else "")
    v.checks.append(judge.Check("determinism", not (n or problem), float(n), 0.0, detail))
    if n:
        v.where += judge.localise(inp, differ, differ.double(), 0.0, "determinism")
    if n or problem:
        v.status, v.reason = judge.FAIL, ", ".join(c.name for c in v.failed_checks)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of a float tensor: bitwise comparison, NaN payloads included."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


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
