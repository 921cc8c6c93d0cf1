"""What a run was asked for, and what its results mean for the exit code (no torch, no pytest).

Every way of driving mlacheck goes through the same two steps, so they cannot disagree:

    request = RunRequest.parse(backends=["torch,aiter"], matrix="smoke", require_ops="mla_decode")
    request = request.resolved(lambda spec: registry.resolve(spec).name)  # names, once each
    ...  # run the items; each verdict is a line in the results file
    result = outcome(results_path, request, interrupted=False, internal_error=False)
    result.code, result.reason, result.lines, result.coverage  # per backend x op counts

- `RunRequest.parse` is the one parser of the run options: backends split on commas and
  de-duplicated, the `--require-ops` string (one ops parser: `parse_ops`), the coverage
  policy; it validates once and raises UsageError (one line, exit 2; the pytest plugin turns
  it into pytest's usage error). `resolved` keys the backends by the name their verdicts
  record, so two spellings of one backend run once.
- `outcome` reads one or more results files (a list: the shards of a split run, for
  `mlacheck merge`), or verdicts held in memory (`mlacheck replay`, `selftest`), and returns
  mlacheck.outcome.Outcome: the exit code (mlacheck.outcome.EXIT_MEANINGS says what each
  means), the reasons, and the executed / skipped counts per backend x op. `interrupted`
  (Ctrl-C, SIGTERM) makes a run incomplete whatever the file says, a failure on record still
  winning; `internal_error` (pytest's INTERNALERROR) is exit 7, no verdict on the run;
  `unusable` (required backends not usable here: the run did not start) and `incomplete`
  (a split run's shards that do not add up, mlacheck.shard.join) are exit 6.
  A results file with nothing on record and nothing expected is exit 5 (the run selected
  nothing); verdicts in memory are always decided (a requested backend without one: 6).
- `pytest_outcome` is the one table from a verdict's bucket to what pytest reports.

Callers: `mlacheck run` and `replay` (mlacheck.cli), `mlacheck selftest`, the pytest plugin
(session end), `ci/mlacheck_ci.py summary`. A new gate rule (a required backend, a check
that a SIGTERM-ed run says so) is a field of RunRequest / CoveragePolicy read in `outcome` or
mlacheck.outcome.decide, never a second decision at a call site.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlacheck.errors import UsageError
from mlacheck.outcome import (
    EXIT_INTERNAL_ERROR,
    EXIT_KERNEL_FAILURE,
    EXIT_NOT_ENOUGH_RAN,
    EXIT_NOTHING_COLLECTED,
    EXIT_SUITE_ERROR,
    CoveragePolicy,
    Item,
    Outcome,
    decide,
    exit_meaning,
)
from mlacheck.spec import OPS
from mlacheck.verdict import CRASH, ERROR, FAIL, KNOWN, PASS, SKIP, XPASS, Verdict


def split_names(values: Iterable[str] | str | None) -> tuple[str, ...]:
    """Repeated and comma-separated names ("a,b", "b"), each once, in order."""
    if isinstance(values, str):
        values = [values]
    names = [n.strip() for v in values or () for n in v.split(",")]
    return tuple(dict.fromkeys(n for n in names if n))


def parse_ops(text: str | Iterable[str] | None, flag: str = "--require-ops") -> tuple[str, ...]:
    """The one ops parser: comma-separated op names, each once, each an op mlacheck knows."""
    ops = split_names(text)
    for op in ops:
        if op not in OPS:
            raise UsageError(f"{flag}: unknown op {op!r}; ops: {', '.join(OPS)}")
    return ops


@dataclass(frozen=True)
class RunRequest:
    """What a run is asked to do and what it must show to pass, parsed and checked once."""

    backends: tuple[str, ...] = ()  # as requested (name, entry point or pkg.mod:factory)
    matrix: str = "smoke"  # a matrix name or a YAML path
    device: str = "auto"  # as requested; mlacheck.preflight.resolve_device resolves it
    golden: str = "fp32"
    seed: int | None = None
    policy: CoveragePolicy = field(default_factory=CoveragePolicy)
    # The name each backend's verdicts record (Backend.name), once `resolved`; () before.
    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, *, backends: Iterable[str] | str | None = None,
              default_backends: Sequence[str] = (), matrix: str = "smoke", device: str = "auto",
              golden: str = "fp32", seed: int | None = None,
              require_ops: str | Iterable[str] | None = "", min_executed: float = 0.0,
              allow_xpass: bool = False, flag_prefix: str = "--") -> RunRequest:
        """From command-line values (argparse or pytest options alike); UsageError if bad.
        `flag_prefix`: how the options are spelled in messages (the plugin's are `--mla-`)."""
        if not 0.0 <= min_executed <= 1.0:
            raise UsageError(f"{flag_prefix}min-executed must be a fraction in 0..1")
        ops = parse_ops(require_ops, f"{flag_prefix}require-ops")
        return cls(split_names(backends) or tuple(default_backends), matrix, device, golden, seed,
                   CoveragePolicy(ops, min_executed, allow_xpass))

    def resolved(self, name_of: Callable[[str], str]) -> RunRequest:
        """Backends keyed by the name their verdicts record: the first request of each name
        runs (`torch` and `mlacheck.backends.torch_ref:factory` would run every item twice
        under one name). `name_of` raises for a backend that does not exist."""
        first: dict[str, str] = {}
        for spec in self.backends:
            first.setdefault(name_of(spec), spec)
        return dataclasses.replace(self, backends=tuple(first.values()), names=tuple(first))

    def named(self, names: Iterable[str]) -> RunRequest:
        """The request for backends known only by the names their verdicts record (a results
        file's run headers: `mlacheck merge`, the CI summary of a merged file)."""
        recorded = tuple(dict.fromkeys(names))
        return dataclasses.replace(self, backends=recorded, names=recorded)

    @property
    def backend_names(self) -> tuple[str, ...]:
        """The names the gate expects verdicts under (the requests themselves if unresolved)."""
        return self.names or self.backends


# What a results reader hands `outcome`: a results file, the shards of one, or verdicts.
Results = str | Path | Sequence[str | Path] | Sequence[Verdict]


def outcome(results: Results, request: RunRequest, interrupted: bool = False,
            internal_error: bool = False, *, unusable: Mapping[str, str] | None = None,
            incomplete: Sequence[str] = (), selection: str = "") -> Outcome:
    """The exit code of a run and why, from everything its results hold (lines from before a
    `--resume` included). `unusable`: required backends not usable here, {name: why}: the
    run did not start, so they are its only reasons (6). `incomplete`: why the results are
    not the whole run beyond missing items (a shard of a split run missing or from another
    run: mlacheck.shard.join; 6 unless a failure on record wins). `selection`: the run's -k /
    -m ('' if none), named when it left a requested backend no item."""
    if unusable:
        return decide([], unusable=unusable)
    items, expected, files = _counted(results)
    if internal_error:
        return Outcome(EXIT_INTERNAL_ERROR, [exit_meaning(EXIT_INTERNAL_ERROR)], {}, _counts(items),
                       0, len(expected))
    if files and not (items or expected or interrupted or incomplete):  # a run that selected nothing
        return Outcome(EXIT_NOTHING_COLLECTED, [], {}, _counts(items), 0, 0)
    out = decide(items, requested_backends=request.backend_names, expected=expected,
                 policy=request.policy, incomplete=incomplete, selection=selection)
    if interrupted:
        # what ran still counts (a failure wins), but the run is incomplete whatever it holds
        if out.code not in (EXIT_KERNEL_FAILURE, EXIT_SUITE_ERROR):
            out.code = EXIT_NOT_ENOUGH_RAN
        out.lines.append("INCOMPLETE: the run was interrupted (continue it with `mlacheck run "
                         "--resume`)")
    return out


def _counts(items: Sequence[Item]) -> Counter[str]:
    return Counter(it.bucket for it in items)


def _counted(results: Results) -> tuple[list[Item], set[tuple[str, str]], bool]:
    """One counted item per (backend, case), the latest line of each, the expected items
    every run header named, and whether the results are files (not verdicts in memory)."""
    from mlacheck import results as results_file

    if isinstance(results, str | Path):
        results = [results]
    verdicts = [r for r in results if isinstance(r, Verdict)]
    paths = [Path(r) for r in results if isinstance(r, str | Path)]
    records: list[dict[str, Any]] = [v.to_dict() for v in verdicts]
    expected: set[tuple[str, str]] = set()
    for p in paths:
        if not p.exists():
            continue
        raw = results_file.read_raw(p)
        records += raw.records
        expected |= raw.expected
    items = [Item(str(r.get("backend", "")), str(r.get("op", "")), str(r.get("case_id", "")),
                  str(r.get("status", "")), str(r.get("reason", "")), bool(r.get("known_failure")))
             for r in results_file.latest_per_item(records)]
    return items, expected, bool(paths)


# A verdict's bucket -> what pytest reports for its item (an XPASS passes when allowed).
PYTEST_OUTCOMES: dict[str, str] = {
    PASS: "passed", SKIP: "skipped", KNOWN: "xfailed",
    FAIL: "failed", CRASH: "failed", ERROR: "failed", XPASS: "failed",
}


def pytest_outcome(bucket: str, allow_xpass: bool = False) -> str:
    if bucket == XPASS and allow_xpass:
        return "passed"
    return PYTEST_OUTCOMES.get(bucket, "failed")  # an unknown status is never a pass
