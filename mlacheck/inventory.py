"""What this machine offers mlacheck: each backend (usable or why not, its version), the
matrices and their case counts, the platform (torch build, GPUs).

`mlacheck list` prints it for people; `mlacheck list --json` prints the same facts as one JSON
document, which is what CI scripts read (ci/mlacheck_ci.py plan): never the human text, whose
layout a library's import-time log lines can break (issue 27: AITER's `[aiter] Triton ops
only: ...` line ended the old parse, and the GPU gate ran the reference alone).
"""

from __future__ import annotations

import contextlib
import os
import platform as _platform
from dataclasses import asdict, dataclass, field
from typing import Any

from mlacheck.processes import slow_exit_kept

# Version of the JSON layout (`mlacheck_list` key); readers accept this and older.
SCHEMA = 1
SCHEMA_KEY = "mlacheck_list"


@dataclass(frozen=True)
class BackendStatus:
    """One backend as `mlacheck list` reports it."""

    name: str
    usable: bool
    reason: str | None = None  # why not usable (None when usable)
    version: str | None = None  # what the backend says it runs (library and version)
    source: str = "builtin"  # builtin | entry point | fault
    capabilities: dict[str, str] = field(default_factory=dict)  # op -> what it restricts


def backend_status(name: str, source: str = "builtin") -> BackendStatus:
    """Resolve `name` and ask it whether it is usable here; anything that goes wrong on the
    way (an import error, a factory or probe that raises) is the reason it is not."""
    from mlacheck.backends.registry import BackendError, resolve

    try:
        b = resolve(name)
    except BackendError as e:
        return BackendStatus(name, False, str(e), source=source)
    return status_of(b, name, source)


def status_of(b: Any, name: str, source: str = "builtin") -> BackendStatus:
    """A resolved backend's status: usable, or why not (a probe that raises is a reason)."""
    try:
        why = b.unavailable()
    except Exception as e:  # noqa: BLE001 - a broken probe is a reason, not a crash of `list`
        why = f"unavailable() raised {type(e).__name__}: {e}"
    if why:
        return BackendStatus(name, False, str(why), source=source)
    version = getattr(b, "version", None)
    try:
        text = str(version()) if callable(version) else None
        caps = {op: describe_capability(cap) for op, cap in b.capabilities().items()}
    except Exception as e:  # noqa: BLE001
        return BackendStatus(name, False, f"probing its capabilities raised {type(e).__name__}: "
                                          f"{e}", source=source)
    return BackendStatus(name, True, None, text, source, caps)


@dataclass(frozen=True)
class RunCheck:
    """What a run must know of its backends and device before its first item, asked where
    they are imported: `names` (spec -> the name its verdicts record); `error`, the one line of
    the first backend that cannot be resolved, else of a device torch does not accept or see
    (`mlacheck run`: exit 2, as when found before pytest started); `unusable` (spec -> why
    not usable here: exit 6), asked only when there is no error."""

    names: dict[str, str] = field(default_factory=dict)
    error: str = ""
    unusable: dict[str, str] = field(default_factory=dict)


def check_run(specs: list[str], device: str | None = None) -> RunCheck:
    """The backends resolved in order (the first BackendError is the error, as
    mlacheck.session.RunRequest.resolved meets it), then the device (when given:
    mlacheck.preflight.resolve_device), then each backend's usability (as `mlacheck list`)."""
    from mlacheck.backends.registry import BackendError, resolve
    from mlacheck.preflight import PreflightError, resolve_device

    backends: dict[str, Any] = {}
    for spec in specs:
        try:
            backends[spec] = resolve(spec)
        except BackendError as e:
            return RunCheck({s: b.name for s, b in backends.items()}, str(e))
    names = {s: str(b.name) for s, b in backends.items()}
    if device is not None:
        try:
            resolve_device(device)
        except PreflightError as e:
            return RunCheck(names, str(e))
    unusable = {}
    for spec, b in backends.items():
        status = status_of(b, spec)
        if not status.usable:
            unusable[spec] = status.reason or "not usable"
    return RunCheck(names, "", unusable)


class UsabilityProbe:
    """check_run in a separate process, started before a run's workers: importing the
    libraries is most of the time before the first worker starts (on one H100, 2026-11-27:
    torch 3.8 s, AITER 5.4 s of the CLI's 9.3 s), and the workers import them again anyway.
    `device`: also checked there (None: the caller checked it). `result()` waits for the
    answer; a probe that could not run or died answers in this process instead (the same
    function), so a broken probe never becomes a verdict."""

    def __init__(self, specs: list[str], device: str | None = None) -> None:
        import subprocess
        import sys
        import tempfile

        self.specs, self.device = list(specs), device
        self._answer: RunCheck | None = None
        fd, self._path = tempfile.mkstemp(prefix="mlacheck-usable-", suffix=".json")
        os.close(fd)
        code = ("import sys; from mlacheck.inventory import _probe_main; "
                "_probe_main(sys.argv[1], sys.argv[2] or None, sys.argv[3:])")
        # The environment as it is, not torch's PYTORCH_NVML_BASED_CUDA_CHECK=1 (its
        # is_available() answered 3.1 s sooner on 4x H200, 2026-11-27): torch then counts the
        # GPUs NVML / AMD SMI list (torch/cuda/__init__.py: is_available, _device_count_nvml,
        # _device_count_amdsmi), not those the runtime can use, which the workers check. A
        # driver older than torch's CUDA: the run started and ended in exit 6 on failed
        # collections, not exit 2; ROCm with HIP_VISIBLE_DEVICES="": no GPU (exit 2) where HIP
        # uses those CUDA_VISIBLE_DEVICES leaves (preflight._visible_ids).
        try:  # its output is the file: what a library prints on import is not read
            self._proc: Any = subprocess.Popen(
                [sys.executable, "-c", code, self._path, device or "", *self.specs],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:
            self._proc = None

    def result(self) -> RunCheck:
        if self._answer is None:
            self._answer = self._read()
        return self._answer

    def _read(self) -> RunCheck:
        import json

        try:
            if self._proc is not None and self._proc.wait() == 0:
                with open(self._path) as f:
                    doc = json.load(f)
                answer = RunCheck(**doc)
                if set(answer.names) | set(answer.unusable) <= set(self.specs) and all(
                        isinstance(v, str) for d in (answer.names, answer.unusable)
                        for v in d.values()) and isinstance(answer.error, str):
                    return answer
        except (OSError, ValueError, TypeError):
            pass
        finally:
            self.close()
        return check_run(self.specs, self.device)

    def close(self) -> None:
        """Stop the probe if it still runs (the run ended first) and remove its file."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for path in (self._path, f"{self._path}.part"):  # .part: a probe killed mid-write
            with contextlib.suppress(OSError):
                os.unlink(path)


def _probe_main(path: str, device: str | None, specs: list[str]) -> None:
    """The probe process: its answer written, it leaves without tearing down the libraries it
    imported (torch, AITER: 0.5-0.7 s between the answer and the process's end on a 4x H200
    host, 2026-11-27, which the first item waited for), unless the slow exit is kept
    (mlacheck.processes.SLOW_EXIT_ENV: a coverage tool writing at exit).

    When it checks a GPU device, it first starts its own cuInit in the background
    (cuda_context.init_driver), before it imports torch and the backends, ~1.5 s before the
    workers exist. Torch's runtime still answers the check, as in the workers, but it then
    finds the driver initialised. Made there, among 32 workers' contexts, the check took
    2.3-3.1 s on 4x H200 (MLA_TRACE patch, 2026-11-27); a lone cuInit takes 0.2-0.3 s."""
    if device is not None and device != "cpu":
        from mlacheck import cuda_context

        cuda_context.init_driver()
    _write_check(path, device, specs)
    if not slow_exit_kept():
        os._exit(0)


def _write_check(path: str, device: str | None, specs: list[str]) -> None:
    import json

    answer = check_run(specs, device)
    tmp = f"{path}.part"
    with open(tmp, "w") as f:
        json.dump(asdict(answer), f)
    os.replace(tmp, path)


def backend_statuses(faults: bool = False) -> list[BackendStatus]:
    """Every backend known here (built-ins, entry points; planted faults when `faults`)."""
    from mlacheck.backends.faults import PREFIX
    from mlacheck.backends.registry import BUILTIN, available_names

    out = []
    for name in available_names():
        fault = name.startswith(PREFIX)
        if fault and not faults:
            continue
        source = "fault" if fault else "builtin" if name in BUILTIN else "entry point"
        out.append(backend_status(name, source))
    return out


def fault_count() -> int:
    from mlacheck.backends.faults import PREFIX
    from mlacheck.backends.registry import available_names

    return sum(n.startswith(PREFIX) for n in available_names())


def matrix_counts() -> dict[str, int]:
    from mlacheck.matrices import load, names

    return {m: len(load(m).cases) for m in names()}


def platform_facts() -> dict[str, Any]:
    """The torch build and the GPUs it sees (HIP/CUDA_VISIBLE_DEVICES respected)."""
    import torch

    import mlacheck

    build = "rocm" if getattr(torch.version, "hip", None) else "cuda" if torch.version.cuda else "cpu"
    gpus = torch.cuda.device_count() if build != "cpu" and torch.cuda.is_available() else 0
    return {"mlacheck": mlacheck.__version__, "python": _platform.python_version(),
            "torch": torch.__version__, "torch_build": build, "gpus": gpus,
            "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)]}


def listing(backends: list[str] | None = None) -> dict[str, Any]:
    """The whole inventory as one JSON-ready document; with `backends`, only those backends
    and no matrices (what a CI job checks before it runs: seconds, not the ~4 s of expanding
    every matrix)."""
    if backends:
        return {SCHEMA_KEY: SCHEMA, "platform": platform_facts(),
                "backends": [asdict(backend_status(b)) for b in backends]}
    return {SCHEMA_KEY: SCHEMA, "platform": platform_facts(),
            "backends": [asdict(s) for s in backend_statuses()],
            "faults": fault_count(),
            "matrices": [{"name": m, "cases": n} for m, n in matrix_counts().items()]}


def describe_capability(cap: object) -> str:
    """What a capability restricts: the fields that differ from an unrestricted one."""
    from dataclasses import fields

    from mlacheck.backends.base import Capability

    unrestricted = Capability()
    parts = []
    for f in fields(cap):  # type: ignore[arg-type]
        v = getattr(cap, f.name)
        if f.name == "notes" or v is None or v == "" or (
                hasattr(unrestricted, f.name) and v == getattr(unrestricted, f.name)) or (
                isinstance(v, list | tuple | set | frozenset) and not v):
            continue
        parts.append(f"{f.name}={describe_value(v)}")
    return " ".join(parts) or "any case"


def describe_value(v: object) -> str:
    """A capability value for people: strings as they are, numbers in numeric order, rules
    by their name, pairs as q/kv."""
    if isinstance(v, str | bool | int | float) or v is None:
        return str(v)
    if callable(v):
        qual = getattr(v, "__qualname__", repr(v)).split(".<locals>")[0]
        return qual.strip("_").replace("_", " ")
    if isinstance(v, list | tuple | set | frozenset):
        items = sorted(v, key=lambda x: (not isinstance(x, int | float),
                                         x if isinstance(x, int | float) else str(x)))
        return "{" + ", ".join(f"{x[0]}/{x[1]}" if _is_pair(x) else describe_value(x)
                               for x in items) + "}"
    return str(v)


def _is_pair(x: object) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and all(isinstance(y, str) for y in x)
