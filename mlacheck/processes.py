"""Process-level plumbing, standard library only (the CI scripts import it without torch):
whether another process is still running (entries that workers or servers leave in shared
files: the GPU memory ledger of `mlacheck.admission`, the CI script's server pid), and a
standard output that only a machine-readable document reaches (`mlacheck list --json`)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

# Set (to anything): mlacheck's own child processes (xdist workers, the usability probe) end
# the usual way, with the interpreter's teardown, instead of leaving once their work is sent,
# e.g. under a coverage tool that writes its data at exit.
SLOW_EXIT_ENV = "MLACHECK_SLOW_WORKER_EXIT"


def slow_exit_kept() -> bool:
    return bool(os.environ.get(SLOW_EXIT_ENV))


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


@contextlib.contextmanager
def machine_stdout() -> Iterator[TextIO]:
    """A stream on the real standard output for one machine-readable document; while it is
    open, file descriptor 1 (and sys.stdout) point at stderr, so whatever a library prints
    while it is imported or probed (Python prints, C printf, a subprocess) lands on stderr
    and cannot mix into the document. C stdio buffers are flushed before the descriptor is
    given back, so text a library left in them cannot follow the document either."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield out
    finally:
        sys.stdout.flush()
        _flush_c_stdio()
        os.dup2(real, 1)
        os.close(real)
        sys.stdout.write(out.getvalue())
        sys.stdout.flush()


def _flush_c_stdio() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask (not Linux/macOS)
        pass
