"""The import drawing has no upward arrow out of backends/ (issue 31): a backend stands on
the cases, inputs, pools and references below it, never on what runs, judges or reads it.

Arrows are read from the source (ast), lazy imports inside functions included: they are
dependencies all the same. The scanner is benchmarks/structure.py's, which draws the whole
graph.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# What runs, judges, decides or reads backends: above them, whatever it imports itself.
UPPER = ("mlacheck.harness", "mlacheck.judge", "mlacheck.localise", "mlacheck.probes",
         "mlacheck.heatmap", "mlacheck.known", "mlacheck.search", "mlacheck.session",
         "mlacheck.outcome", "mlacheck.results", "mlacheck.pytest_plugin",
         "mlacheck.scheduling", "mlacheck.cli", "mlacheck.selftest", "mlacheck.api",
         "mlacheck.inventory", "mlacheck.shard", "mlacheck.admission", "mlacheck.report",
         "mlacheck.tools", "mlacheck.gate", "mlacheck.e2e", "mlacheck.suite")


def _structure():  # noqa: ANN202 - benchmarks/structure.py, the one import scanner
    spec = importlib.util.spec_from_file_location("structure", ROOT / "benchmarks" / "structure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STRUCTURE = _structure()
_imports = STRUCTURE.imports


def _graph() -> dict[str, set[str]]:
    mods = STRUCTURE.modules(ROOT)
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _in_backends(m: str) -> bool:
    return m == "mlacheck.backends" or m.startswith("mlacheck.backends.")


def test_no_upward_arrow_out_of_backends() -> None:
    graph = _graph()
    # everything that imports backends/, directly or through others, is above it
    above, frontier = set(), {m for m in graph if _in_backends(m)}
    while frontier:
        frontier = {a for a, bs in graph.items() if bs & frontier and not _in_backends(a)} - above
        above |= frontier
    upward = sorted(f"{a} -> {b}" for a, bs in graph.items() if _in_backends(a) for b in bs
                    if not _in_backends(b) and (b in above or b.startswith(UPPER)))
    assert not upward, "backends/ must not import what is above it:\n" + "\n".join(upward)


def test_the_scanner_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """A test that cannot fail is a bug: the scanner finds an arrow hidden in a function."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from mlacheck.harness import run_case\n"
                   "from . import spec\n")
    known = {"mlacheck.harness", "mlacheck.spec", "mlacheck.backends.m"}
    assert _imports("mlacheck.backends.m", src, known) == {"mlacheck.harness"}
    graph = _graph()
    assert "mlacheck.harness" in graph["mlacheck.pytest_plugin"] | graph["mlacheck.cli"]
