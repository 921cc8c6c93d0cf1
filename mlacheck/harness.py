"""One case through the pipeline: inputs -> backend -> golden -> baseline -> judge.

Plumbing only: the judge decides every check and builds every verdict (mlacheck.judge); the
harness gives it the kernel to re-run for probes, and keeps what the run measured (timings,
device memory) beside the verdict, in the CaseResult whose `record` is the results line.
For the first backend of a case the kernel
runs before the reference is allocated (FlashMLA's test kit does the same), so a kernel that
reads memory it does not own meets poison, not a golden's leftovers. The next backends of
the same case in this process reuse its inputs and references (items run case by case:
mlacheck.pytest_plugin), after a check that no earlier kernel changed an input bit and with
the output buffer restored to its guards and poison. What is the suite's own failure (a case
too large for the machine, an exception while building inputs or the references) never
becomes the kernel's: it is a SKIP naming the sizes, or an ERROR.
"""

from __future__ import annotations

import atexit
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mlacheck import admission, footprint, golden, judge
from mlacheck import inputs as inputs_mod
from mlacheck import tolerances as tol
from mlacheck.backends.base import Backend, Output, skip_reason
from mlacheck.backends.numerics import Numerics
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.spec import PIPELINE_OPS, Case, Op
from mlacheck.verdict import Verdict

BASELINE = TorchBackend(name="baseline")
P_NORMALISED_BASELINE = TorchBackend(Numerics(p_normalised=True), name="baseline-p-normalised")
# Not a bound of its own: the eager baseline with each row's largest weight (and the weights
# it rounds to the same value: near ties) rounded as badly as the P format can, from which the
# judge takes each FP8 row's allowance for that rounding.
PEAK_ROUNDED_BASELINE = TorchBackend(Numerics(peak_rounding=tol.PEAK_ROUNDOFFS),
                                     name=judge.PEAK_ROUNDED)


class DeviceError(RuntimeError):
    """The device context may be poisoned (device-side assert, memory fault): stop the worker.
    `verdict`: the judge's CRASH verdict for the item (known-failure label included)."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(verdict.reason)
        self.verdict = verdict


DEVICE_ERROR_MARKERS = (
    "device-side assert", "illegal memory access", "memory access fault", "hipErrorIllegalAddress",
    "CUDA error: an illegal", "unspecified launch failure", "HIP error: an illegal",
)


@dataclass(frozen=True)
class RunOptions:
    device: str = "cpu"
    golden_precision: str = "fp32"
    ideal: bool = True
    # >= 2: run the backend that many times, each on freshly built inputs; the judge FAILs a
    # `determinism` check when any output (or LSE) differs bitwise from the first run's.
    repeat: int = 1
    # the longest a GPU case waits for other workers' cases to give memory back (admission)
    memory_wait_s: float = admission.WAIT_S
    # keep the case's inputs and references for the next backend of the same case (a matrix
    # run orders its items case by case); off: every call builds its own
    share: bool = False


@dataclass(frozen=True)
class CaseResult:
    """One case on one backend: the judge's verdict, and beside it what the run measured."""

    verdict: Verdict
    timings: dict[str, float] = field(default_factory=dict)  # seconds per phase
    measured: dict[str, Any] = field(default_factory=dict)  # device memory it took (GPU)

    def record(self) -> dict[str, Any]:
        """The results line (its schema: timings at the top, the memory among the metrics)."""
        d = self.verdict.to_dict()
        d["timings"] = dict(self.timings)
        d["metrics"] = {**d["metrics"], **self.measured}
        return d


def run_case(case: Case, backend: Backend, opts: RunOptions = RunOptions()) -> Verdict:
    """The verdict alone (what tests, the selftest and searches read)."""
    return run(case, backend, opts).verdict


def run(case: Case, backend: Backend, opts: RunOptions = RunOptions()) -> CaseResult:
    ran = _version_record(backend)
    why = skip_reason(backend, case, opts.device) or footprint.does_not_fit(case, opts.device)
    if why:
        return CaseResult(judge.skipped(case, backend.name, why, ran))
    clock = time.perf_counter()
    try:
        data = _case_data(case, opts)
    except admission.NoRoomNow as e:
        return CaseResult(judge.suite_error(case, backend.name, "waiting for device memory", e,
                                            ran))
    except Exception as e:
        return CaseResult(judge.suite_error(case, backend.name, "building the inputs", e, ran))
    waited, data.wait_s = data.wait_s, 0.0  # reported once, by the item that waited
    try:
        return _run_admitted(case, backend, opts, ran, data,
                             time.perf_counter() - clock - waited, waited)
    finally:
        if not opts.share:
            data.hold.close()


@dataclass
class _CaseData:
    """One case's inputs (and, once computed, references) in this process, with the device
    memory reservation they are held under."""

    key: tuple[str, str, str, bool]
    inp: inputs_mod.Inputs
    pristine_out: torch.Tensor  # the output buffer as built: guards and poison
    fingerprint: list[int]
    hold: contextlib.ExitStack
    refs: tuple[Output, Output | None, list[Output]] | None = None  # exact, ideal, baselines
    wait_s: float = 0.0  # time spent waiting for room on the device before the build


_SHARED: list[_CaseData] = []  # at most one: the case this process ran last


def _case_data(case: Case, opts: RunOptions) -> _CaseData:
    """The case's inputs: the ones already here when no kernel changed them, else new ones
    (the previous case's data and reservation are given back first)."""
    key = (case.id, opts.device, opts.golden_precision, opts.ideal)
    if opts.share and _SHARED and _SHARED[0].key == key:
        data = _SHARED[0]
        if inputs_mod.fingerprint(data.inp) == data.fingerprint:
            data.inp.out.full.copy_(data.pristine_out)
            _sync(opts.device)
            return data
    release_shared()
    hold = contextlib.ExitStack()
    try:
        clock = time.perf_counter()
        hold.enter_context(admission.reserved(case, opts.device, opts.memory_wait_s))
        wait_s = time.perf_counter() - clock
        if _on_gpu(opts.device):
            torch.cuda.reset_peak_memory_stats(opts.device)
        inp = inputs_mod.build(case, opts.device)
        kept = inputs_mod.fingerprint(inp) if opts.share else []
        data = _CaseData(key, inp, inp.out.full.clone(), kept, hold, wait_s=wait_s)
        _sync(opts.device)
    except BaseException:
        hold.close()
        raise
    if opts.share:
        _SHARED.append(data)
    return data


def release_shared() -> None:
    """Drop the kept case data and give its device memory reservation back."""
    while _SHARED:
        _SHARED.pop().hold.close()


# A worker's last case is still kept when the process ends. Given back here, while the
# interpreter is whole: left to garbage collection at shutdown, the reservation's release ran
# after `open` was gone ("NameError: name 'open' is not defined" under every GPU run's summary,
# seen on the H100).
atexit.register(release_shared)


def _run_admitted(case: Case, backend: Backend, opts: RunOptions, ran: dict[str, Any],
                  data: _CaseData, inputs_s: float, wait_s: float) -> CaseResult:
    t: dict[str, float] = {"inputs": inputs_s}
    if wait_s:
        t["admission_wait"] = wait_s
    inp = data.inp

    def suite_error(stage: str, e: Exception) -> CaseResult:
        return CaseResult(judge.suite_error(case, backend.name, stage, e, ran))

    clock = time.perf_counter()
    try:
        out = backend.run(case, inp)
        _sync(opts.device)
    except Exception as e:  # the implementation under test failed: CRASH, with its reason
        if _out_of_memory(e) and admission.others_hold_memory(opts.device):
            # other workers' cases held the device: the suite's scheduling, not the kernel
            # (alone on the device it would be a CRASH); --resume runs the item again
            return suite_error("running the kernel beside other workers' cases", e)
        crash = judge.crashed(case, backend.name, e, ran)
        if any(m in str(e) for m in DEVICE_ERROR_MARKERS):
            raise DeviceError(crash) from e
        return CaseResult(crash)
    t["kernel"], clock = time.perf_counter() - clock, time.perf_counter()
    try:
        if data.refs is None:
            gold, ideal = golden_references(inp, opts)
            t["golden"], clock = time.perf_counter() - clock, time.perf_counter()
            baseline = _baseline(case, inp)
            t["baseline"], clock = time.perf_counter() - clock, time.perf_counter()
            data.refs = (gold, ideal, baseline)
        else:  # this case's references, computed for an earlier backend on the same inputs
            gold, ideal, baseline = data.refs
            t["golden"] = t["baseline"] = 0.0
    except Exception as e:
        return suite_error("computing the references", e)
    repeats = _repeat(case, backend, opts) if opts.repeat > 1 else None
    if repeats is not None:
        t["determinism"], clock = time.perf_counter() - clock, time.perf_counter()
    try:
        v = judge.verdict(case, inp, out, gold, baseline, ideal, backend.name, repeats,
                          implementation=ran, rerun=_rerun(backend, opts))
    except Exception as e:  # mlacheck's own failure: never charged to the kernel
        return suite_error("judging the output", e)
    t["judge"] = time.perf_counter() - clock
    measured: dict[str, Any] = {}
    if _on_gpu(opts.device):  # what the case really took, against what admission reserved
        measured = {"device_peak_bytes": torch.cuda.max_memory_allocated(opts.device),
                    "footprint_bytes": footprint.estimate(case).total}
    return CaseResult(v, t, measured)


def golden_references(inp: inputs_mod.Inputs, opts: RunOptions
                      ) -> tuple[golden.Result, golden.Result | None]:
    """The exact golden (on the inputs as stored) and, when `opts.ideal`, the ideal one (on
    the unquantised values)."""
    gold = golden.reference(inp, "exact", opts.golden_precision)
    ideal = golden.reference(inp, "ideal", opts.golden_precision) if opts.ideal else None
    _sync(opts.device)
    return gold, ideal


def judge_output(case: Case, inp: inputs_mod.Inputs, out: Output, backend: Backend,
                 opts: RunOptions = RunOptions()) -> Verdict:
    """The verdict on an output some other loop already got from `backend` (the e2e model's
    attention calls): the same references and judge as run_case, no determinism repeat."""
    gold, ideal = golden_references(inp, opts)
    baseline = _baseline(case, inp)
    return judge.verdict(case, inp, out, gold, baseline, ideal, backend.name,
                         implementation=_version_record(backend))


def _version_record(backend: Backend) -> dict[str, Any]:
    """What ran, for every verdict (SKIPs included): the library's version where the
    backend reports one, and torch's (the reference backends and models are torch code)."""
    record: dict[str, Any] = {"torch": torch.__version__}
    version = getattr(backend, "version", None)
    if callable(version):
        try:
            record["version"] = str(version())
        except Exception as e:  # noqa: BLE001 - a version lookup never decides a verdict
            record["version"] = f"unknown ({type(e).__name__})"
    return record


def _rerun(backend: Backend, opts: RunOptions) -> Any:  # mlacheck.probes.Rerun
    """The kernel on other inputs, for the judge's probes: None when it refuses or raises."""

    def rerun(case: Case, inp: inputs_mod.Inputs) -> Output | None:
        if skip_reason(backend, case, opts.device) is not None:
            return None
        try:
            out = backend.run(case, inp)
            _sync(opts.device)
        except Exception:  # noqa: BLE001 - a probe that fails says nothing
            return None
        return out

    return rerun


def _repeat(case: Case, backend: Backend, opts: RunOptions) -> judge.Repeats:
    """Run again on freshly built, identical inputs."""
    rep = judge.Repeats([])
    for run in range(2, opts.repeat + 1):
        try:
            rep.outputs.append(backend.run(case, inputs_mod.build(case, opts.device)))
            _sync(opts.device)
        except Exception as e:
            rep.problem = f"run {run} raised {type(e).__name__}: {e}".splitlines()[0][:300]
            break
    return rep


def _baseline(case: Case, inp: inputs_mod.Inputs) -> list[Output]:
    """The same-precision baselines, always mlacheck's own instances (never the object under
    test, even when that is a torch backend: a patched one must not bound itself), each run
    on its own copy of the output buffer: BASELINE, and where P is rounded also
    P_NORMALISED_BASELINE, and with FP8 P PEAK_ROUNDED_BASELINE (see baselines()); each
    Output's metadata names its baseline ("baseline")."""
    saved = inp.out.full.clone()
    family = []
    for b in baselines(case):
        res = b.run(case, inp)
        family.append(Output(res.out.clone(), res.lse, metadata={"baseline": b.name},
                             extra=dict(res.extra)))
        inp.out.full.copy_(saved)
    return family


def baselines(case: Case) -> list[TorchBackend]:
    """The baselines a case's bound is derived from: one per legitimate way to round P.

    P = exp(s - running max) rounded (BASELINE) leaves the row's largest P exactly 1, so its
    largest weight carries no rounding error; a correct kernel that rounds P / l (normalised
    first) or exp(s - stale max) (a lazily rescaled max, FlashAttention-4 style) rounds that
    weight too. On a row that one key dominates that rounding is the whole error, |v| x the
    P format's relative rounding: with FP8 P (3-bit mantissa) it took such kernels 3-10 %
    past a row bound derived from BASELINE alone; with fp16 P it took torch-lazy to 4.4x
    BASELINE's largest element error (max_abs_error's factor is 4; premerge seed 2,
    dec-b1-kv513-h16-p16-fp16-shuffled-layer, a V outlier channel of ~13 under a dominant
    key: 13 x 2^-11 = 0.0064). So wherever P is rounded the family is BASELINE and
    P_NORMALISED_BASELINE (whose largest weight is rounded); which checks take the family's
    worse is the judge's (mlacheck.judge._judge_numerics: every check with FP8 P, the largest
    element alone with 16-bit P; docs/detection.md "P rounding families"). With FP8 P
    PEAK_ROUNDED_BASELINE too: each row's allowance for the rounding of its largest weight
    and its near ties (mlacheck.judge._fp8_row_bounds; docs/detection.md section 2)."""
    if case.op in PIPELINE_OPS and case.op not in (Op.SPARSE_PIPELINE, Op.SPARSE_PREFILL):
        return [BASELINE]  # logits, selections, slots: no P
    p_fmt = tol.compute_format(case.quant.q, case.quant.kv)
    if p_fmt == "fp32":
        return [BASELINE]
    if p_fmt.startswith("fp8"):
        return [BASELINE, P_NORMALISED_BASELINE, PEAK_ROUNDED_BASELINE]
    return [BASELINE, P_NORMALISED_BASELINE]


def _out_of_memory(e: Exception) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _on_gpu(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _sync(device: str) -> None:
    if _on_gpu(device):
        torch.cuda.synchronize()
