"""Finding backends by name: built-ins, `pkg.module:factory` import paths, and the
`mlacheck.backends` entry-point group (a third-party package registers `name = pkg.mod:factory`).

A factory is a callable returning a Backend; it is called with no arguments.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names and their lookup need no torch (`mlacheck run` reads them first)
    from mlacheck.backends.base import Backend

ENTRY_POINT_GROUP = "mlacheck.backends"

# name -> "module:factory" (imported lazily: optional dependencies stay optional)
BUILTIN: dict[str, str] = {
    "torch": "mlacheck.backends.torch_ref:factory",
    "torch-split": "mlacheck.backends.torch_ref:split_factory",
    "torch-reverse": "mlacheck.backends.torch_ref:reverse_factory",
    "torch-lazy": "mlacheck.backends.torch_ref:lazy_factory",
    "torch-normalised": "mlacheck.backends.torch_ref:normalised_factory",
    "aiter": "mlacheck.backends.aiter:factory",
    "aiter-nonpersistent": "mlacheck.backends.aiter:nonpersistent_factory",
    "aiter-model": "mlacheck.backends.aiter:model_factory",
    "aiter-model-nonpersistent": "mlacheck.backends.aiter:model_nonpersistent_factory",
    "aiter-model-gfx942": "mlacheck.backends.aiter:model_gfx942_factory",
    "aiter-model-gfx950": "mlacheck.backends.aiter:model_gfx950_factory",
    "aiter-triton": "mlacheck.backends.aiter_triton:factory",
    "flashinfer": "mlacheck.backends.flashinfer:factory",
    "flashinfer-fa3": "mlacheck.backends.flashinfer:fa3_factory",
    "flashmla": "mlacheck.backends.flashmla:factory",
    "deepgemm": "mlacheck.backends.deepgemm:factory",
    "deepgemm-flashmla": "mlacheck.backends.deepgemm:pipeline_factory",
}

# Used by `mlacheck run` when no backend is named: runs everywhere, CPU included. The AITER
# model on both chips: gfx942 has no FP8 persistent prefill, gfx950 has it (and OCP fp8), so
# together they exercise every op of the smoke matrix.
DEFAULT_BACKENDS: tuple[str, ...] = ("aiter-model-gfx942", "aiter-model-gfx950")


class BackendError(ValueError):
    """A backend name that cannot be resolved: one line, shown to the user as is."""


def available_names() -> list[str]:
    names = list(BUILTIN)
    names += [ep.name for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in BUILTIN]
    return names


def builtin_name(spec: str) -> str | None:
    """The name a built-in backend's verdicts record, known without importing it: its key in
    BUILTIN (tests/unit/runner/test_controller_start.py checks resolve(k).name == k); None
    for any other spec. What lets `mlacheck run` start its workers before torch is imported."""
    return spec if spec in BUILTIN else None


def resolve(spec: str) -> Backend:
    """A backend from a built-in name, an entry-point name, or `pkg.mod:factory`."""
    target = BUILTIN.get(spec)
    if target is None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == spec:
                target = ep.value
                break
    if target is None and spec.startswith("fault:"):  # not an import path: a fault's name
        from mlacheck.backends.faults import FAULTS

        raise BackendError(f"unknown fault {spec!r}; known faults: {', '.join(FAULTS)} "
                           "(mlacheck list --faults)")
    if target is None and ":" in spec:
        target = spec
    if target is None:
        raise BackendError(
            f"unknown backend {spec!r}; known: {', '.join(available_names())} "
            "(or give an import path pkg.module:factory)"
        )
    factory = _load(target, spec)
    try:
        backend = factory()
    except Exception as e:
        raise BackendError(f"backend {spec!r}: factory {target} failed: {type(e).__name__}: {e}") from None
    for attr in ("name", "capabilities", "unavailable", "run"):
        if not hasattr(backend, attr):
            raise BackendError(f"backend {spec!r} ({target}) has no {attr!r}: see docs/backends.md")
    return backend


def _load(target: str, spec: str) -> Callable[[], Backend]:
    mod_name, _, attr = target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise BackendError(f"backend {spec!r}: cannot import {mod_name}: {e}") from None
    try:
        return getattr(mod, attr or "factory")
    except AttributeError:
        raise BackendError(f"backend {spec!r}: {mod_name} has no {attr or 'factory'!r}") from None


def _register_faults() -> None:
    """The fault catalogue (`fault:<name>`, mlacheck selftest): a data-only module, each
    fault imported when it is built."""
    BUILTIN.update(importlib.import_module("mlacheck.backends.faults").BUILTIN_NAMES)


_register_faults()
