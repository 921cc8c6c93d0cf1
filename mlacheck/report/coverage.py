"""How much of a matrix each backend's kernels really ran: per backend x version x op, the cases
executed, the SKIPs that are the kernel's own limits, the SKIPs that are the adapter's choice,
and those of the machine (library missing, no GPU, not enough memory).

Which is which is read from the SKIP reason: an adapter's choice says `adapter:`
(mlacheck.backends.base.ADAPTER_CHOICE), as do the reasons an adapter cannot call the installed
library (a signature that changed, an op it does not provide); `unavailable:` and the memory
estimate's "case needs" are the machine's; every other SKIP of a real backend is a kernel limit
whose reason names its source. The SKIP reasons are listed under the table with their class.

    python -m mlacheck.report.coverage results.jsonl [more.jsonl ...] [-o coverage.md]
    mlacheck report --coverage results.jsonl [more.jsonl ...]

Counts are verdicts: several results files (seeds, matrices) add up.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mlacheck.backends.base import ADAPTER_CHOICE, UNAVAILABLE
from mlacheck.report.load import read_results
from mlacheck.verdict import Verdict

EXECUTED = "executed"
KERNEL, ADAPTER, MACHINE = "kernel limit", "adapter", "machine"
SUITE = "suite error"
COLUMNS = (EXECUTED, KERNEL, ADAPTER, MACHINE, SUITE)
# Reasons an adapter cannot call what is installed (toolkit.signature_problem(s), the AITER
# loader): the adapter's side, not a kernel limit.
ADAPTER_MARKS = (ADAPTER_CHOICE, "does not provide op", "has no parameter", "requires parameter",
                 "positionally only", "installed aiter", "lacks aiter/", "importing AITER's")
MACHINE_MARKS = (UNAVAILABLE, "case needs ")


def skip_class(reason: str) -> str:
    """kernel limit / adapter / machine, from a SKIP reason (see the module docstring)."""
    if reason.startswith(MACHINE_MARKS):
        return MACHINE
    if any(mark in reason for mark in ADAPTER_MARKS):
        return ADAPTER
    return KERNEL


def outcome(v: Verdict) -> str:
    """The coverage column of one verdict (the verdict says what its status means)."""
    if v.executed:  # KNOWN / XPASS count: the kernel ran
        return EXECUTED
    if v.is_suite_error:
        return SUITE
    return skip_class(v.reason)  # what is left is a SKIP


@dataclass
class Coverage:
    counts: dict[tuple[str, str, str], Counter[str]] = field(default_factory=dict)
    reasons: Counter[tuple[str, str, str, str]] = field(default_factory=Counter)

    def add(self, v: Verdict) -> None:
        key = (v.backend, str(v.implementation.get("version", "")), v.op)
        column = outcome(v)
        self.counts.setdefault(key, Counter())[column] += 1
        if column in (KERNEL, ADAPTER, MACHINE):
            self.reasons[(v.backend, v.op, column, v.reason)] += 1


def coverage(verdicts: Iterable[Verdict]) -> Coverage:
    cov = Coverage()
    for v in verdicts:
        cov.add(v)
    return cov


def markdown(cov: Coverage, sources: list[str]) -> str:
    """The coverage table and the SKIP reasons, as markdown."""
    lines = [f"Coverage of {', '.join(sources)} (`python -m mlacheck.report.coverage`).", "",
             "| backend | version | op | " + " | ".join(c if c == EXECUTED else f"SKIP: {c}"
                                                    if c != SUITE else c for c in COLUMNS) + " |",
             "|" + "---|" * (3 + len(COLUMNS))]
    for (backend, version, op), counts in sorted(cov.counts.items()):
        total = sum(counts.values())
        cells = [f"{counts[c]} / {total}" if c == EXECUTED else str(counts[c]) for c in COLUMNS]
        lines.append(f"| {backend} | {version or '-'} | {op} | " + " | ".join(cells) + " |")
    lines += ["", "SKIP reasons (backend, op, class, verdicts, reason):", ""]
    for (backend, op, column, reason), n in sorted(cov.reasons.items()):
        lines.append(f"- {backend} {op} [{column}] x{n}: {reason}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlacheck.report.coverage",
                                description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, nargs="+", help="results files (JSON lines)")
    p.add_argument("-o", "--output", type=Path, help="write the markdown here (else stdout)")
    args = p.parse_args(argv)
    verdicts: list[Verdict] = []
    for path in args.results:
        try:
            verdicts += read_results(path).verdicts
        except OSError as e:
            print(f"mlacheck coverage: error: cannot read {path}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
    if not verdicts:
        print("mlacheck coverage: error: no verdicts in the results files", file=sys.stderr)
        return 2
    text = markdown(coverage(verdicts), [p.name for p in args.results])
    if args.output:
        args.output.write_text(text)
        print(args.output)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
