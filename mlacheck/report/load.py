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

from mlacheck.judge import CRASH, FAIL, Verdict


@dataclass
class Loaded:
    verdicts: list[Verdict] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)  # 1-based numbers of unparsable lines

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
    """All parsable verdicts of a results file, plus the numbers of the lines skipped."""
    out = Loaded()
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            v = parse_line(line)
            if v is None:
                out.bad_lines.append(n)
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


def known_failure(v: Verdict) -> str:
    """The documented known-failure reason of a verdict ('' for none or a plain Verdict)."""
    return v.known_failure


def is_known(v: Verdict) -> bool:
    """A FAIL/CRASH that is a documented finding: counted as KNOWN, still shown."""
    return bool(known_failure(v)) and v.status in (FAIL, CRASH)
