"""`mlacheck selftest`: prove, on this machine, that the suite catches every planted fault of
the catalogue (mlacheck/backends/faults: the bug classes of mlacheck/bugclasses.py and generic mistakes) and
raises no false alarm on the correct backends.

    mlacheck selftest [--quick] [--matrix selftest] [--no-search] [--seeds N]
                      [--fault NAME ...] [--backend NAME ...] [--inner NAME]
                      [--offset-bits 32] [--json out.json] [--device cpu]

1. Every fault runs, as ONE instance (stateful faults keep their state), over the matrix
   cases of the ops it acts on (--quick: the matrix groups its spec names). A fault is
   caught when at least one case FAILs or CRASHes; the table names how many cases, the
   first one, and the checks that fired.
2. For every fault a Hypothesis search (mlacheck.strategies' generators narrowed per fault,
   mlacheck.backends.faults.search) finds a failing case and shrinks it to a minimal one.
3. The correct backends (torch, torch-split, torch-reverse, torch-lazy, torch-normalised,
   aiter-model, aiter-model-nonpersistent) run the whole matrix under `--seeds` seeds: any FAIL
   or CRASH (not explained by a documented finding, mlacheck/known.py) is a false alarm.

Every run repeats the kernel on fresh inputs (RunOptions(repeat=2): the determinism check)
where that matters: for the faults that only a repeated run shows, and for the correct
backends (except, under --quick, on the large-KV cases and any case estimated above
QUICK_REPEAT_MAX_BYTES, whose second input build costs more than it proves there).

The large-KV cases (pools past 2^31 / 2^32 bytes: 2 / 4 GiB of memory) run at full size by
default. `--offset-bits 24` runs a scale model of them instead (Placement.scaled): their high
placements (and those the search draws) move to 2^23 / 2^24 of a 24-bit offset model, where
the offset-wrap faults wrap and the failure regions are named, so the same detection and
localisation runs on megabyte pools (what mlacheck's own default test run uses; docs/ci.md
"Test tiers").

Exit status (README "Exit codes"): 1 when a fault escapes; otherwise the gate's code for the
correct backends' verdicts (mlacheck.session.outcome: 0 when they all pass, 1 on a false
alarm, 3 on a suite error, 6 when a backend ran no case); 2 on bad input (unknown matrix,
fault or option).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlacheck.backends.faults import FAULTS, FaultSpec
from mlacheck.errors import OneLineParser, UsageError
from mlacheck.outcome import EXIT_KERNEL_FAILURE, EXIT_USAGE
from mlacheck.spec import MIN_OFFSET_BITS, OFFSET_BITS, Case
from mlacheck.verdict import CRASH, KNOWN, PASS, SKIP, Verdict

if TYPE_CHECKING:  # torch stays unimported until a run starts (`--help` is instant)
    from mlacheck.matrices import MatrixCase

DEFAULT_MATRIX = "selftest"
CORRECT_BACKENDS = ("torch", "torch-split", "torch-reverse", "torch-lazy", "torch-normalised",
                    "aiter-model", "aiter-model-nonpersistent")
# Under --quick the multi-GiB large-KV cases run on these correct backends only: the
# backends the large-KV faults are planted in (the other two differ from torch only in
# accumulation order, not in how they address the pool).
QUICK_LARGE_KV_BACKENDS = ("torch", "aiter-model")
# Under --quick a correct backend runs a case estimated (mlacheck.footprint) above this once,
# without the determinism repeat: the repeat builds a second copy of the inputs while the
# first is alive. On the selftest matrix that is the 98305-token decode alone (2.6 GB
# estimated; every other case <= 0.55 GB): its repeat took the quick selftest from ~1.4 to
# 1.86 GB peak PSS on a 2-core CPU machine. The determinism check's freedom from false alarms
# is still shown on every smaller case, and the full selftest repeats every case.
QUICK_REPEAT_MAX_BYTES = 1 << 30
# Search budgets: backend runs per fault (examples + shrink steps; beyond it the search
# keeps the smallest failing case found so far).
SEARCH_RUNS = {"quick": 24, "full": 200}
EXPENSIVE_SEARCH_RUNS = {"quick": 3, "full": 12}


@dataclass
class FaultResult:
    spec: FaultSpec
    verdicts: list[Verdict] = field(default_factory=list)
    minimal: Verdict | None = None
    minimal_case: Case | None = None
    search_runs: int = 0
    search_note: str = ""
    seconds: float = 0.0

    @property
    def failing(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.kernel_failed]

    @property
    def ran(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.status != SKIP]

    @property
    def caught(self) -> bool:
        return bool(self.failing)

    @property
    def checks(self) -> Counter[str]:
        return fired(self.failing)

    @property
    def expected_fired(self) -> bool:
        return bool(set(self.checks) & set(self.spec.expect))


@dataclass
class BackendResult:
    name: str
    verdicts: list[Verdict] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0

    @property
    def false_alarms(self) -> list[Verdict]:
        """Failures of a correct backend that no documented finding explains."""
        return [v for v in self.verdicts if v.kernel_failed and v.bucket != KNOWN]

    def count(self, status: str) -> int:
        return sum(v.status == status for v in self.verdicts)


def fired(verdicts: Sequence[Verdict]) -> Counter[str]:
    """Which checks failed, over verdicts (a CRASH counts as "crash")."""
    c: Counter[str] = Counter()
    for v in verdicts:
        if v.status == CRASH:
            c["crash"] += 1
        c.update(ch.name for ch in v.failed_checks)
    return c


def regions(verdicts: Sequence[Verdict]) -> list[str]:
    """Pool byte regions of the failure locations (large-KV cases only), most frequent first."""
    c: Counter[str] = Counter(w.region for v in verdicts for w in v.where if w.region)
    return [r for r, _ in c.most_common()]


# --------------------------------------------------------------------------- running


def scale_case(case: Case, bits: int) -> Case:
    """A high-placed case in a `bits`-wide offset model (Placement.scaled: 2^31 / 2^32 become
    2^(bits-1) / 2^bits); any other case as it is (its pool models no wrap)."""
    if case.placement.kind != "high" or case.placement.offset_bits == bits:
        return case
    return dataclasses.replace(case, placement=case.placement.scaled(bits))


def scale_offsets(cases: Sequence[MatrixCase], bits: int) -> list[MatrixCase]:
    """Matrix cases through `scale_case`, markers kept (the scale model selects as the real
    run does)."""
    return [dataclasses.replace(mc, case=scale_case(mc.case, bits)) for mc in cases]


def _run_options(device: str, repeat: int) -> Any:
    from mlacheck.harness import RunOptions

    return RunOptions(device=device, repeat=repeat)


def build(spec: FaultSpec, inner: str | None) -> Any:
    """A fresh instance, planted in `inner` where the fault's mechanism allows it (an AITER
    adapter fault in `aiter`, a wrapper around any backend), else in its default backend."""
    if inner is None or inner == spec.inner:
        return spec.build()
    try:
        return spec.build(inner)
    except ValueError:
        return spec.build()


def run_fault(spec: FaultSpec, cases: Sequence[Any], device: str, quick: bool,
              groups_known: bool, inner: str | None = None) -> FaultResult:
    """One fault instance over the matrix cases (its own groups under --quick)."""
    from mlacheck.harness import run_case

    res = FaultResult(spec)
    start = time.perf_counter()
    backend = build(spec, inner)
    opts = _run_options(device, 2 if spec.determinism else 1)
    for mc in cases:
        if quick and groups_known and mc.group not in spec.groups:
            continue
        res.verdicts.append(run_case(mc.case, backend, opts))
    res.seconds = time.perf_counter() - start
    return res


def search_fault(res: FaultResult, device: str, budget: int, inner: str | None = None,
                 offset_bits: int = OFFSET_BITS) -> None:
    """Hypothesis search for the fault's simplest failing case (see module docstring).

    The search is mlacheck.search's (derandomized, no example database, no deadline); on top
    of it: the run options the fault needs (a repeated run for a
    determinism fault), a fresh instance primed with the spec's priming case for every
    example of a stateful fault, and a cap of `budget` backend runs. High placements drawn
    are moved into an `offset_bits`-wide model (`scale_case`).
    """
    from mlacheck.backends.faults.search import strategy
    from mlacheck.harness import run_case
    from mlacheck.search import smallest

    spec = res.spec
    opts = _run_options(device, 2 if spec.determinism else 1)
    shared = None if spec.stateful else build(spec, inner)
    priming = _priming_case(spec)
    failing: dict[str, Verdict] = {}
    seen: dict[str, bool] = {}  # Hypothesis replays the final example: answer it the same

    def fails(case: Case) -> bool:
        if case.id in seen:
            return seen[case.id]
        if res.search_runs >= budget:
            return False
        res.search_runs += 1
        backend = shared
        if backend is None:
            backend = build(spec, inner)
            if priming is not None:
                run_case(priming, backend, opts)
        v = run_case(case, backend, opts)
        seen[case.id] = v.kernel_failed
        if seen[case.id]:
            failing[case.id] = v
        return seen[case.id]

    case = smallest(strategy(spec.search).map(lambda c: scale_case(c, offset_bits)), fails,
                    budget)
    if case is None:
        res.search_note = f"no failing case in {res.search_runs} runs"
        return
    res.minimal_case, res.minimal = case, failing[case.id]


def _priming_case(spec: FaultSpec) -> Case | None:
    if not spec.stateful:
        return None
    mod = importlib.import_module(spec.factory.partition(":")[0])
    return getattr(mod, "PRIMING_CASE", None)


def run_correct(name: str, cases_by_seed: Sequence[Sequence[Any]], device: str,
                quick: bool) -> BackendResult:
    from mlacheck import footprint
    from mlacheck.backends.registry import BackendError, resolve
    from mlacheck.harness import run_case

    res = BackendResult(name)
    start = time.perf_counter()
    try:
        backend = resolve(name)
    except BackendError as e:
        res.error = str(e)
        return res
    for cases in cases_by_seed:
        for mc in cases:
            large = "large_kv" in mc.markers
            if quick and large and name not in QUICK_LARGE_KV_BACKENDS:
                continue
            once = quick and (
                large or footprint.estimate(mc.case).total > QUICK_REPEAT_MAX_BYTES)
            repeat = 1 if once else 2
            res.verdicts.append(run_case(mc.case, backend, _run_options(device, repeat)))
    res.seconds = time.perf_counter() - start
    return res


# --------------------------------------------------------------------------- reporting


def _by(res: FaultResult) -> str:
    fails = res.failing
    if not fails:
        return f"0/{len(res.ran)}"
    return f"{len(fails)}/{len(res.ran)}: {fails[0].case_id}"


def _checks(res: FaultResult) -> str:
    c = res.checks
    text = ", ".join(f"{k} ({n})" for k, n in c.most_common())
    where = [r for r in regions(res.failing) if not re.fullmatch(r"below 2\^\d+", r)]
    if where:
        text += f"; at pool bytes {' / '.join(where)}"
    return text or "-"


def _minimal(res: FaultResult) -> str:
    if res.minimal_case is None:
        return res.search_note or "-"
    assert res.minimal is not None
    checks = ", ".join(fired([res.minimal]))
    return f"{res.minimal_case.slug}: {checks} ({res.search_runs} runs)"


def render(faults: Sequence[FaultResult], correct: Sequence[BackendResult],
           out: Callable[[Any], None] | None = None, width: int | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=width or (None if sys.stdout.isatty() else 240), soft_wrap=False)
    emit = out or console.print
    t = Table(title="mlacheck selftest: planted faults", show_lines=False)
    for col in ("fault", "class", "caught", "by (n cases, first case id)", "checks that fired",
                "minimal case (Hypothesis search)"):
        t.add_column(col, overflow="fold")
    for r in faults:
        caught = "yes" if r.caught else "NO"
        if r.caught and not r.expected_fired:
            caught += " (unexpected check)"
        t.add_row(*(escape(x) for x in (r.spec.name, r.spec.class_label, caught, _by(r),
                                         _checks(r), _minimal(r))))
    emit(t)
    c = Table(title="correct backends (false alarms)")
    for col in ("backend", "cases run", "PASS", "SKIP", "false alarms", "first false alarm"):
        c.add_column(col, overflow="fold")
    for b in correct:
        if b.error:
            c.add_row(b.name, "-", "-", "-", "ERROR", escape(b.error))
            continue
        fa = b.false_alarms
        first = f"{fa[0].status} {fa[0].case_id}: {fa[0].reason}" if fa else "-"
        c.add_row(b.name, str(len(b.verdicts)), str(b.count(PASS)), str(b.count(SKIP)),
                  str(len(fa)), escape(first))
    emit(c)


def to_json(faults: Sequence[FaultResult], correct: Sequence[BackendResult],
            meta: dict[str, Any]) -> dict[str, Any]:
    def verdict_brief(v: Verdict) -> dict[str, Any]:
        return {"case_id": v.case_id, "status": v.status, "reason": v.reason,
                "checks": sorted(fired([v]))}

    return {
        **meta,
        "faults": [{
            "name": r.spec.name, "class": r.spec.bug_class, "mechanism": r.spec.mechanism,
            "inner": r.spec.inner, "ops": list(r.spec.ops), "groups": list(r.spec.groups),
            "expect": list(r.spec.expect), "caught": r.caught,
            "expected_check_fired": r.expected_fired, "cases_run": len(r.ran),
            "failing": [verdict_brief(v) for v in r.failing], "checks": dict(r.checks),
            "regions": regions(r.failing), "seconds": round(r.seconds, 2),
            "minimal_case": None if r.minimal_case is None else json.loads(
                r.minimal_case.to_json()),
            "minimal_slug": None if r.minimal_case is None else r.minimal_case.slug,
            "minimal_verdict": None if r.minimal is None else verdict_brief(r.minimal),
            "search_runs": r.search_runs, "search_note": r.search_note,
        } for r in faults],
        "correct": [{
            "backend": b.name, "error": b.error, "cases_run": len(b.verdicts),
            "pass": b.count(PASS), "skip": b.count(SKIP),
            "false_alarms": [verdict_brief(v) for v in b.false_alarms],
            "seconds": round(b.seconds, 2),
        } for b in correct],
    }


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mlacheck selftest",
                description=" ".join(__doc__.split("\n\n")[0].split()).replace("`", ""))
    p.add_argument("--quick", action="store_true",
                   help="CPU-sized (CI): each fault on its own matrix groups, small search "
                        "budgets, large-KV cases on torch and aiter-model only, no "
                        "determinism repeat on a correct backend for cases above "
                        f"{QUICK_REPEAT_MAX_BYTES / 2**30:g} GiB (estimated)")
    p.add_argument("--matrix", default=DEFAULT_MATRIX,
                   help="matrix name or .yaml path (default: selftest)")
    p.add_argument("--no-search", dest="search", action="store_false",
                   help="skip the Hypothesis minimal-case search")
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds of the correct-backend (false-alarm) part (default 1)")
    p.add_argument("--fault", action="append", default=None, metavar="NAME",
                   help="only this fault (repeatable; default: all)")
    p.add_argument("--backend", action="append", default=None, metavar="NAME",
                   help="only this correct backend (repeatable; default: the seven "
                        "built-ins, selftest.CORRECT_BACKENDS)")
    p.add_argument("--inner", default=None, metavar="NAME",
                   help="plant the faults in this backend where their mechanism allows (e.g. "
                        "aiter on a ROCm GPU); the others keep their default backend")
    p.add_argument("--offset-bits", type=int, default=OFFSET_BITS, metavar="N",
                   help=f"byte-offset width of the large-KV cases: {OFFSET_BITS} (default) "
                        "builds the real 2 / 4 GiB pools past 2^31 / 2^32; 24 runs a scale "
                        "model past 2^23 / 2^24 (megabytes; faults wrap at 24 bits)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--device", default="cpu",
                   help="where faults and correct backends run: cpu (default), cuda, cuda:N")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        return _main(args)
    except UsageError as e:
        print(f"mlacheck selftest: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _main(args: argparse.Namespace) -> int:
    from mlacheck.matrices import MatrixError, load

    if args.seeds < 1:
        raise UsageError("--seeds must be >= 1")
    if not MIN_OFFSET_BITS <= args.offset_bits <= OFFSET_BITS:
        raise UsageError(f"--offset-bits must be in {MIN_OFFSET_BITS}..{OFFSET_BITS}")
    unknown = [f for f in args.fault or [] if f.removeprefix("fault:") not in FAULTS]
    if unknown:
        raise UsageError(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    specs = [FAULTS[f.removeprefix("fault:")] for f in args.fault] if args.fault else list(
        FAULTS.values())
    try:
        matrices = [dataclasses.replace(m, cases=scale_offsets(m.cases, args.offset_bits))
                    for m in (load(args.matrix, seed or None) for seed in range(args.seeds))]
    except MatrixError as e:
        raise UsageError(str(e)) from None
    from mlacheck.backends.registry import available_names

    bad = [b for b in [*(args.backend or []), *([args.inner] if args.inner else [])]
           if b not in available_names() and ":" not in b]
    if bad:
        raise UsageError(f"unknown backend(s) {', '.join(bad)}")
    matrix = matrices[0]
    mode = "quick" if args.quick else "full"
    groups = {mc.group for mc in matrix.cases}
    groups_known = all(set(s.groups) <= groups for s in specs)
    log = _logger()
    log(f"selftest: matrix {matrix.name} ({len(matrix.cases)} cases), {len(specs)} faults, "
        f"{mode}, device {args.device}, {args.offset_bits}-bit offsets")
    start = time.perf_counter()
    faults: list[FaultResult] = []
    for spec in specs:
        r = run_fault(spec, matrix.cases, args.device, args.quick, groups_known, args.inner)
        if args.search:
            from mlacheck.backends.faults.search import EXPENSIVE

            budget = (EXPENSIVE_SEARCH_RUNS if spec.search in EXPENSIVE else SEARCH_RUNS)[mode]
            t0 = time.perf_counter()
            search_fault(r, args.device, budget, args.inner, args.offset_bits)
            r.seconds += time.perf_counter() - t0
        faults.append(r)
        log(f"  fault {spec.name}: {'caught' if r.caught else 'NOT CAUGHT'} by "
            f"{len(r.failing)}/{len(r.ran)} cases ({r.seconds:.1f}s)")
    correct: list[BackendResult] = []
    for name in args.backend or CORRECT_BACKENDS:
        b = run_correct(name, [m.cases for m in matrices], args.device, args.quick)
        correct.append(b)
        log(f"  backend {name}: {len(b.verdicts)} runs, {len(b.false_alarms)} false alarms "
            f"({b.seconds:.1f}s)")
    render(faults, correct)
    escaped = [r.spec.name for r in faults if not r.caught]
    alarms = [b.name for b in correct if b.false_alarms or b.error]
    gate = correct_outcome(correct)
    total = time.perf_counter() - start
    caught = len(faults) - len(escaped)
    summary = (f"{caught}/{len(faults)} faults caught; "
               f"{sum(len(b.false_alarms) for b in correct)} false alarms over "
               f"{sum(len(b.verdicts) for b in correct)} correct-backend runs; {total:.0f}s")
    if escaped:
        summary += f"; ESCAPED: {', '.join(escaped)}"
    if alarms:
        summary += f"; FALSE ALARMS: {', '.join(alarms)}"
    if gate.code and not escaped:
        summary += f"; exit {gate.code}: {gate.reason}"
    print(summary)
    if args.json:
        meta = {"matrix": matrix.name, "mode": mode, "seeds": args.seeds,
                "device": args.device, "offset_bits": args.offset_bits,
                "seconds": round(total, 1), "summary": summary}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(to_json(faults, correct, meta), indent=1,
                                              default=str))
    return EXIT_KERNEL_FAILURE if escaped else gate.code


def correct_outcome(correct: Sequence[BackendResult]):  # noqa: ANN201 - mlacheck.outcome.Outcome
    """The gate's decision over the correct backends' verdicts, as a run of them would get."""
    from mlacheck.session import RunRequest, outcome

    # the name a backend's verdicts record (a pkg.mod:factory request runs under its name)
    names = tuple(b.verdicts[0].backend if b.verdicts else b.name for b in correct)
    return outcome([v for b in correct for v in b.verdicts],
                   RunRequest(backends=names, names=names))


def _logger() -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    return log


if __name__ == "__main__":
    sys.exit(main())
