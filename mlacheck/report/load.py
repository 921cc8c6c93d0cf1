"""Reading a results file: JSON lines, one `Verdict.to_dict()` per line.

The file is appended to as each case finishes, so a run that died leaves a truncated last
line (possibly cut inside a UTF-8 character). Such lines are skipped and counted, never fatal:
a report of the cases that did finish is worth more than a traceback.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlacheck.results import RunHeader, latest_per_item, read_raw
from mlacheck.verdict import Verdict


@dataclass
class Loaded:
    verdicts: list[Verdict] = field(default_factory=list)  # one per (backend, case): the latest
    bad_lines: list[int] = field(default_factory=list)  # 1-based numbers of unparsable lines
    expected: int = 0  # items the run header(s) said would run (0: no header, unknown)
    missing: int = 0  # of those, the items without a verdict line
    superseded: int = 0  # verdict lines replaced by a later line for the same item
    headers: list[RunHeader] = field(default_factory=list)  # one per run over the file
    wall_s: float | None = None  # wall-clock time of the runs (None: the file does not say)

    @property
    def skipped(self) -> int:
        return len(self.bad_lines)


_DICT_FIELDS = ("metrics", "case", "timings")


def parse_line(line: str) -> Verdict | None:
    """One line -> a verdict, or None if it is not a complete, well-formed verdict."""
    try:
        d = json.loads(line)
    except ValueError:
        return None
    return _verdict(d)


def _verdict(d: object) -> Verdict | None:
    if not isinstance(d, dict) or not _well_formed(d):
        return None
    try:
        return Verdict.from_dict(d)
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def _well_formed(d: dict[str, Any]) -> bool:
    if not all(isinstance(d.get(k), str) for k in ("case_id", "backend", "op", "status")):
        return False
    if not all(isinstance(d.get(k, []), list) for k in ("checks", "where")):
        return False
    return all(isinstance(d.get(k, {}), dict) for k in _DICT_FIELDS)


def read_results(path: str | Path) -> Loaded:
    """The verdicts of a results file (the latest per backend x case: an `--append` of the
    same items counts once), the numbers of the lines skipped, and what the run expected."""
    raw = read_raw(path)
    out = Loaded(bad_lines=list(raw.bad_lines), expected=len(raw.expected),
                 missing=len(raw.missing), headers=list(raw.headers), wall_s=raw.wall_s)
    latest = latest_per_item(raw.records)
    out.superseded = len(raw.records) - len(latest)
    for d in latest:
        v = _verdict(d)
        if v is None:
            out.bad_lines.append(0)
        else:
            out.verdicts.append(v)
    return out


def load_results(path: str | Path) -> list[Verdict]:
    """Verdicts of a results file; unparsable lines are skipped with one warning."""
    loaded = read_results(path)
    if loaded.skipped:
        warnings.warn(skipped_message(path, loaded.bad_lines), stacklevel=2)
    return loaded.verdicts


def skipped_message(path: str | Path, bad_lines: list[int]) -> str:
    shown = ", ".join(map(str, bad_lines[:5])) + (", ..." if len(bad_lines) > 5 else "")
    return (
        f"{path}: skipped {len(bad_lines)} unparsable line(s) (line {shown}); "
        "a truncated last line means the run died"
    )

