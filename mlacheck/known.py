"""Known failures: real kernel discrepancies that are documented findings, not suite bugs.

They stay visible (reported as KNOWN with their reason, pytest xfail), never hidden by a
loosened tolerance. Data: mlacheck/known_failures.yaml (backend -> case id -> reason).
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

KNOWN_FAILURES_FILE = Path(__file__).with_name("known_failures.yaml")


@functools.cache
def _table() -> dict[str, dict[str, str]]:
    if not KNOWN_FAILURES_FILE.exists():
        return {}
    data = yaml.safe_load(KNOWN_FAILURES_FILE.read_text()) or {}
    return {str(b): {str(c): str(r) for c, r in (cases or {}).items()} for b, cases in data.items()}


def lookup(backend: str, case_id: str) -> str | None:
    return _table().get(backend, {}).get(case_id)
