"""Issue 27: a run whose workers all finished does not wait xdist's 10 s for their processes
(on 4 GPUs, 32 workers' exits held the run 2.35 s after their last report)."""

from __future__ import annotations

import pytest

from mlacheck import processes, pytest_plugin


class NodeManager:
    EXIT_TIMEOUT = 10  # xdist.workermanage.NodeManager's


class DSession:
    def __init__(self) -> None:
        self.nodemanager = NodeManager()


class PluginManager:
    def __init__(self, dsession: DSession) -> None:
        self.dsession = dsession

    def get_plugin(self, name: str) -> DSession | None:
        return self.dsession if name == "dsession" else None


class Config:
    args = ["mlacheck/suite/test_mla.py"]  # an mlacheck matrix run

    def __init__(self, dsession: DSession) -> None:
        self.pluginmanager = PluginManager(dsession)


class Session:
    def __init__(self) -> None:
        self.dsession = DSession()
        self.config = Config(self.dsession)


@pytest.mark.parametrize(("exitstatus", "knob", "wait_s"), [
    (pytest.ExitCode.OK, None, pytest_plugin.WORKER_EXIT_WAIT_S),
    (pytest.ExitCode.TESTS_FAILED, None, pytest_plugin.WORKER_EXIT_WAIT_S),
    (pytest.ExitCode.INTERRUPTED, None, 10),  # workers may be mid-item: as xdist does
    (pytest.ExitCode.INTERNAL_ERROR, None, 10),
    (pytest.ExitCode.OK, "1", 10),  # the slow exit kept (a coverage tool writing at exit)
])
def test_the_wait_for_finished_workers_processes(monkeypatch: pytest.MonkeyPatch,
                                                 exitstatus: int, knob: str | None,
                                                 wait_s: float) -> None:
    if knob is None:
        monkeypatch.delenv(processes.SLOW_EXIT_ENV, raising=False)
    else:
        monkeypatch.setenv(processes.SLOW_EXIT_ENV, knob)
    session = Session()
    pytest_plugin._XdistHooks.pytest_sessionfinish(session, exitstatus)  # type: ignore[arg-type]
    waited = session.dsession.nodemanager.EXIT_TIMEOUT
    assert waited == wait_s
    assert NodeManager.EXIT_TIMEOUT == 10  # the instance's, not xdist's class default


def test_it_runs_before_xdist_tears_its_workers_down() -> None:
    """xdist's DSession.pytest_sessionfinish waits for the workers with EXIT_TIMEOUT: the
    shorter wait is set before it (tryfirst), and it is the one xdist reads."""
    import inspect

    from xdist.workermanage import NodeManager as XdistNodeManager

    impl = pytest_plugin._XdistHooks.pytest_sessionfinish
    assert impl.pytest_impl["tryfirst"]  # type: ignore[attr-defined]
    assert "self.EXIT_TIMEOUT" in inspect.getsource(XdistNodeManager.teardown_nodes)
