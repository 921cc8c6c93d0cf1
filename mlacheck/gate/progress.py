"""Progress of a gate run that generates its answers in batches: questions done, accuracy so
far, elapsed time and ETA, one line at a time.

An end-to-end gate run over 500 questions takes minutes on a CPU and used to print nothing
until lm-eval's final table. A model that generates in batches (mlacheck.e2e.lm.MLACheckLM)
hands each finished batch here; the answers are scored with the task's own mirror of
lm-eval's filters and metric (GateTask.extract / exact_match, the strict role), so the
running accuracy is the one the record will hold for those questions.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlacheck.gate.task import STRICT, GateTask

# A line at least every this many seconds, and at every tenth of the questions, and at the end.
EVERY_S = 30.0
STEP = 0.10


@dataclass
class AnswerProgress:
    task: GateTask
    write: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr,
                                                                     flush=True))
    label: str = "gate"
    total: int = 0
    done: int = 0
    correct: int = 0
    started: float = field(default_factory=time.monotonic)
    _last_fraction: float = 0.0
    _last_time: float = field(default_factory=time.monotonic)

    def begin(self, total: int) -> None:
        """`total` questions are about to be answered (the clock starts now)."""
        self.total, self.done, self.correct = total, 0, 0
        self.started = self._last_time = time.monotonic()
        self._last_fraction = 0.0

    def answered(self, pairs: Iterable[tuple[Mapping[str, Any], str]]) -> str | None:
        """Score a finished batch of (document, generated text); the line, when one is due
        (it is also written)."""
        for doc, text in pairs:
            self.done += 1
            target = doc.get(self.task.answer_field) if isinstance(doc, Mapping) else None
            if isinstance(target, str) and self.task.exact_match(self.task.extract(text, STRICT),
                                                                 target):
                self.correct += 1
        now = time.monotonic()
        fraction = self.done / self.total if self.total else 1.0
        if not (fraction - self._last_fraction >= STEP - 1e-9 or self.done >= self.total
                or now - self._last_time >= EVERY_S):
            return None
        self._last_fraction, self._last_time = fraction, now
        line = self.line(now)
        self.write(line)
        return line

    def line(self, now: float | None = None) -> str:
        elapsed = (time.monotonic() if now is None else now) - self.started
        left = self.total - self.done
        eta = elapsed / self.done * left if self.done else float("nan")
        acc = f"{self.correct / self.done:.1%}" if self.done else "-"
        tail = "done" if not left else f"ETA {_duration(eta)}"
        share = f"{self.done / self.total:.0%}" if self.total else "-"
        return (f"{self.label}: {self.done}/{self.total} questions ({share}), "
                f"{self.task.name} {STRICT} {acc} so far ({self.correct} right), "
                f"{_duration(elapsed)} elapsed, {tail}")


def _duration(s: float) -> str:
    if s != s:  # NaN: nothing done yet
        return "?"
    s = int(round(s))
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"
