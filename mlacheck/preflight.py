"""Environment checks made before any case runs: the device and the output paths.

A bad device string, a GPU torch cannot see, or an output file that cannot be written is a
usage/environment error: one line, before the first case, never a CRASH charged to a kernel
or a traceback after an hour of running. `mlacheck run`/`replay` turn PreflightError into
exit code 2; the pytest plugin into pytest's usage error (exit 4).
"""

from __future__ import annotations

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
