"""Whether another process is still running: for entries that workers or servers leave in
shared files (the GPU memory ledger of `mlacheck.admission`, the CI script's server pid).
Standard library only, so the CI script can import it without torch."""

from __future__ import annotations

import os
from pathlib import Path


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
