"""One test item per (matrix case, backend); parametrised by mlacheck.pytest_plugin."""

from __future__ import annotations

import pytest

from mlacheck.pytest_plugin import MatrixItem, check_item


def test_mla(mla_item: MatrixItem, mla_state, request: pytest.FixtureRequest) -> None:  # noqa: ANN001
    check_item(mla_item, mla_state, request.node)
