"""Several workers on one GPU: a case starts only when the memory it needs is not promised to
another worker's running case.

Seen on the H100 (FlashInfer nightly, 8 xdist workers on one GPU): each worker checked the
free memory, found room, and then four of them ran out while building inputs or references
because the others had started large cases in the meantime; with torch's caching allocator a
worker also keeps what its last case freed. Both are the suite's problem, never the kernel's.

So each GPU case reserves its estimated footprint in a small ledger shared by the workers of
the machine (a JSON file under an exclusive `flock`): it starts when the reservations of the
live workers plus its own fit in the device's memory, waits otherwise, and gives the
reservation and its cached blocks back when it ends. A case that would not fit an idle device
is not waited for: `footprint.does_not_fit` already made it a SKIP.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from mlacheck import footprint
from mlacheck.processes import process_alive
from mlacheck.spec import Case

# How long a case may wait for other workers' cases to finish before it gives up with a suite
# error (which `--resume` runs again). Half of `mlacheck run`'s default per-case timeout (900 s):
# a wait must end before pytest-timeout would call the item a hang (a CRASH).
WAIT_S = 450.0
POLL_S = 0.5


class NoRoomNow(RuntimeError):
    """Other workers' cases held the device's memory for longer than WAIT_S."""


def gpu_key(device: str) -> str:
    """The GPU behind `device` as every process names it (its UUID), whatever
    HIP/CUDA_VISIBLE_DEVICES numbered it in that process."""
    import torch

    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", index))


def budget_bytes(device: str) -> int:
    """What the cases on one GPU may reserve together: FIT_FRACTION of its memory."""
    import torch

    _, total = torch.cuda.mem_get_info(torch.device(device))
    return int(footprint.FIT_FRACTION * total)


def ledger_path(device: str) -> Path:
    return Path(tempfile.gettempdir()) / f"mlacheck-{os.getuid()}-gpu-{gpu_key(device)}.json"


@contextlib.contextmanager
def reserved(case: Case, device: str, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold a reservation of the case's footprint on `device` while the case runs."""
    if not device.startswith("cuda"):
        yield  # CPU workers: `mlacheck run` sizes the worker count by the free memory
        return
    import torch

    need = footprint.estimate(case).total
    budget = budget_bytes(device)
    path = ledger_path(device)
    deadline = time.monotonic() + wait_s
    while not _try_reserve(path, need, budget):
        if time.monotonic() > deadline:
            raise NoRoomNow(
                f"waited {wait_s:.0f} s for {footprint.gib(need)} of device memory that other "
                "workers' cases held (run again with --resume, or with fewer workers)")
        time.sleep(POLL_S)
    try:
        yield
    finally:
        torch.cuda.empty_cache()  # what this case freed goes back to the other workers
        _release(path)


def _try_reserve(path: Path, need: int, budget: int) -> bool:
    with _locked(path) as book:
        held = sum(n for pid, n in book.items() if pid != str(os.getpid()))
        # alone on the device, a case that does_not_fit let through always starts
        if held and held + need > budget:
            return False
        book[str(os.getpid())] = need
        return True


def others_hold_memory(device: str) -> bool:
    """Whether other live workers hold reservations on this GPU now."""
    if not device.startswith("cuda"):
        return False
    with _locked(ledger_path(device)) as book:
        return any(pid != str(os.getpid()) and n > 0 for pid, n in book.items())


def _release(path: Path) -> None:
    with _locked(path) as book:
        book.pop(str(os.getpid()), None)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[dict[str, int]]:
    """The ledger {pid: reserved bytes}, read and written under an exclusive lock; entries of
    processes that died (a worker killed mid-case) are dropped."""
    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            try:
                book = {k: int(v) for k, v in json.loads(f.read() or "{}").items()}
            except (ValueError, AttributeError):
                book = {}
            book = {pid: n for pid, n in book.items() if process_alive(int(pid))}
            yield book
            f.seek(0)
            f.truncate()
            f.write(json.dumps(book))
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)



# --------------------------------------------------------------------------- the scheduler's view

def publish_worker_gpu(folder: Path, worker: str, device: str) -> None:
    """An xdist worker says which GPU it runs on and its budget (a file in `folder`), so the
    controller's scheduler can hand each GPU only what fits it (mlacheck.scheduling)."""
    if not device.startswith("cuda"):
        return
    doc = {"gpu": gpu_key(device), "budget": budget_bytes(device)}
    tmp = folder / f".{worker}.json"
    tmp.write_text(json.dumps(doc))
    tmp.replace(folder / f"{worker}.json")


def worker_gpus(folder: Path) -> dict[str, tuple[str, int]]:
    """{worker id: (GPU key, budget bytes)} of the workers that published theirs."""
    out = {}
    for f in folder.glob("gw*.json"):
        try:
            doc = json.loads(f.read_text())
            out[f.stem] = (str(doc["gpu"]), int(doc["budget"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
