"""What a verdict is and what it means: statuses, buckets, checks, locations and their JSON
form (no torch).

The judge (mlacheck.judge) decides verdicts; the results file, the report, the gate decision
(mlacheck.outcome) and CI scripts read them. Keeping the data model apart lets those readers
load results without importing torch or the judging policy.

This module is the one owner of what a status means. Everything else asks it, on a verdict
(`v.bucket`, `v.kernel_failed`, `v.executed`, `v.is_suite_error`) or on a bare status read
from a results line (the functions of the same names); nobody writes `status in (FAIL,
CRASH)` out again:

    status  known rule  bucket  kernel_failed  executed  is_suite_error
    PASS    no / yes    PASS / XPASS   no        yes       no
    FAIL    no / yes    FAIL / KNOWN   yes       yes       no
    CRASH   no / yes    CRASH / KNOWN  yes       yes       no
    SKIP    -           SKIP           no        no        no
    ERROR   -           ERROR          no        no        yes

A bucket is the column a verdict is counted in (report, CI summary, gate): KNOWN is a kernel
failure a documented finding (mlacheck.known) explains; XPASS is a documented finding whose
case now passes (its rule is stale; strict runs fail on it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mlacheck.ops import unit_of

PASS, FAIL, CRASH, SKIP = "PASS", "FAIL", "CRASH", "SKIP"
# mlacheck itself failed on the case (building inputs or the golden): the suite's error,
# never charged to the kernel under test.
ERROR = "ERROR"
# Buckets beyond the statuses: a documented finding that fails (KNOWN) or passes (XPASS).
KNOWN, XPASS = "KNOWN", "XPASS"
STATUSES: tuple[str, ...] = (PASS, FAIL, CRASH, SKIP, ERROR)
BUCKETS: tuple[str, ...] = (PASS, FAIL, CRASH, ERROR, SKIP, KNOWN, XPASS)


def kernel_failed(status: str) -> bool:
    """The kernel under test gave a wrong result or died (FAIL or CRASH), known or not."""
    return status in (FAIL, CRASH)


def executed(status: str) -> bool:
    """The kernel ran on the case: a verdict about the kernel (not SKIP, not a suite ERROR)."""
    return status not in (SKIP, ERROR)


def is_suite_error(status: str) -> bool:
    """mlacheck itself failed on the case: never charged to the kernel."""
    return status == ERROR


def bucket(status: str, known: bool = False) -> str:
    """The column a status is counted in; `known`: a known-failure rule matches the item."""
    if known and kernel_failed(status):
        return KNOWN
    if known and status == PASS:
        return XPASS
    return status


def noteworthy(a_bucket: str) -> bool:
    """A bucket the reports put in view: all but PASS and SKIP (a KNOWN failure is shown too)."""
    return a_bucket not in (PASS, SKIP)


@dataclass
class Check:
    name: str
    passed: bool
    value: float | None = None
    bound: float | None = None
    detail: str = ""


@dataclass
class Where:
    """One localised failure: which request/segment, tokens, heads, pages, pool bytes."""

    check: str
    request: int
    tokens: tuple[int, int]  # [first, last] global token rows
    request_tokens: tuple[int, int]  # [first, last] within the request
    heads: list[int]
    worst: float
    bound: float
    pages: list[int] = field(default_factory=list)
    bytes: tuple[int, int] | None = None
    region: str = ""
    kv_len: int | None = None  # the request's / segment's kv length (None in old results)

    def message(self, unit: str) -> str:
        kind = "segment" if unit == "segment" else "request"
        h = ranges(self.heads)
        kv = f" (kv {self.kv_len})" if self.kv_len is not None else ""
        s = (
            f"{self.check}: {kind} {self.request}{kv} tokens {self.request_tokens[0]}-"
            f"{self.request_tokens[1]} (rows {self.tokens[0]}-{self.tokens[1]}), heads {h}: "
            f"worst {self.worst:.3g} > bound {self.bound:.3g}"
        )
        if self.pages:
            s += f"; pages {ranges(self.pages, 12)}"
        if self.bytes:
            s += f", pool bytes {self.bytes[0]:#x}-{self.bytes[1]:#x} ({self.region})"
        return s


@dataclass
class Verdict:
    case_id: str
    backend: str
    op: str
    status: str
    reason: str = ""
    checks: list[Check] = field(default_factory=list)
    where: list[Where] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    case: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # A documented real kernel finding (a rule in mlacheck/known.py) that matches this case:
    # a FAIL/CRASH is reported KNOWN, a PASS is XPASS (the rule is stale).
    known_failure: str = ""
    known_rule: str = ""
    # What the implementation reported about itself (library version, kernel variant, how
    # the adapter fed it: a repacked pool, per-q_len calls, ...): every verdict says which
    # build of which kernel it is about.
    implementation: dict[str, Any] = field(default_factory=dict)
    # The axis the failure lies along, in words (mlacheck.localise.diagnose): the first line
    # of the failure card.
    diagnosis: str = ""

    @property
    def bucket(self) -> str:
        return bucket(self.status, bool(self.known_failure))

    @property
    def kernel_failed(self) -> bool:
        return kernel_failed(self.status)

    @property
    def executed(self) -> bool:
        return executed(self.status)

    @property
    def is_suite_error(self) -> bool:
        return is_suite_error(self.status)

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def summary(self) -> str:
        """One screen a kernel engineer can act on."""
        head = f"{self.status} {self.backend} {self.case_id}"
        if self.reason:
            head += f": {self.reason}"
        if self.diagnosis:
            head += f" -- {self.diagnosis}"
        lines = [head]
        for c in self.failed_checks:
            b = f" (value {c.value:.3g}, bound {c.bound:.3g})" if c.value is not None and c.bound is not None else ""
            lines.append(f"  check {c.name} failed{b}{': ' + c.detail if c.detail else ''}")
        lines += [f"  at {w.message(unit_of(self.op))}" for w in self.where[:12]]
        if len(self.where) > 12:
            lines.append(f"  ... and {len(self.where) - 12} more locations")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=_json_default, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        """Inverse of to_dict; extra keys a results line carries (nodeid, wall, ...) are ignored."""
        names = {f.name for f in fields(cls)}
        d = {k: x for k, x in d.items() if k in names}
        d["checks"] = [Check(**c) for c in d.get("checks", [])]
        d["where"] = [
            Where(**{**w, "tokens": tuple(w["tokens"]), "request_tokens": tuple(w["request_tokens"]),
                     "bytes": tuple(w["bytes"]) if w.get("bytes") else None})
            for w in d.get("where", [])
        ]
        return cls(**d)


def _json_default(o: Any) -> Any:
    if isinstance(o, float):
        return repr(o)
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def ranges(xs: Iterable[int], limit: int = 64, sep: str = ",") -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8' (first `limit` runs)."""
    xs = sorted(set(xs))
    if not xs:
        return "-"
    runs, start, prev = [], xs[0], xs[0]
    for x in xs[1:]:
        if x != prev + 1:
            runs.append((start, prev))
            start = x
        prev = x
    runs.append((start, prev))
    s = sep.join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit])
    return s + (f",... ({len(xs)} total)" if len(runs) > limit else "")
