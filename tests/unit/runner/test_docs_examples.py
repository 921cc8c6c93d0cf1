"""The examples in docs/backends.md run as written, through the public API only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import mlacheck.api as api

DOC = Path(__file__).resolve().parents[3] / "docs" / "backends.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def _imports_outside_api(code: str) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mlacheck"):
            if node.module != "mlacheck.api":
                bad.append(node.module)
        elif isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith("mlacheck")]
    return bad


def test_every_example_imports_only_the_public_api():
    blocks = _blocks()
    assert len(blocks) >= 2
    for code in blocks:
        assert _imports_outside_api(code) == []


def test_public_api_names_resolve_and_each_is_documented():
    assert len(api.__all__) == len(set(api.__all__))
    text = DOC.read_text()
    for name in api.__all__:
        assert hasattr(api, name), name
        assert f"`{name}" in text, f"{name} is public but docs/backends.md does not mention it"


@pytest.mark.memory_heavy  # the smoke matrix's 98305-token decode (tests/conftest.py)
@pytest.mark.timeout(600)
def test_backend_example_passes_smoke_decode_and_its_check_example_runs():
    backend_code, check_code = _blocks()[:2]
    scope: dict = {}
    exec(compile(backend_code, str(DOC), "exec"), scope)  # noqa: S102 - the doc's own code
    exec(compile(check_code, str(DOC), "exec"), scope)  # asserts PASS and no failing case
    assert scope["ran"], "the example backend ran no smoke decode case"


@pytest.mark.memory_heavy  # the smoke matrix's 98305-token decode (tests/conftest.py)
def test_the_check_example_catches_a_broken_example_backend():
    """The same check code must fail when the example backend is wrong (scale ignored)."""
    backend_code, check_code = _blocks()[:2]
    broken = backend_code.replace("* case.softmax_scale", "* 1.0")
    assert broken != backend_code
    scope: dict = {}
    exec(compile(broken, str(DOC), "exec"), scope)
    with pytest.raises(AssertionError):
        exec(compile(check_code, str(DOC), "exec"), scope)
