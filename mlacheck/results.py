"""The results file: one JSON line per (case, backend) verdict, after a run header line.

Every run (`mlacheck run`, or pytest with `--mla-results`) first appends a header line
`{"mlacheck_results": SCHEMA, "run": {...}}` naming the items it means to run. That header
is how a reader knows a file is mlacheck's (`--resume` refuses any other file) and how a
report knows what was expected (an interrupted run reads INCOMPLETE, never all-pass).
Verdict lines are appended and flushed one by one by whichever process ran the item (one
`write` on an O_APPEND descriptor: atomic between xdist workers), so nothing is lost if a
run dies; a run that dies mid-write leaves a torn last line, which `repair_torn_tail` cuts.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlacheck.verdict import is_suite_error

# Version of the header's layout; a reader accepts this and older. 2: `expected` names each
# backend as its verdicts do (Backend.name); 1 named it as requested (a spec: `pkg.mod:factory`).
SCHEMA = 2
HEADER_KEY = "mlacheck_results"
WRITTEN_KEY = "written"  # a verdict line's time stamp (append_record)

ItemKey = tuple[str, str]  # (backend, case id)


class NotAResultsFile(ValueError):
    """A file that mlacheck did not write (no run header)."""


@dataclass(frozen=True)
class RunHeader:
    """What one invocation meant to run."""

    expected: tuple[ItemKey, ...]
    backends: tuple[str, ...] = ()
    matrix: str = ""
    device: str = ""
    started: float = 0.0
    schema: int = SCHEMA
    workers: int = 0  # processes that ran items (xdist workers, or 1); 0: not recorded
    shard: str = ""  # "K/N" when this invocation ran one shard (mlacheck.shard), else ""
    run_key: str = ""  # which split run the shard belongs to (mlacheck.shard.run_key)
    # What ran it, for the report's header: mlacheck's, torch's and Python's versions, the
    # host and the device's model name ({} in files written before they were recorded).
    software: dict[str, str] = field(default_factory=dict)
    machine: dict[str, str] = field(default_factory=dict)

    def to_line(self) -> str:
        run = {"expected": [list(k) for k in self.expected], "backends": list(self.backends),
               "matrix": self.matrix, "device": self.device, "started": self.started,
               "workers": self.workers, "software": self.software, "machine": self.machine}
        if self.shard:
            run.update(shard=self.shard, run_key=self.run_key)
        return json.dumps({HEADER_KEY: self.schema, "run": run}, sort_keys=True) + "\n"

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> RunHeader:
        run = d.get("run") or {}
        schema = d.get(HEADER_KEY)
        return cls(tuple((str(b), str(c)) for b, c in run.get("expected", [])),
                   tuple(run.get("backends", [])), str(run.get("matrix", "")),
                   str(run.get("device", "")), float(run.get("started", 0.0)),
                   schema if isinstance(schema, int) else 1, int(run.get("workers") or 0),
                   str(run.get("shard", "")), str(run.get("run_key", "")),
                   _strings(run.get("software")), _strings(run.get("machine")))


def _strings(d: object) -> dict[str, str]:
    return {str(k): str(v) for k, v in d.items()} if isinstance(d, dict) else {}


def new_header(expected: list[ItemKey], backends: list[str], matrix: str, device: str,
               workers: int = 0, shard: str = "", run_key: str = "",
               started: float | None = None) -> RunHeader:
    """`started`: when the run began (the session's start: the one clock that progress lines
    and the report's wall time count from); default now."""
    from mlacheck.preflight import describe_machine, software_versions

    return RunHeader(tuple(expected), tuple(backends), matrix, device,
                     time.time() if started is None else started, workers=workers,
                     shard=shard, run_key=run_key, software=software_versions(),
                     machine=describe_machine(device))


def is_header(d: object) -> bool:
    return isinstance(d, dict) and HEADER_KEY in d


def append_line(path: Path, line: str) -> None:
    """Append one line with a single write on an O_APPEND descriptor, then fsync."""
    data = line.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One verdict line, stamped with when it was written (`written`, seconds since the
    epoch): the report's wall time is the last stamp minus the run header's start."""
    stamped = {WRITTEN_KEY: round(time.time(), 3), **record}
    append_line(path, json.dumps(stamped, default=str, sort_keys=True) + "\n")


def repair_torn_tail(path: Path) -> int:
    """Cut a torn last line (a run killed mid-write); returns the bytes removed."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    with path.open("r+b") as f:
        f.truncate(keep)
    return len(data) - keep


@dataclass
class RawResults:
    """A results file split into run headers and verdict records (dicts), in file order."""

    headers: list[RunHeader] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)  # 1-based numbers of unparsable lines

    @property
    def expected(self) -> set[ItemKey]:
        """Every item some run over this file meant to run, keyed as verdicts key it:
        (backend name, case id). A schema-1 header named backends as requested; the verdict
        lines say which name each request ran under."""
        name_of = {str(r["backend_spec"]): str(r.get("backend", "")) for r in self.records
                   if r.get("backend_spec")}
        return {(b if h.schema >= 2 else name_of.get(b, b), c)
                for h in self.headers for b, c in h.expected}

    @property
    def missing(self) -> set[ItemKey]:
        """Expected items without a verdict line: a set difference, so lines for items no
        header named (another run's, a foreign line) cannot hide a missing one."""
        return self.expected - {item_key(r) for r in self.records}

    @property
    def written_by_mlacheck(self) -> bool:
        return bool(self.headers)

    @property
    def wall_s(self) -> float | None:
        """Wall-clock seconds the runs over this file took: per run header, from its start to
        the last verdict line written before the next run began, summed (a `--resume` adds
        its own span, not the pause between the runs). None when the file does not say
        (no header start, no stamped line: files of older mlacheck versions)."""
        starts = sorted(h.started for h in self.headers if h.started > 0)
        stamps = sorted(float(w) for r in self.records
                        if isinstance(w := r.get(WRITTEN_KEY), int | float))
        if not starts or not stamps:
            return None
        total, found = 0.0, False
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else float("inf")
            inside = [t for t in stamps if start <= t < end]
            if inside:
                total, found = total + inside[-1] - start, True
        return total if found else None


def check_same_run(path: Path, backends: tuple[str, ...] | list[str], matrix: str) -> None:
    """`--resume` continues the run the file's last header describes: another backend set or
    matrix would mix two runs' verdicts into one file (and its gate)."""
    if not path.exists():
        return
    headers = read_raw(path).headers
    if not headers:
        return
    last = headers[-1]
    theirs = [b for b in last.backends]
    if theirs and set(theirs) != set(backends):
        raise NotAResultsFile(
            f"--resume: {path} holds a run of backends {', '.join(theirs)}, not "
            f"{', '.join(backends)}; resume with the same backends or start a new results file")
    if last.matrix and matrix and last.matrix != matrix:
        raise NotAResultsFile(
            f"--resume: {path} holds a run of matrix {last.matrix}, not {matrix}; resume with "
            "the same matrix or start a new results file")


def read_raw(path: str | Path) -> RawResults:
    """Headers and records of a results file; lines that are not JSON objects are counted."""
    out = RawResults()
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                out.bad_lines.append(n)
                continue
            if is_header(d):
                out.headers.append(RunHeader.from_record(d))
            elif isinstance(d, dict) and isinstance(d.get("case_id"), str) and d["case_id"]:
                out.records.append(d)  # a JSON object without a case id is no verdict
            else:
                out.bad_lines.append(n)
    return out


def item_key(record: dict[str, Any]) -> ItemKey:
    return (str(record.get("backend", "")), str(record.get("case_id", "")))


def latest_per_item(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (backend, case): the last one written (an `--append` of the same items
    or a repeated backend must not count twice), in first-seen order."""
    last: dict[ItemKey, dict[str, Any]] = {}
    for r in records:
        key = item_key(r)
        last.pop(key, None)  # re-insert: order follows the latest write
        last[key] = r
    return list(last.values())


def recorded_items(path: Path | None) -> set[ItemKey]:
    """(backend as requested, case id) of every item the file has a verdict on the kernel
    for: the keys `--resume` leaves out (a backend given by import path is recorded under
    its name). An item whose latest line is a suite ERROR (out of device memory, a broken
    input build) has no verdict on the kernel, so `--resume` runs it again."""
    if path is None or not path.exists():
        return set()
    latest: dict[ItemKey, str] = {}
    for r in read_raw(path).records:
        key = (str(r.get("backend_spec") or r.get("backend", "")), str(r.get("case_id", "")))
        latest[key] = str(r.get("status", ""))
    return {key for key, status in latest.items() if not is_suite_error(status)}


def check_resumable(path: Path, option: str = "--resume") -> None:
    """`--resume` and `--append` continue only a file mlacheck wrote (one with a run header):
    another file's lines would be counted as items, or hide missing ones. An empty file has
    nothing to misread."""
    if not path.exists():
        return
    raw = read_raw(path)
    if not raw.written_by_mlacheck and (raw.records or raw.bad_lines):
        raise NotAResultsFile(
            f"{path} has no mlacheck run header: it was not written by `mlacheck run` (or by an "
            f"older mlacheck); refusing to {option} it (start a new results file)")
