"""Shared machinery of the fault-injected backends.

Two shapes of fault:

- wrappers (`Wrapper`): a correct inner backend runs on a *rewritten* view of the case and
  its inputs (another page table, a pool read through wrapped offsets, an output window
  that runs past the real rows, ...) or its output is edited afterwards. The judge always
  sees the original case and inputs, so whatever the rewrite changes is what the bug
  changes;
- AITER adapter subclasses (`AdapterFault`): the real adapter of mlacheck.backends.aiter,
  pointed at the AITER model on CPU or at the installed AITER on a GPU, with one argument
  of one AITER call rewritten (`rewrite`) or one adapter decision overridden (head padding,
  metadata refills). Those reproduce an integration bug exactly where it happens: in the
  arguments a serving engine hands AITER.

Every fault declares the ops it acts on; its capabilities are the inner backend's restricted
to those ops, so a matrix run SKIPs (cheaply, with the reason) the cases it has nothing to
do with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mlacheck.backends.aiter import MODEL_MODULE, REAL_MODULE, AiterAdapter, AiterApi
from mlacheck.backends.base import Backend, Capability, Output
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs
from mlacheck.kvcache import GUARD_ROWS, Guarded, KVPool, PageTable
from mlacheck.spec import Case, Op

# Inner backends an AITER adapter fault can be built over: (api module, persistent, devices).
ADAPTER_INNERS: dict[str, tuple[str, bool, tuple[str, ...]]] = {
    "aiter-model": (MODEL_MODULE, True, ("cpu", "cuda")),
    "aiter-model-nonpersistent": (MODEL_MODULE, False, ("cpu", "cuda")),
    "aiter": (REAL_MODULE, True, ("cuda",)),
    "aiter-nonpersistent": (REAL_MODULE, False, ("cuda",)),
}


def restrict(caps: Mapping[str, Capability], ops: Collection[str]) -> dict[str, Capability]:
    return {op: c for op, c in caps.items() if op in ops}


def resolve_inner(name: str) -> Backend:
    from mlacheck.backends.registry import resolve  # lazy: the registry imports this package

    return resolve(name)


class Wrapper:
    """A correct backend with one planted bug, implemented around it (see module docstring)."""

    ops: tuple[str, ...] = ()

    def __init__(self, inner: Backend, name: str, ops: Collection[str] | None = None) -> None:
        self.inner = inner
        self.name = name
        if ops is not None:
            self.ops = tuple(ops)

    def unavailable(self) -> str | None:
        return self.inner.unavailable()

    def capabilities(self) -> dict[str, Capability]:
        return restrict(self.inner.capabilities(), self.ops)

    def run(self, case: Case, inputs: Inputs) -> Output:  # pragma: no cover - overridden
        raise NotImplementedError


class AdapterFault(AiterAdapter):
    """The AITER adapter with one argument of one AITER call rewritten (see `rewrite`)."""

    fault_ops: tuple[str, ...] = (Op.DECODE, Op.SPARSE_DECODE)

    def capabilities(self) -> dict[str, Capability]:
        return restrict(super().capabilities(), self.fault_ops)

    def rewrite(self, qualname: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The planted bug: what the buggy integration passes instead of `kwargs`."""
        return kwargs

    def _call(self, api: AiterApi, qualname: str, **kwargs: Any) -> Any:
        return super()._call(api, qualname, **self.rewrite(qualname, dict(kwargs)))


def adapter(cls: type[AiterAdapter], name: str, inner: str = "aiter-model") -> AiterAdapter:
    """An AdapterFault (or any adapter subclass) over one of ADAPTER_INNERS."""
    try:
        module, persistent, devices = ADAPTER_INNERS[inner]
    except KeyError:
        raise ValueError(f"{name}: an AITER adapter fault wraps one of "
                         f"{', '.join(ADAPTER_INNERS)}, not {inner!r}") from None
    return cls(module, persistent=persistent, name=name, devices=devices)


def torch_only(inner: str, fault: str) -> None:
    """Faults planted in the torch backend's own code (its mask, its merge, its splits)."""
    if inner != "torch":
        raise ValueError(f"fault {fault} is planted in the torch backend's code: it cannot wrap "
                         f"{inner!r}")


# --------------------------------------------------------------------------- rewrites


@dataclass
class RowWindow(Guarded):
    """A window of a guarded buffer's rows as a kernel's output view: `start` and `rows` count
    rows of `full`, so the window may run into the guard rows (or start inside the output)."""

    start: int = GUARD_ROWS
    rows: int = 0

    @property
    def out(self) -> torch.Tensor:
        return self.full[self.start : self.start + self.rows]


def output_window(out: Guarded, first: int, rows: int) -> RowWindow:
    """Rows first .. first + rows - 1 of the output (negative / past the end: guard rows)."""
    return RowWindow(out.full, GUARD_ROWS + first, rows)


def with_table(pool: KVPool, table: PageTable, data: torch.Tensor | None = None) -> KVPool:
    """The same pool memory (or `data`) read through another page table."""
    return KVPool(pool.data if data is None else data, pool.fmt, pool.scale, table, pool.layout,
                  pool.kind)


def replace_inputs(inputs: Inputs, **changes: Any) -> Inputs:
    """A shallow copy with some fields replaced: tensors the fault does not touch are shared,
    so what the inner backend writes into `out` lands in the buffer the judge reads."""
    assert isinstance(inputs, DecodeInputs | PrefillInputs)
    return dataclasses.replace(inputs, **changes)


def case_generator(case: Case, salt: int) -> torch.Generator:
    """A generator seeded by the case (what a fault picks is reproducible from the case id)."""
    return torch.Generator().manual_seed((case.seed_material + salt) % (1 << 63))
