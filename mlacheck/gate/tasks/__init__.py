"""The registry of gate tasks, in lm-eval's style: every registered task gets
``mlacheck gate <name> run|compare|promote``.

Built-in tasks are registered when this package is imported (one line each, below). Code
that brings its own task calls :func:`register_task` before :func:`mlacheck.gate.cli.main`
or the Python API; docs/gate.md says how to write one.
"""

from __future__ import annotations

from mlacheck.gate.errors import GateError
from mlacheck.gate.task import GateTask
from mlacheck.gate.tasks.gsm8k import GSM8K

# The task of a record or a Python call that names none: the gate ran only GSM8K before tasks
# were registered, and its records and API keep that meaning.
DEFAULT_TASK = GSM8K.name

_REGISTRY: dict[str, GateTask] = {}


def register_task(task: GateTask) -> GateTask:
    """Register ``task`` under its name and return it; another task of that name is refused
    (a name is what records and baselines are matched by)."""
    known = _REGISTRY.get(task.name)
    if known is not None and known is not task:
        raise ValueError(f"a different gate task named {task.name!r} is already registered")
    _REGISTRY[task.name] = task
    return task


def get_task(name: str) -> GateTask:
    """The registered task ``name``; a one-line GateError naming the registered ones if none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise GateError(
            f"unknown gate task {name!r}; registered: {', '.join(task_names())}"
        ) from None


def task_names() -> tuple[str, ...]:
    """Names of the registered tasks, in registration order."""
    return tuple(_REGISTRY)


register_task(GSM8K)
