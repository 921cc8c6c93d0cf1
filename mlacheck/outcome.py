"""The gate decision over counted items, and what each exit code means (no torch).

The exit code is the product: `mlacheck run`, `mlacheck replay`, `mlacheck selftest`,
`ci/*.sh` and plain `pytest --pyargs mlacheck.suite` all take it from here, through
`mlacheck.session.outcome` (README, "Exit codes"). A run is green only when everything it was
asked to run did run and pass: a FAIL/CRASH anywhere in the file (lines written before a
`--resume` included), a suite error, a known failure that passed (strict), a requested
backend that executed nothing, or an interrupted run each turn it red, each with its own code
so a CI job can tell a kernel bug from a broken environment. `EXIT_MEANINGS` is the one table
of what the codes mean (one word for a CI summary, a phrase for the terminal).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mlacheck import verdict
from mlacheck.verdict import CRASH, ERROR, FAIL, KNOWN, XPASS  # noqa: F401 (KNOWN: re-exported)

# Exit codes (README "Exit codes"). 4 and 5 are pytest's own (usage error as pytest reports
# it, nothing collected); 2 is mlacheck's usage/environment error before any case runs.
EXIT_OK = 0
EXIT_KERNEL_FAILURE = 1  # a FAIL or CRASH (or a strict known failure that passed: XPASS)
EXIT_USAGE = 2  # bad input or environment, one line, before any case ran
EXIT_SUITE_ERROR = 3  # mlacheck itself failed (building inputs or the golden): not the kernel
EXIT_PYTEST_USAGE = 4
EXIT_NOTHING_COLLECTED = 5
EXIT_NOT_ENOUGH_RAN = 6  # coverage policy violated, or the run is incomplete
# pytest's own internal error (INTERNALERROR: pytest, xdist or an mlacheck hook failed outside
# any case) is pytest's 3, which is the suite-error code here: it gets a code of its own.
EXIT_INTERNAL_ERROR = 7

# How many distinct skip reasons the per-backend x op table names.
TOP_SKIP_REASONS = 3


@dataclass(frozen=True)
class CoveragePolicy:
    """What a run must execute besides passing. Every requested backend must execute at least
    one case (always); `require_ops` must each execute at least one case per backend;
    `min_executed` is the least executed fraction per backend x op present in the matrix."""

    require_ops: tuple[str, ...] = ()
    min_executed: float = 0.0
    allow_xpass: bool = False


@dataclass(frozen=True)
class Item:
    """One (backend, case) outcome as the gate counts it."""

    backend: str
    op: str
    case_id: str
    status: str  # PASS FAIL CRASH SKIP ERROR
    reason: str = ""
    known: bool = False  # a known-failure rule matches this (backend, case)

    @property
    def bucket(self) -> str:  # what it means: mlacheck.verdict, the one owner
        return verdict.bucket(self.status, self.known)

    @property
    def executed(self) -> bool:
        return verdict.executed(self.status)


@dataclass
class Coverage:
    """Per backend x op: executed and skipped counts and the top skip reasons."""

    executed: int = 0
    skipped: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return self.executed + self.skipped


@dataclass
class Outcome:
    code: int
    lines: list[str]  # why, for the terminal (empty when green)
    coverage: dict[tuple[str, str], Coverage]
    counts: Counter[str]
    recorded: int  # expected items that have a verdict
    expected: int  # items the run header(s) named

    @property
    def incomplete(self) -> bool:
        return self.recorded < self.expected

    @property
    def reason(self) -> str:
        """Why, in one line: the reasons, or what the code means when there are none."""
        return "; ".join(self.lines) or exit_meaning(self.code)

    @property
    def word(self) -> str:
        return exit_word(self.code)


def coverage_table(items: Iterable[Item]) -> dict[tuple[str, str], Coverage]:
    table: dict[tuple[str, str], Coverage] = defaultdict(Coverage)
    for it in items:
        cov = table[(it.backend, it.op)]
        if it.executed:
            cov.executed += 1
        else:
            cov.skipped += 1
            cov.reasons[it.reason or "(no reason given)"] += 1
    return dict(sorted(table.items()))


def decide(items: Sequence[Item], *, requested_backends: Sequence[str] = (),
           expected: Collection[tuple[str, str]] = (),
           policy: CoveragePolicy = CoveragePolicy(),
           unusable: Mapping[str, str] | None = None,
           incomplete: Sequence[str] = (), selection: str = "") -> Outcome:
    """The exit code and its reasons. `items`: one per (backend, case), latest verdict;
    `expected`: the (backend name, case id) items the run(s) meant to run (empty: unknown).
    Missing is a set difference, not a count: verdicts for items outside `expected` (from
    another run over the same file) must not stand in for missing ones. `unusable`: required
    backends that are not usable here, with why (the run did not start them); `incomplete`:
    why the results do not cover the whole run beyond missing items (a shard of a split run
    missing or from another run: mlacheck.shard.join). Each is not enough ran (6).
    `selection`: the -k / -m options of the run ('' if none), named when a requested backend
    has no item in `expected` (the selection left it none: exit 6 said only "executed no
    case")."""
    counts = Counter(it.bucket for it in items)
    cov = coverage_table(items)
    lines: list[str] = []
    codes: list[int] = []

    bad = counts[FAIL] + counts[CRASH]
    if bad:
        codes.append(EXIT_KERNEL_FAILURE)
        lines.append(f"{counts[FAIL]} FAIL, {counts[CRASH]} CRASH")
    if counts[XPASS] and not policy.allow_xpass:
        codes.append(EXIT_KERNEL_FAILURE)
        xp = [f"{it.backend} {it.case_id}" for it in items if it.bucket == XPASS]
        lines.append(f"{len(xp)} XPASS: known failures that now pass (strict; remove their rule "
                     f"from mlacheck/known.py or pass --allow-xpass): {', '.join(xp[:5])}"
                     + (" ..." if len(xp) > 5 else ""))
    if counts[ERROR]:
        codes.append(EXIT_SUITE_ERROR)
        lines.append(f"{counts[ERROR]} ERROR: mlacheck itself failed on these cases (a suite "
                     "error, not the kernel's)")

    by_backend: dict[str, Coverage] = defaultdict(Coverage)
    for (b, _), c in cov.items():
        by_backend[b].executed += c.executed
        by_backend[b].skipped += c.skipped
        by_backend[b].reasons.update(c.reasons)
    short: list[str] = []
    expected_backends = {b for b, _ in expected}
    for b in dict.fromkeys([*requested_backends, *by_backend]):
        c = by_backend.get(b)
        if c is None or c.executed == 0:
            why = "; ".join(f"{r} ({n})" for r, n in c.reasons.most_common(TOP_SKIP_REASONS)) if c else ""
            if c is None and expected_backends and b not in expected_backends:
                why = (f"{selection} selected none of its items" if selection
                       else "none of its items was selected")
            short.append(f"backend {b} executed no case" + (f": {why}" if why else ""))
    ops = sorted({op for _, op in cov})
    for op in policy.require_ops:
        for b in dict.fromkeys([*requested_backends, *by_backend]):
            c = cov.get((b, op))
            if c is None or c.executed == 0:
                short.append(f"backend {b} executed no {op} case (required by --require-ops)")
    if policy.min_executed > 0:
        for (b, op), c in cov.items():
            if op in ops and c.total and c.executed / c.total < policy.min_executed:
                short.append(f"backend {b} {op}: executed {c.executed} of {c.total} "
                             f"({c.executed / c.total:.0%} < --min-executed {policy.min_executed:.0%})")
    short += [f"backend {b} is not usable here: {why}" for b, why in (unusable or {}).items()]
    short += list(incomplete)
    missing = set(expected) - {(it.backend, it.case_id) for it in items}
    recorded = len(set(expected)) - len(missing)
    if missing:
        short.append(f"INCOMPLETE: {recorded} of {len(set(expected))} items have a verdict")
    if short:
        codes.append(EXIT_NOT_ENOUGH_RAN)
        lines += short
    code = min(codes, key=_PRIORITY.index) if codes else EXIT_OK
    return Outcome(code, lines, cov, counts, recorded, len(set(expected)))


# When several hold, the most specific to the kernel wins.
_PRIORITY = (EXIT_KERNEL_FAILURE, EXIT_SUITE_ERROR, EXIT_NOT_ENOUGH_RAN)


def coverage_lines(cov: dict[tuple[str, str], Coverage]) -> list[str]:
    """The end-of-run table: per backend x op executed / skipped and the top skip reasons."""
    if not cov:
        return []
    wb = max(len("backend"), *(len(b) for b, _ in cov))
    wo = max(len("op"), *(len(o) for _, o in cov))
    out = [f"{'backend':<{wb}}  {'op':<{wo}}  executed  skipped  top skip reasons"]
    for (b, op), c in cov.items():
        why = "; ".join(f"{r} ({n})" for r, n in c.reasons.most_common(TOP_SKIP_REASONS))
        out.append(f"{b:<{wb}}  {op:<{wo}}  {c.executed:>8}  {c.skipped:>7}  {why}")
    return out


# code -> (one word for a CI summary, what it means for the terminal): the one table.
EXIT_MEANINGS: dict[int, tuple[str, str]] = {
    EXIT_OK: ("PASS", "everything requested ran and passed (SKIPs with reasons and KNOWN failures "
                       "allowed)"),
    EXIT_KERNEL_FAILURE: ("FAIL", "kernel failure (FAIL, CRASH or strict XPASS)"),
    EXIT_USAGE: ("USAGE ERROR", "usage or environment error"),
    EXIT_SUITE_ERROR: ("SUITE ERROR", "suite error (mlacheck failed, not the kernel)"),
    EXIT_PYTEST_USAGE: ("USAGE ERROR", "usage error (pytest)"),
    EXIT_NOTHING_COLLECTED: ("NOTHING SELECTED", "nothing selected to run"),
    EXIT_NOT_ENOUGH_RAN: ("NOT ENOUGH RAN", "not enough ran (coverage policy or incomplete run)"),
    EXIT_INTERNAL_ERROR: ("INTERNAL ERROR",
                          "internal error of the test driver (no verdict on the run)"),
}
_UNKNOWN = ("ERROR", "pytest error")


def gate_lines(out: Outcome, why: str = "") -> list[str]:
    """The gate's code and its reasons as the terminal shows them at the end of a run (one
    `mlacheck gate:` line, then a line per reason); `why`: on the gate line itself."""
    head = f"mlacheck gate: exit {out.code} ({exit_meaning(out.code)})" + (f": {why}" if why else "")
    return [head, *(f"  {line}" for line in out.lines)]


def exit_meaning(code: int) -> str:
    return EXIT_MEANINGS.get(code, _UNKNOWN)[1]


def exit_word(code: int) -> str:
    return EXIT_MEANINGS.get(code, _UNKNOWN)[0]
