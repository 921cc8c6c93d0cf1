"""Environment checks made before any case runs (the device, the GPUs and the output paths),
and what the run header records about the environment (software versions, the machine).

A bad device string, a GPU torch cannot see, or an output file that cannot be written is a
usage/environment error: one line, before the first case, never a CRASH charged to a kernel
or a traceback after an hour of running. `mlacheck run`/`replay` turn PreflightError into
exit code 2; the pytest plugin into pytest's usage error (exit 4).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

KNOWN_DEVICE_TYPES = ("cpu", "cuda")  # ROCm GPUs are "cuda" to torch


class PreflightError(ValueError):
    """One line saying what is wrong with the environment or the arguments."""


def resolve_device(spec: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; otherwise check the device exists."""
    import torch

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise PreflightError(f"unknown device {spec!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type not in KNOWN_DEVICE_TYPES:
        raise PreflightError(f"device {spec!r} is not supported: use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = ("a CPU-only build" if torch.version.cuda is None and torch.version.hip is None
                     else "a GPU build that sees no GPU")
            raise PreflightError(
                f"device {spec!r} requested but torch {torch.__version__} is {build} "
                "(torch.cuda.is_available() is False); use --device cpu or a GPU machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise PreflightError(f"device {spec!r}: only {torch.cuda.device_count()} GPU(s) visible")
    return spec


# cpu, cuda, cuda:N as torch.device parses them (no leading zeros: "cuda:01" is invalid there)
_EXPLICIT_DEVICE = re.compile(r"cpu|cuda(:(0|[1-9][0-9]*))?")


def is_explicit(spec: str) -> bool:
    """A device named outright (not auto, no spelling torch would have to judge): what remains
    to check of it (a GPU torch sees, its index) may be asked where torch is imported anyway,
    `mlacheck run`'s usability probe, and the run's controller need not import torch."""
    return _EXPLICIT_DEVICE.fullmatch(spec) is not None


def gpu_count() -> int:
    """GPUs this process may use, without initialising the CUDA/HIP context: the machine's
    (/sys/class/kfd, /proc/driver/nvidia), as many as the *_VISIBLE_DEVICES the runtime reads
    leave visible (_visible_ids). Counting the machine's alone put 32 workers (8 per GPU x 4)
    on the one GPU that CUDA_VISIBLE_DEVICES=0 left on a 4-GPU host: 45 inputs ran out of
    device memory."""
    override = os.environ.get("MLACHECK_NUM_GPUS")
    if override:
        return int(override)
    platform, total = _machine()
    ids = _visible_ids(platform)
    return total if ids is None else min(total, len(ids))


_VISIBLE_VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def _machine() -> tuple[str, int]:
    """("rocm" | "cuda" | "", GPUs): on ROCm the GPUs ROCR_VISIBLE_DEVICES leaves (HIP's
    indices count those)."""
    platform, n = _machine_gpus()
    rocr = os.environ.get("ROCR_VISIBLE_DEVICES")
    if platform == "rocm" and rocr is not None:
        n = min(n, _visible_count(rocr))
    return platform, n


def _visible_ids(platform: str) -> list[str] | None:
    """The device list the runtime numbers from (None: all of them), up to its first invalid
    entry. ROCm's HIP runtime reads HIP_VISIBLE_DEVICES when it is not empty, else
    CUDA_VISIBLE_DEVICES (rocclr: `HIP_VISIBLE_DEVICES[0] != '\\0' ? HIP_... : CUDA_...`);
    CUDA reads only CUDA_VISIBLE_DEVICES. Platform unknown: the narrower of the two."""
    hip, cuda = os.environ.get("HIP_VISIBLE_DEVICES"), os.environ.get("CUDA_VISIBLE_DEVICES")
    if platform == "rocm":
        value = hip or cuda or None
    elif platform == "cuda":
        value = cuda
    else:
        lists = [_entries(v) for v in (hip, cuda) if v is not None]
        return min(lists, key=len) if lists else None
    return None if value is None else _entries(value)


def _entries(value: str) -> list[str]:
    """A *_VISIBLE_DEVICES value's entries up to the first invalid one (the runtimes stop
    there; "" and "-1" hide every device)."""
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def _visible_count(value: str) -> int:
    return len(_entries(value))


def _machine_gpus() -> tuple[str, int]:
    """The machine's GPUs and their platform, from the drivers' files (no runtime)."""
    kfd = Path("/sys/class/kfd/kfd/topology/nodes")
    if kfd.is_dir():  # ROCm: nodes with a non-zero gfx target are GPUs
        n = 0
        for node in kfd.iterdir():
            props = node / "properties"
            if props.is_file() and re.search(r"gfx_target_version\s+[1-9]", props.read_text()):
                n += 1
        if n:
            return "rocm", n
    nv = Path("/proc/driver/nvidia/gpus")
    n = len(list(nv.iterdir())) if nv.is_dir() else 0
    return ("cuda", n) if n else ("", 0)


def check_expression(flag: str, expr: str | None) -> None:
    """A -k / -m expression pytest cannot parse, found before any worker starts: under xdist
    each worker fails on it and the controller ends in an INTERNALERROR."""
    if not expr:
        return
    from _pytest.mark.expression import Expression  # what pytest parses -k / -m with

    try:
        Expression.compile(expr)
    except Exception as e:  # SyntaxError (pytest 9), ParseError (older): a bad expression
        why = f"{e.msg} (column {e.offset})" if isinstance(e, SyntaxError) else str(e)
        raise PreflightError(f"{flag} {expr!r} is not a valid expression: {why}") from None


# pytest's own markers and xdist's, which an item may carry besides the matrix's (MARKERS)
_PYTEST_MARKERS = ("skip", "skipif", "xfail", "parametrize", "usefixtures", "filterwarnings",
                   "xdist_group")
# an -m identifier as pytest's scanner reads it (_pytest.mark.expression)
_IDENT = re.compile(r"(?:\w|:|\+|-|\.|\[|\]|\\|/)+")


def check_markers(expr: str | None) -> None:
    """Every marker an -m expression names is one a case can carry: `-m nosuchmarker` selected
    nothing and ended in exit 5 with no word that the marker does not exist."""
    if not expr:
        return
    from mlacheck.markers import KNOWN_MARKERS

    names = []
    for m in _IDENT.finditer(expr):
        before, after = expr[:m.start()].rstrip(), expr[m.end():].lstrip()
        if before.endswith("=") or after.startswith("="):  # mark(key=value): no marker name
            continue
        if m.group() not in ("and", "or", "not", "True", "False", "None"):
            names.append(m.group())
    unknown = [n for n in dict.fromkeys(names) if n not in KNOWN_MARKERS + _PYTEST_MARKERS]
    if unknown:
        raise PreflightError(f"-m {expr!r}: unknown marker(s) {', '.join(unknown)}; known: "
                             f"{', '.join(KNOWN_MARKERS)}")


def check_output_file(path: str | Path, what: str) -> Path:
    """The file can be created or appended to: its directory is made if missing."""
    p = Path(path)
    if p.is_dir():
        raise PreflightError(f"{what} {p} is a directory; give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PreflightError(f"cannot create the directory of {what} {p}: {e.strerror or e}") from None
    if not parent.is_dir():
        raise PreflightError(f"the directory of {what} {p} is not a directory")
    existed = p.exists()
    try:  # a real write probe: permission bits say nothing to root or on read-only mounts
        with open(p, "a"):
            pass
    except OSError as e:
        raise PreflightError(f"{what} {p} is not writable: {e.strerror or e}") from None
    if not existed:
        p.unlink()
    return p


# --------------------------------------------------------------------------- what ran


def software_versions() -> dict[str, str]:
    """mlacheck's version (and the checkout's commit when run from one), torch's and
    Python's, without importing torch (the xdist controller never does)."""
    import platform
    from importlib import metadata

    import mlacheck

    out = {"mlacheck": mlacheck.__version__}
    commit = _checkout_commit(Path(mlacheck.__file__).resolve().parent.parent)
    if commit:
        out["mlacheck"] += f" ({commit})"
    try:
        out["torch"] = metadata.version("torch")
    except metadata.PackageNotFoundError:
        out["torch"] = "not installed"
    out["python"] = platform.python_version()
    return out


def _checkout_commit(root: Path) -> str:
    """The short commit of the git checkout mlacheck is imported from ('' if none), with
    '+dirty' when its tracked files differ from that commit: a copied or edited tree must not
    be recorded as the commit it started from."""
    import subprocess

    if not (root / ".git").exists():
        return ""

    def git(*args: str) -> subprocess.CompletedProcess[str] | None:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=5, check=False)
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0:
        return ""
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = status is None or status.returncode != 0 or bool(status.stdout.strip())
    return head.stdout.strip() + ("+dirty" if dirty else "")


def describe_machine(device: str) -> dict[str, str]:
    """The host, its CPU and (on a GPU run) the GPU's model, read from /proc and /sys (no
    torch, no device context): what the report's header names."""
    import platform

    out = {"host": platform.node()}
    cpu = _first_value(Path("/proc/cpuinfo"), "model name")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out["cpu"] = f"{cpu or platform.machine()}, {cores} core(s)"
    if not device.startswith("cpu"):
        nv = Path("/proc/driver/nvidia/gpus")
        models = [_first_value(g / "information", "Model") for g in sorted(nv.iterdir())] \
            if nv.is_dir() else []
        if models:
            out["gpu"] = f"{len(models)} x {models[0]}"
    return out


def _first_value(path: Path, key: str) -> str:
    """The value of the first `key: value` line of a /proc-style file ('' if none)."""
    try:
        for line in path.read_text(errors="replace").splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key:
                return " ".join(value.split())
    except OSError:
        pass
    return ""
