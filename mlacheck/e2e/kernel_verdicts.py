"""The kernel-level verdict on the e2e model's own attention calls.

An `MLARunner` observer that hands a sample of the calls the model makes (the first layer's
prefill and every layer's decode calls at a few steps, in every batch) to mlacheck's judge, exactly as a matrix case
is judged (mlacheck.harness.judge_output: exact and ideal golden, the same-precision
baseline, every check). Put beside a gate verdict, it says whether the kernel checks would
have caught, on the very cases the model ran, what the end-to-end gate did or did not see.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from mlacheck.backends.base import Backend, Output
from mlacheck.harness import RunOptions, judge_output
from mlacheck.inputs import Inputs
from mlacheck.spec import Case, PrefillCase
from mlacheck.verdict import ERROR, FAIL

# Decode steps (0 = the first token after the prompt) judged in every batch, all layers:
# early, middle and late in the answers (the longest are ~90 tokens).
DEFAULT_DECODE_STEPS = frozenset({0, 1, 3, 7, 15, 31, 47, 63})
# Prefill layers judged in every batch: the first only. A prefill of a whole batch is the
# dearest call to judge (golden and baseline over every prompt: on a CPU as long as the
# model's whole prefill), and a fault acts on every layer's call alike.
DEFAULT_PREFILL_LAYERS = frozenset({0})


@dataclass
class KernelVerdicts:
    """Observer: judges the prefill calls of `prefill_layers` and the decode calls of
    `decode_steps` (every layer) of each batch."""

    decode: Backend
    prefill: Backend
    layers: int  # the model's: each batch makes one prefill and one decode call per layer
    device: str = "cpu"
    decode_steps: frozenset[int] = DEFAULT_DECODE_STEPS
    prefill_layers: frozenset[int] = DEFAULT_PREFILL_LAYERS
    records: list[dict[str, Any]] = field(default_factory=list)
    _prefills: int = 0  # prefill calls so far (all batches)
    _decodes: int = 0  # decode calls of the current batch

    def __call__(self, case: Case, inputs: Inputs, output: Output) -> None:
        if isinstance(case, PrefillCase):
            layer = self._prefills % self.layers
            self._prefills += 1
            self._decodes = 0
            if layer in self.prefill_layers:
                self._judge(case, inputs, output, self.prefill, step=None)
            return
        step = self._decodes // self.layers
        self._decodes += 1
        if step in self.decode_steps:
            self._judge(case, inputs, output, self.decode, step=step)

    def _judge(self, case: Case, inputs: Inputs, output: Output, backend: Backend,
               step: int | None) -> None:
        units = case.units
        batch = (self._prefills - 1) // self.layers
        rec: dict[str, Any] = {"op": case.op, "batch": batch, "step": step,
                               "units": len(units)}
        try:
            v = judge_output(case, inputs, output, backend, RunOptions(device=self.device))
        except Exception as e:  # noqa: BLE001 - the suite's own failure, never the kernel's
            rec.update(status=ERROR, reason=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        else:
            rec.update(status=v.status, checks=[c.name for c in v.failed_checks],
                       reason=v.reason, known=v.known_rule)
        self.records.append(rec)

    def summary(self) -> dict[str, Any]:
        """Per op: calls judged, verdict counts, and how often each failed check fired."""
        out: dict[str, Any] = {}
        for op in sorted({r["op"] for r in self.records}):
            recs = [r for r in self.records if r["op"] == op]
            fired = collections.Counter(c for r in recs for c in r.get("checks", ()))
            out[op] = {
                "judged": len(recs),
                "status": dict(collections.Counter(r["status"] for r in recs)),
                "checks": dict(fired.most_common()),
            }
        return out

    @property
    def failed(self) -> int:
        return sum(r["status"] == FAIL for r in self.records)

    @property
    def errors(self) -> int:
        return sum(r["status"] == ERROR for r in self.records)
