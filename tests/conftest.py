"""mlacheck's own test tiers (docs/ci.md "Test tiers").

The README command (`python3 -m pytest -q -n 2 tests`) runs the default tier. Tests marked
`slow` (the real 2 GiB / 4 GiB KV pools past 2^31 / 2^32 bytes, the full-size
`mlacheck selftest --quick`) are left out of it; each is covered there by a scale model of the
same mechanism (24-bit offsets: megabyte pools). `-m slow` runs the slow tier, any explicit
`-m` chooses for itself.

Deselected here, not by `addopts = -m "not slow"` in pyproject.toml: that file is also the ini
file of `mlacheck run` and `pytest tests/kernels` in a checkout, where `slow` marks nightly
matrix cases that must keep running.

Memory: two xdist workers (~0.8 GB each) leave ~1.2 GB of the default tier's 3 GB for what
their tests add. Tests marked `memory_heavy` (1-2 GB more: the 98305-token decode, the selftest)
hold a cross-worker file lock exclusively, those marked `memory_medium` (0.5-0.8 GB: an
`mlacheck run` subprocess with its own workers) hold it shared: a heavy test runs beside light
ones only. Each test's freed heap goes back to the OS when it ends (glibc `malloc_trim`), so a
worker does not carry one test's peak into the next.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

KERNELS = Path(__file__).parent / "kernels"  # the validation matrix: its markers are data
# A matrix item whose case is estimated above this (mlacheck.footprint) is memory_heavy.
HEAVY_CASE_BYTES = 1 << 30
_held: list[bool] = []  # this process holds the memory lock (its mode: exclusive or not)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "memory_heavy: needs 1-2 GB beside its worker; runs beside light tests "
                   "only (tests/conftest.py)")
    config.addinivalue_line(
        "markers", "memory_medium: needs 0.5-0.8 GB beside its worker; never beside a "
                   "memory_heavy test (tests/conftest.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the matrix items of large cases memory_heavy; leave the slow tier out unless the
    command line says which markers to run."""
    from mlacheck import footprint

    for item in items:
        param = getattr(item, "callspec", None) and item.callspec.params.get("mla_item")
        if param is not None and footprint.estimate(param.case).total > HEAVY_CASE_BYTES:
            item.add_marker(pytest.mark.memory_heavy)
    if config.getoption("markexpr"):
        return
    slow = [i for i in items if i.get_closest_marker("slow") and not i.path.is_relative_to(KERNELS)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        dropped = set(slow)
        items[:] = [i for i in items if i not in dropped]


@pytest.fixture(scope="session")
def memory_lock(tmp_path_factory: pytest.TempPathFactory,
                testrun_uid: str) -> Callable[[bool], contextlib.AbstractContextManager[None]]:
    """`with memory_lock(exclusive):` across this run's xdist workers: exclusive for a heavy
    test, shared for a medium one."""
    path = tmp_path_factory.getbasetemp().parent / f"memory-{testrun_uid}.lock"

    @contextlib.contextmanager
    def held(exclusive: bool) -> Iterator[None]:
        if _held:  # re-entered in this process (flock would wait for itself)
            assert _held[0] or not exclusive, "a shared holder asked for the exclusive lock"
            yield
            return
        with open(path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            _held.append(exclusive)
            try:
                yield
            finally:
                _held.pop()
    return held


def _libc_trim() -> Callable[[int], int] | None:
    with contextlib.suppress(OSError, AttributeError, TypeError):
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim  # type: ignore[no-any-return]
    return None  # not glibc: nothing to give back this way


_TRIM = _libc_trim()


def _give_heap_back() -> None:
    """Return the freed heap to the OS (glibc keeps a test's peak otherwise)."""
    if _TRIM is not None:
        _TRIM(0)


@pytest.fixture(autouse=True)
def _memory_class(request: pytest.FixtureRequest) -> Iterator[None]:
    heavy = request.node.get_closest_marker("memory_heavy") is not None
    if heavy or request.node.get_closest_marker("memory_medium") is not None:
        with request.getfixturevalue("memory_lock")(heavy):
            yield
            _give_heap_back()
    else:
        yield
        _give_heap_back()
