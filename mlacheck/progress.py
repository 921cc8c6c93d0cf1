"""Progress of a long run: items done per backend x op and a running FAIL count.

pytest's own dots say nothing about which backend or op a nightly is on, nor whether it has
failed yet. The plugin feeds every finished item here and prints the line this returns:
at most every PROGRESS_STEP of the items or PROGRESS_SECONDS, so a CI log gets about ten
lines for a whole run and a terminal sees it move.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

PROGRESS_STEP = 0.10  # a line each 10% of the items
PROGRESS_SECONDS = 60.0  # and at least once a minute on long runs
STEP_SLACK = 1e-9  # float rounding: 3/20 - 2/20 is a hair under 0.1, and is a step


@dataclass
class Progress:
    totals: Counter[tuple[str, str]]  # (backend, op) -> items planned
    done: Counter[tuple[str, str]] = field(default_factory=Counter)
    # passed / failed / crashed / error / skipped / known (a CRASH is counted apart from a
    # FAIL: a refused or aborted call is another finding than a wrong number)
    outcomes: Counter[str] = field(default_factory=Counter)
    # time.monotonic() at the session's start (the plugin passes it): the elapsed seconds of
    # a progress line are on the clock pytest's duration and the report's wall time use
    started: float = field(default_factory=time.monotonic)
    _last_fraction: float = 0.0
    _last_time: float = field(default_factory=time.monotonic)

    @property
    def total(self) -> int:
        return sum(self.totals.values())

    def record(self, backend: str, op: str, outcome: str) -> str | None:
        """Count one finished item; the progress line when one is due."""
        self.done[(backend, op)] += 1
        self.outcomes[outcome] += 1
        n, total = sum(self.done.values()), self.total
        now = time.monotonic()
        fraction = n / total if total else 1.0
        due = (fraction - self._last_fraction >= PROGRESS_STEP - STEP_SLACK or n == total
               or now - self._last_time >= PROGRESS_SECONDS)
        if not due:
            return None
        self._last_fraction, self._last_time = fraction, now
        return self.line()

    def line(self) -> str:
        n, total = sum(self.done.values()), self.total
        o = self.outcomes
        open_groups = [f"{b} {op} {self.done[(b, op)]}/{t}" for (b, op), t in self.totals.items()
                       if 0 < self.done[(b, op)] < t]
        busy = f"; in progress: {', '.join(open_groups[:4])}" if open_groups else ""
        errors = f", ERROR {o['error']}" if o["error"] else ""  # mlacheck's own, rare
        return (f"mlacheck: {n}/{total} items ({n / max(1, total):.0%}, "
                f"{time.monotonic() - self.started:.0f} s): FAIL {o['failed']}, "
                f"CRASH {o['crashed']}{errors}, KNOWN {o['known']}, SKIP {o['skipped']}, "
                f"PASS {o['passed']}{busy}")
