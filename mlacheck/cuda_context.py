"""A worker's CUDA context, made in the background while the worker imports torch (issue 27).

On a 4-GPU host, 34 xdist workers starting at once each spent 5.6 s importing torch and then
8.7 s (median, 9.0 s max) making their CUDA context, one after another in the driver
(~0.27 s each whatever the GPU; 0.46 s for a lone process): `bash .dev/lead/startup.sh`,
4x H200, 2026-11-27, docs/gpu-results.md. The context made here through the driver API is
the device's primary context, the one torch's runtime retains at its first CUDA call, so the
driver's queue is waited in during the import instead of after it. ctypes releases the GIL
for the call, so the import goes on meanwhile.

CUDA only: libcuda is the driver that torch's runtime loads too. On ROCm a second HIP runtime
loaded next to torch's bundled one is not safe, so ROCm workers start as before.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
from collections.abc import Callable

# Set (to anything): workers make their context at their first CUDA call, as torch does by
# itself, and `mlacheck run` does not initialise the driver at its start (init_driver): to
# measure the difference, or where the driver API misbehaves.
NO_EARLY_CONTEXT_ENV = "MLACHECK_NO_EARLY_CUDA_CONTEXT"

_DRIVER = "libcuda.so.1"
_started: list[threading.Thread] = []
_driver_started: list[threading.Thread] = []


def start_primary_context() -> threading.Thread | None:
    """Retain the primary context of this process's first visible GPU in a daemon thread;
    None where there is no CUDA driver to ask (or the knob is set). Call after the process's
    CUDA_VISIBLE_DEVICES is final and before torch touches the device. Failure is silent:
    torch makes the context itself at its first call, as it would have anyway."""
    return _once_in_background(_started, _retain, "mlacheck-cuda-context")


def _once_in_background(started: list[threading.Thread], work: Callable[[ctypes.CDLL], object],
                        name: str) -> threading.Thread | None:
    """`work(driver)` in a daemon thread, once per process (`started` holds it); None where
    there is no CUDA driver to load or the knob is set."""
    if os.environ.get(NO_EARLY_CONTEXT_ENV):
        return None
    if started:
        return started[0]
    try:
        driver = ctypes.CDLL(_DRIVER)
    except OSError:
        return None
    thread = threading.Thread(target=work, args=(driver,), name=name, daemon=True)
    thread.start()
    started.append(thread)
    return thread


def _retain(driver: ctypes.CDLL) -> bool:
    """cuInit, then cuDevicePrimaryCtxRetain on device 0 (the one CUDA_VISIBLE_DEVICES left);
    the retain is kept for the process's life, as torch keeps its own."""
    device, context = ctypes.c_int(), ctypes.c_void_p()
    return (driver.cuInit(0) == 0
            and driver.cuDeviceGet(ctypes.byref(device), 0) == 0
            and driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0)


def init_driver() -> threading.Thread | None:
    """cuInit in a daemon thread of `mlacheck run`'s own process, at its start, before it
    imports anything heavy; None where there is no CUDA driver (or the knob is set).

    The first cuInit on the host is then made ~2 s before the workers exist instead of among
    them: on 4x H200 with 32 workers, their contexts were done 3.0-9.4 s into the run
    (median 9.35 s) against 11.2-11.7 s (median 11.42 s) without it (MLA_TRACE patch,
    2026-11-27). The process makes no context (no GPU memory) and keeps the driver open for
    the run. Failure is silent: each worker initialises the driver itself, as before."""
    first = not _driver_started
    thread = _once_in_background(_driver_started, lambda driver: driver.cuInit(0),
                                 "mlacheck-cuda-init")
    if thread is not None and first:
        # a run that ends at once (a usage error) does not leave the interpreter, and the
        # driver's own exit handlers, running beside a thread still inside cuInit
        atexit.register(thread.join, INIT_WAIT_AT_EXIT_S)
    return thread


# How long a process that started init_driver waits at exit for its cuInit to return: cuInit
# took 0.2-0.3 s alone and at most 3.4 s among 32 processes starting at once (ctxbench, 4x
# H200, 2026-11-27); past this the process exits regardless.
INIT_WAIT_AT_EXIT_S = 10.0
