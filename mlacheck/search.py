"""The search for a backend's smallest failing case: Hypothesis over mlacheck.strategies,
each example run through the harness (so it sits above both).

`find_failing_case(backend, strategy)` searches (derandomized, no example database, so CI
runs are reproducible) and returns the shrunk case with its verdict; `smallest` is the same
search over any predicate (the selftest's per-fault search adds budgets and priming to it).
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, Phase, Verbosity, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from mlacheck.backends.base import Backend
from mlacheck.harness import RunOptions, run_case
from mlacheck.spec import Case
from mlacheck.verdict import Verdict


def smallest(strategy: st.SearchStrategy[Case], fails: Callable[[Case], bool],
             max_examples: int) -> Case | None:
    """The simplest case from `strategy` that `fails` (shrunk), or None within `max_examples`.
    Deterministic: derandomized, without an example database or a deadline."""
    search = settings(max_examples=max_examples, derandomize=True, database=None,
                      deadline=None, verbosity=Verbosity.quiet,
                      phases=(Phase.generate, Phase.shrink),
                      suppress_health_check=list(HealthCheck))
    try:
        return find(strategy, fails, settings=search)
    except NoSuchExample:
        return None


def find_failing_case(
    backend: Backend,
    strategy: st.SearchStrategy[Case],
    max_examples: int = 200,
    device: str = "cpu",
) -> tuple[Case, Verdict] | None:
    """The simplest case from `strategy` that `backend` FAILs or CRASHes on, and its verdict.

    None when no failure turns up in `max_examples` examples. A SKIP (unsupported case) is
    not a failure. A DeviceError (poisoned device context) propagates: the search cannot go
    on on that device.
    """
    failing: dict[str, Verdict] = {}
    opts = RunOptions(device=device)

    def fails(case: Case) -> bool:
        v = run_case(case, backend, opts)
        if v.kernel_failed:
            failing[case.id] = v
            return True
        return False

    case = smallest(strategy, fails, max_examples)
    return None if case is None else (case, failing[case.id])
