"""mlacheck's own test tiers (docs/ci.md "Test tiers").

The README command (`python3 -m pytest -q -n 2 tests`) runs the default tier. Tests marked
`slow` (the real 2 GiB / 4 GiB KV pools past 2^31 / 2^32 bytes, the full-size
`mlacheck selftest --quick`) are left out of it; each is covered there by a scale model of the
same mechanism (24-bit offsets: megabyte pools). `-m slow` runs the slow tier, any explicit
`-m` chooses for itself.

Deselected here, not by `addopts = -m "not slow"` in pyproject.toml: that file is also the ini
file of `mlacheck run` and `pytest tests/kernels` in a checkout, where `slow` marks nightly
matrix cases that must keep running.

Memory: two xdist workers (0.4-0.6 GB each; the lm-eval users are one xdist group, so one
worker carries that stack) leave ~1.8 GB of the default tier's 3 GB for what their tests add. Tests marked `memory_heavy` (1-2 GB more: the 98305-token decode, the
selftest, premerge in one process) hold a cross-worker file lock exclusively and every other
test holds it shared, so a heavy test runs while the other worker waits (measured: beside a
light test, one still peaked at 3.06 GB of tree PSS). A turnstile lock in front makes a waiting
heavy test go next, and a test that turns heavy midway (the first user of the session's
selftest fixture) trades its shared hold for an exclusive one. Each test's freed heap goes
back to the OS when it ends (glibc `malloc_trim`), so a worker does not carry one test's peak
into the next.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

KERNELS = Path(__file__).parent / "kernels"  # the validation matrix: its markers are data
# Tests that run lm-eval, its datasets/pandas/pyarrow stack or the e2e model in their own
# process: one xdist group, so only one worker carries that stack (~0.15-0.27 GB measured,
# which neither gc nor malloc_trim gives back) and the other stays at its collection size.
LM_EVAL_USERS = tuple(Path(__file__).parent / d for d in ("e2e", "unit/e2e", "unit/gate"))
LM_EVAL_GROUP = "lm-eval"
# A matrix item whose case is estimated above this (mlacheck.footprint) is memory_heavy.
HEAVY_CASE_BYTES = 1 << 30
_held: list[bool] = []  # the modes (exclusive or not) this process holds the memory lock in
_lock_file: list[IO[str]] = []  # the open lock file while held


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "memory_heavy: needs 1-2 GB beside its worker; runs while the other "
                   "workers wait (tests/conftest.py)")
    if getattr(config.option, "dist", "no") == "load":  # `-n 2`: honour the xdist_group marks
        config.option.dist = "loadgroup"


# tryfirst: xdist's worker names grouped items by their xdist_group mark in this same hook
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the matrix items of large cases memory_heavy and the lm-eval users one xdist
    group; leave the slow tier out unless the command line says which markers to run."""
    from mlacheck import footprint

    for item in items:
        param = getattr(item, "callspec", None) and item.callspec.params.get("mla_item")
        if param is not None and footprint.estimate(param.case).total > HEAVY_CASE_BYTES:
            item.add_marker(pytest.mark.memory_heavy)
        if any(item.path.is_relative_to(d) for d in LM_EVAL_USERS):
            item.add_marker(pytest.mark.xdist_group(LM_EVAL_GROUP))
    if config.getoption("markexpr"):
        return
    slow = [i for i in items if i.get_closest_marker("slow") and not i.path.is_relative_to(KERNELS)]
    if slow:
        config.hook.pytest_deselected(items=slow)
        dropped = set(slow)
        items[:] = [i for i in items if i not in dropped]


@pytest.fixture(scope="session")
def memory_lock(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Callable[[bool], contextlib.AbstractContextManager[None]]:
    """`with memory_lock(exclusive):` across this run's xdist workers: exclusive for a heavy
    test, shared for every other one."""
    try:
        testrun_uid = request.getfixturevalue("testrun_uid")  # pytest-xdist's, one per run
    except pytest.FixtureLookupError:  # -p no:xdist: one process, its own lock
        testrun_uid = f"solo-{os.getpid()}"
    base = tmp_path_factory.getbasetemp().parent
    path, turnstile = base / f"memory-{testrun_uid}.lock", base / f"memory-{testrun_uid}.next"

    def take(lock: IO[str], exclusive: bool) -> None:
        # through the turnstile: a heavy test waiting for the lock holds it, so light tests
        # queue behind it instead of keeping a shared hold alive forever
        with open(turnstile, "w") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX)
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    @contextlib.contextmanager
    def held(exclusive: bool) -> Iterator[None]:
        if _held and (_held[-1] or not exclusive):  # already held in a mode that covers it
            _held.append(_held[-1])
            try:
                yield
            finally:
                _held.pop()
            return
        if _held:  # shared, now exclusive: trade the hold (flock converts; not atomically)
            lock = _lock_file[-1]
            fcntl.flock(lock, fcntl.LOCK_UN)
            take(lock, True)
            _held.append(True)
            try:
                yield
            finally:
                _held.pop()
                fcntl.flock(lock, fcntl.LOCK_SH)
            return
        with open(path, "w") as lock:
            take(lock, exclusive)
            _held.append(exclusive)
            _lock_file.append(lock)
            try:
                yield
            finally:
                _held.pop()
                _lock_file.pop()
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
    with request.getfixturevalue("memory_lock")(heavy):
        yield
        _give_heap_back()
