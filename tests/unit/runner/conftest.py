"""Fixtures of the run-command tests."""

from __future__ import annotations

import pytest


class _AllUsable:
    """`mlacheck run`'s usability probe, answered without a probe process."""

    resolves = False

    def resolved(self, request: object) -> None:
        pass

    def result(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass


@pytest.fixture
def backends_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests that stand in for pytest.main: no probe process is started (the stand-in
    never awaits one)."""
    from mlacheck import cli

    monkeypatch.setattr(cli, "_Usability", lambda request, resolves=False: _AllUsable())
