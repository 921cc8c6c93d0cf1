"""Issue 27: a worker's CUDA context is made in the background while it imports torch."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pytest

from mlacheck import cuda_context, pytest_plugin


class FakeDriver:
    """libcuda's three calls, recorded with the thread that made them."""

    def __init__(self, fail_init: bool = False) -> None:
        self.calls: list[tuple[str, Any, str]] = []
        self.fail_init = fail_init

    def cuInit(self, flags: int) -> int:  # noqa: N802 (the driver's name)
        self.calls.append(("cuInit", flags, threading.current_thread().name))
        return 100 if self.fail_init else 0  # 100: CUDA_ERROR_NO_DEVICE

    def cuDeviceGet(self, device: Any, ordinal: int) -> int:  # noqa: N802
        self.calls.append(("cuDeviceGet", ordinal, threading.current_thread().name))
        device._obj.value = 7
        return 0

    def cuDevicePrimaryCtxRetain(self, context: Any, device: Any) -> int:  # noqa: N802
        self.calls.append(("cuDevicePrimaryCtxRetain", device.value, threading.current_thread().name))
        return 0


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(cuda_context, "_started", [])
    monkeypatch.setattr(cuda_context, "_driver_started", [])
    monkeypatch.delenv(cuda_context.NO_EARLY_CONTEXT_ENV, raising=False)
    monkeypatch.setattr(cuda_context.ctypes, "CDLL",
                        lambda name: fake if name == "libcuda.so.1" else ctypes.CDLL(name))
    return fake


def test_retains_the_first_visible_gpus_primary_context_in_a_daemon_thread(
        driver: FakeDriver) -> None:
    thread = cuda_context.start_primary_context()
    assert thread is not None and thread.daemon
    thread.join(5)
    assert [c[:2] for c in driver.calls] == [
        ("cuInit", 0), ("cuDeviceGet", 0), ("cuDevicePrimaryCtxRetain", 7)]
    assert {c[2] for c in driver.calls} == {"mlacheck-cuda-context"}  # not the importing thread
    assert cuda_context.start_primary_context() is thread  # one context per process
    assert len(driver.calls) == 3


def test_a_failing_driver_stops_quietly(monkeypatch: pytest.MonkeyPatch, driver: FakeDriver) -> None:
    driver.fail_init = True
    thread = cuda_context.start_primary_context()
    assert thread is not None
    thread.join(5)
    assert [c[0] for c in driver.calls] == ["cuInit"]  # torch makes the context itself later


def test_no_driver_or_the_knob_means_no_thread(monkeypatch: pytest.MonkeyPatch,
                                               driver: FakeDriver) -> None:
    monkeypatch.setenv(cuda_context.NO_EARLY_CONTEXT_ENV, "1")
    assert cuda_context.start_primary_context() is None
    monkeypatch.delenv(cuda_context.NO_EARLY_CONTEXT_ENV)

    def no_driver(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda_context.ctypes, "CDLL", no_driver)
    assert cuda_context.start_primary_context() is None
    assert driver.calls == []


@pytest.mark.parametrize(("gpu_run", "platform", "context"), [
    (True, "cuda", True), (False, "cuda", False), (True, "rocm", False)])
def test_worker_start_order(monkeypatch: pytest.MonkeyPatch, gpu_run: bool, platform: str,
                            context: bool) -> None:
    """The GPU variable before the context, the context before torch's import; on a CPU run
    or on ROCm no context is made early."""
    order: list[str] = []
    monkeypatch.setattr(pytest_plugin, "_map_worker_to_device", lambda i: order.append(f"gpu {i}"))
    monkeypatch.setattr(cuda_context, "start_primary_context", lambda: order.append("context"))
    monkeypatch.setattr(pytest_plugin, "_share_cpu_threads", lambda n: order.append(f"torch {n}"))
    monkeypatch.setattr("mlacheck.preflight._machine", lambda: (platform, 4))
    info = {"workerid": "gw5", "workercount": 8, **({pytest_plugin._GPU_DIR: "/tmp/g"} if gpu_run else {})}
    pytest_plugin._start_worker(info)
    assert order == ["gpu 5", *(["context"] if context else []), "torch 8"]


@pytest.mark.parametrize("gpu_run", [True, False])
def test_worker_publishes_its_gpu_after_collecting_before_sending(
        monkeypatch: pytest.MonkeyPatch, gpu_run: bool) -> None:
    """A GPU run's worker publishes its GPU once collected (asking the GPU waits for its
    context: collecting does not), and before xdist's own hook sends the collection to the
    controller, whose scheduler reads it then; a CPU run's worker publishes nothing."""
    import pluggy
    from _pytest import hookspec

    order: list[str] = []
    monkeypatch.setattr(pytest_plugin, "_publish_gpu",
                        lambda state, folder, worker: order.append(f"publish {worker} {folder}"))

    class XdistWorker:  # xdist.remote.WorkerInteractor's hook, as it is declared there
        @pytest.hookimpl
        def pytest_collection_finish(self, session: object) -> None:
            order.append("send collection")

    class Config:
        workerinput = {"workerid": "gw3", **({pytest_plugin._GPU_DIR: "/tmp/g"} if gpu_run else {})}
        stash = {pytest_plugin._STATE: object()}

    class Session:
        config = Config()

    pm = pluggy.PluginManager("pytest")
    pm.add_hookspecs(hookspec)
    pm.register(pytest_plugin, "mlacheck")
    pm.register(XdistWorker(), "xdist-worker")  # registered later: called first unless tryfirst
    pm.hook.pytest_collection_finish(session=Session())
    assert order == [*(["publish gw3 /tmp/g"] if gpu_run else []), "send collection"]


def test_the_run_initialises_the_driver_alone_in_a_daemon_thread(driver: FakeDriver,
                                                                  monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """`mlacheck run`'s own process: cuInit only (no context, so no GPU memory), once, and
    waited for at exit (a run that ends at once does not exit beside it); the knob and a
    machine without the driver start nothing."""
    at_exit: list[tuple[Any, tuple[Any, ...]]] = []
    monkeypatch.setattr(cuda_context.atexit, "register", lambda f, *a: at_exit.append((f, a)))
    thread = cuda_context.init_driver()
    assert thread is not None and thread.daemon
    thread.join(5)
    assert driver.calls == [("cuInit", 0, "mlacheck-cuda-init")]
    assert at_exit == [(thread.join, (cuda_context.INIT_WAIT_AT_EXIT_S,))]
    assert cuda_context.init_driver() is thread and len(driver.calls) == 1
    monkeypatch.setattr(cuda_context, "_driver_started", [])
    monkeypatch.setenv(cuda_context.NO_EARLY_CONTEXT_ENV, "1")
    assert cuda_context.init_driver() is None


@pytest.mark.parametrize(("device", "initialised"), [("cuda", True), ("auto", True),
                                                     ("cuda:1", True), ("cpu", False)])
def test_mlacheck_run_wakes_the_driver_first_on_a_gpu_run(
        monkeypatch: pytest.MonkeyPatch, device: str, initialised: bool) -> None:
    """Before anything else of the run (here a -k expression that is a usage error, found
    next): on a CPU run the driver is left alone."""
    from mlacheck import cli

    woken: list[bool] = []
    monkeypatch.setattr(cuda_context, "init_driver", lambda: woken.append(True))
    assert cli.main(["run", "--device", device, "-k", "(("]) == 2
    assert woken == ([True] if initialised else [])
