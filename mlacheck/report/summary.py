"""What a report says, computed once from the verdicts (pure: no I/O, no plotting).

What ran (matrix, backends with their versions, device, mlacheck's version, date, wall time:
from the run headers), counts per backend x op x status, executed vs skipped per backend x op
(a thin one keeps the headline from looking green), SKIP reasons grouped (coverage holes must
be visible), failures with their one-screen summaries, per-format distributions of worst row
error / bound, and timing totals per phase.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from mlacheck import tolerances
from mlacheck.outcome import Coverage, Item, coverage_table
from mlacheck.results import RunHeader
from mlacheck.verdict import CRASH, ERROR, FAIL, KNOWN, PASS, SKIP, XPASS, Verdict

# ERROR and XPASS are columns only when some verdict has them (see Summary.statuses).
STATUSES: tuple[str, ...] = (PASS, FAIL, CRASH, SKIP, KNOWN)
PHASES: tuple[str, ...] = ("inputs", "kernel", "golden", "baseline", "judge")
# A backend x op that executed less than this share of its items is thin coverage: the
# headline says so and is not green, even when everything that ran passed. A report's
# reading, not a gate (the gate's own is `--min-executed`); half, so that the embedded
# default's prefill on gfx942 (0 of 15 executed) and gfx950 (2 of 15) are named.
THIN_COVERAGE = 0.5


def ratio(v: Verdict) -> float | None:
    """metrics.worst_row / metrics.bound: > 1 means the worst row is beyond the bound."""
    w, b = v.metrics.get("worst_row"), v.metrics.get("bound")
    if not isinstance(w, int | float) or not isinstance(b, int | float) or not b > 0:
        return None
    r = float(w) / float(b)
    return None if math.isnan(r) else r


def compute_format(v: Verdict) -> str:
    """The compute (P) format of a case: the KV format, as the tolerance policy defines it."""
    quant = v.case.get("quant")
    if not isinstance(quant, dict) or not quant.get("kv"):
        return "unknown"
    return tolerances.compute_format(str(quant.get("q", "")), str(quant["kv"]))


@dataclass(frozen=True)
class SkipGroup:
    backend: str
    op: str
    reason: str
    count: int
    examples: tuple[str, ...]

    def line(self) -> str:
        return f"{self.backend} {self.op}: {self.reason}: {self.count} case{_s(self.count)}"


@dataclass(frozen=True)
class Failure:
    verdict: Verdict
    text: str  # Verdict.summary(): one screen a kernel engineer can act on

    @property
    def heatmap(self) -> list[list[float]] | None:
        h = self.verdict.metrics.get("heatmap")
        ok = isinstance(h, list) and h and all(isinstance(r, list) and r for r in h)
        return h if ok else None


@dataclass(frozen=True)
class Distribution:
    """worst_row / bound over the cases of one compute format."""

    fmt: str
    ratios: tuple[float, ...]  # sorted

    @property
    def n(self) -> int:
        return len(self.ratios)

    @property
    def over(self) -> int:
        return sum(r > 1.0 for r in self.ratios)

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile (exact values seen, no interpolation)."""
        i = min(self.n - 1, max(0, math.ceil(q * self.n) - 1))
        return self.ratios[i]


@dataclass(frozen=True)
class PhaseTime:
    phase: str
    total: float
    cases: int
    worst: float
    worst_case: str


@dataclass(frozen=True)
class RunInfo:
    """What ran, for the report's title and header: from the run headers of the results file
    (one per run over it: a `--resume` adds one) and the verdicts' implementation records."""

    matrices: tuple[str, ...] = ()
    backends: tuple[tuple[str, str], ...] = ()  # (name, its versions as the verdicts say)
    devices: tuple[str, ...] = ()
    machine: tuple[tuple[str, str], ...] = ()  # host, cpu, gpu
    software: tuple[tuple[str, str], ...] = ()  # mlacheck, torch, python
    workers: int = 0
    started: float = 0.0  # the first run's start (seconds since the epoch); 0: unknown
    runs: int = 0  # run headers in the file
    wall_s: float | None = None  # wall-clock seconds of the runs; None: unknown

    def title(self) -> str:
        if not self.matrices and not self.backends:
            return ""
        what = f"matrix {', '.join(self.matrices) or '?'}"
        if self.backends:
            what += " x " + ", ".join(b for b, _ in self.backends)
        if self.devices:
            what += " on " + ", ".join(self.devices)
        return f"mlacheck report: {what}"

    def facts(self) -> list[str]:
        """The header's lines: backends with versions, the machine, software, date and time."""
        out = []
        if self.backends:
            out.append("backends: " + "; ".join(f"{b} ({v})" if v else b
                                                for b, v in self.backends))
        machine = dict(self.machine)
        if machine:
            out.append("machine: " + ", ".join(machine[k] for k in ("host", "cpu", "gpu")
                                                if machine.get(k)))
        if self.software:
            out.append("software: " + ", ".join(f"{k} {v}" for k, v in self.software))
        when = []
        if self.started:
            when.append("started " + time.strftime("%Y-%m-%d %H:%M:%S %Z",
                                                   time.localtime(self.started)))
        if self.wall_s is not None:
            when.append(f"wall time {self.wall_s:.1f} s")
        if self.workers:
            when.append(f"{self.workers} worker{_s(self.workers)}")
        if self.runs > 1:
            when.append(f"{self.runs} runs over the file (--resume / --append)")
        if when:
            out.append(", ".join(when))
        return out


def run_info(headers: Sequence[RunHeader], verdicts: list[Verdict],
             wall_s: float | None = None) -> RunInfo:
    """RunInfo from the file's run headers (in file order) and its verdicts."""
    versions: dict[str, dict[str, None]] = defaultdict(dict)
    for v in verdicts:
        impl = v.implementation or {}
        said = str(impl.get("version") or (f"torch {impl['torch']}" if impl.get("torch") else ""))
        if said:
            versions[v.backend][said] = None
    names = [b for h in headers for b in h.backends] + [v.backend for v in verdicts]
    backends = tuple((b, " / ".join(versions.get(b, {}))) for b in dict.fromkeys(names))
    latest = headers[-1] if headers else None  # the latest run's machine and software
    return RunInfo(
        matrices=tuple(dict.fromkeys(h.matrix for h in headers if h.matrix)),
        backends=backends,
        devices=tuple(dict.fromkeys(h.device for h in headers if h.device)),
        machine=tuple(latest.machine.items()) if latest else (),
        software=tuple(latest.software.items()) if latest else (),
        workers=max((h.workers for h in headers), default=0),
        started=min((h.started for h in headers if h.started > 0), default=0.0),
        runs=len(headers), wall_s=wall_s)


@dataclass
class Summary:
    total: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    counts: dict[tuple[str, str], Counter[str]] = field(default_factory=dict)
    skips: list[SkipGroup] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    known: list[Failure] = field(default_factory=list)
    stale_known: list[Verdict] = field(default_factory=list)  # known failures that now PASS
    distributions: list[Distribution] = field(default_factory=list)
    timings: list[PhaseTime] = field(default_factory=list)
    duplicates: int = 0  # superseded verdict lines (the same case x backend written again)
    unparsable: int = 0  # lines of the results file that were skipped
    expected: int = 0  # items the run meant to run (0: unknown)
    missing: int = 0  # of those, the items without a verdict (a set difference, not a count)
    run: RunInfo = field(default_factory=RunInfo)
    coverage: dict[tuple[str, str], Coverage] = field(default_factory=dict)

    @property
    def incomplete(self) -> bool:
        return self.missing > 0

    @property
    def executed(self) -> int:
        return sum(c.executed for c in self.coverage.values())

    @property
    def thin(self) -> list[tuple[str, str, Coverage]]:
        """Backend x op that executed under THIN_COVERAGE of their items."""
        return [(b, op, c) for (b, op), c in self.coverage.items()
                if c.total and c.executed < THIN_COVERAGE * c.total]

    def coverage_line(self) -> str:
        """Executed vs skipped in one line, naming every thin backend x op."""
        n = sum(c.total for c in self.coverage.values())
        line = f"{self.executed} of {n} item{_s(n)} executed ({n - self.executed} not)"
        thin = self.thin
        if thin:
            line += (f"; under {THIN_COVERAGE:.0%} executed: "
                     + ", ".join(f"{b} {op} {c.executed} of {c.total}" for b, op, c in thin))
        return line

    def headline(self) -> tuple[str, str]:
        """(text, tone): tone `bad` (red), `partial` (amber: all that ran passed, but thin
        coverage) or `good` (green: all ran, all passed)."""
        n_bad = len(self.failures)
        if n_bad:
            crashes = self.by_status[CRASH]
            return (f"{n_bad} case{_s(n_bad)} failing"
                    + (f" ({crashes} crash{'es' if crashes != 1 else ''})" if crashes else ""),
                    "bad")
        if self.by_status[ERROR] or self.by_status[XPASS]:
            return (f"{self.by_status[ERROR]} suite error(s), {self.by_status[XPASS]} known "
                    "failure(s) now passing (XPASS)"), "bad"
        if self.incomplete:
            return f"INCOMPLETE: {self.with_verdict} of {self.expected} items have a verdict", "bad"
        if not self.executed:
            return "No case was executed", "bad"
        known = f", {self.by_status[KNOWN]} known failure(s)" if self.by_status[KNOWN] else ""
        text = f"All {self.executed} executed cases pass{known}"
        if self.thin:
            return f"{text}, but coverage is thin: {self.coverage_line()}", "partial"
        skipped = sum(c.skipped for c in self.coverage.values())
        return text + (f" ({skipped} skipped)" if skipped else ""), "good"

    @property
    def with_verdict(self) -> int:
        """Expected items that have a verdict (verdicts of items no header named not counted)."""
        return self.expected - self.missing

    def incomplete_line(self) -> str:
        return (f"INCOMPLETE: {self.with_verdict} of {self.expected} items have a verdict (the run "
                "was interrupted or is still going; continue it with `mlacheck run --resume`)")

    @property
    def statuses(self) -> tuple[str, ...]:
        """The fixed columns plus any unexpected status seen (never hide a verdict)."""
        extra = sorted(set(self.by_status) - set(STATUSES))
        return STATUSES + tuple(extra)

    def total_line(self) -> str:
        parts = [f"{self.by_status[s]} {s}" for s in self.statuses]
        line = f"{self.total} case{_s(self.total)}: " + ", ".join(parts)
        if self.incomplete:
            line = f"INCOMPLETE ({self.with_verdict} of {self.expected} items): " + line
        if self.unparsable:
            line += f" ({self.unparsable} unparsable line{_s(self.unparsable)} skipped)"
        return line


def summarise(verdicts: list[Verdict], unparsable: int = 0, *, expected: int = 0,
              missing: int | None = None, superseded: int = 0,
              headers: Sequence[RunHeader] = (), wall_s: float | None = None) -> Summary:
    """Everything the markdown and HTML reports show, from the verdicts (one per item) and
    what the run headers said (what was to run, by which mlacheck, where, when)."""
    return Summary(
        total=len(verdicts),
        by_status=Counter(v.bucket for v in verdicts),
        counts=count_table(verdicts),
        skips=skip_groups(verdicts),
        failures=[Failure(v, v.summary()) for v in failures_first(verdicts)],
        known=[
            Failure(v, f"{v.summary()}\n  known failure: {v.known_failure}")
            for v in verdicts
            if v.bucket == KNOWN
        ],
        stale_known=[v for v in verdicts if v.bucket == XPASS],
        distributions=distributions(verdicts),
        timings=phase_times(verdicts),
        duplicates=superseded + sum(
            n - 1 for n in Counter((v.case_id, v.backend) for v in verdicts).values()),
        unparsable=unparsable,
        expected=expected,
        # callers that know only counts (no item keys): the shortfall
        missing=max(0, expected - len(verdicts)) if missing is None else missing,
        run=run_info(headers, verdicts, wall_s),
        coverage=coverage_table(Item(v.backend, v.op, v.case_id, v.status, v.reason,
                                     bool(v.known_failure)) for v in verdicts),
    )


def count_table(verdicts: list[Verdict]) -> dict[tuple[str, str], Counter[str]]:
    table: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for v in verdicts:
        table[(v.backend, v.op)][v.bucket] += 1
    return dict(sorted(table.items()))


def skip_groups(verdicts: list[Verdict]) -> list[SkipGroup]:
    """SKIPs grouped by backend, op and exact reason; the biggest holes first."""
    groups: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for v in verdicts:
        if v.bucket == SKIP:
            groups[(v.backend, v.op, v.reason or "(no reason given)")].append(v.case_id)
    rows = [SkipGroup(b, o, r, len(ids), tuple(ids[:3])) for (b, o, r), ids in groups.items()]
    return sorted(rows, key=lambda g: (-g.count, g.backend, g.op, g.reason))


def failures_first(verdicts: list[Verdict]) -> list[Verdict]:
    """Unexplained FAIL/CRASH verdicts and suite ERRORs: per backend x op, crashes first, then
    worst ratio."""
    bad = [v for v in verdicts if (v.kernel_failed and v.bucket != KNOWN) or v.is_suite_error]
    return sorted(
        bad, key=lambda v: (v.backend, v.op, v.status != CRASH, -(ratio(v) or 0.0), v.case_id)
    )


def distributions(verdicts: list[Verdict]) -> list[Distribution]:
    by_fmt: dict[str, list[float]] = defaultdict(list)
    for v in verdicts:
        r = ratio(v)
        if r is not None:
            by_fmt[compute_format(v)].append(r)
    return [Distribution(f, tuple(sorted(rs))) for f, rs in sorted(by_fmt.items())]


def phase_times(verdicts: list[Verdict]) -> list[PhaseTime]:
    """Total and slowest case per phase, in pipeline order (unknown phases after)."""
    seen = {p for v in verdicts for p in v.timings}
    phases = [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))
    out = []
    for p in phases:
        ts = [
            (float(t), v.case_id)
            for v in verdicts
            if isinstance(t := v.timings.get(p), int | float) and math.isfinite(t)
        ]
        if ts:
            worst, case = max(ts)
            out.append(PhaseTime(p, sum(t for t, _ in ts), len(ts), worst, case))
    return out


def _s(n: int) -> str:
    return "" if n == 1 else "s"
