"""`mlacheck run` starts its workers before torch is imported where the backends are built-in
names and the device is named outright (issue 27: on a 4x H200 host torch's import was 4.4 s
of the controller's 6.5 s before the first worker started, and every worker started after
it). Resolving the backends and checking the device are then the usability probe's, awaited
before the first item: the same exit codes and lines as when they came first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mlacheck import cli, outcome
from mlacheck.backends.registry import BUILTIN, BackendError, resolve

ONE_CASE = """
name: one
description: one small decode case
groups:
  - name: decode
    kind: decode
    base: {requests: [[1, 70]], page_size: 16, num_heads: 16}
"""

# Runs cli.main and reports, as JSON on its last line, whether torch was imported in this
# (the controller's) process when pytest.main was called and when xdist spawned the workers.
STAMPED = """
import json, sys
import pytest
import xdist.workermanage as wm

seen = {}
main, setup = pytest.main, wm.NodeManager.setup_nodes
def stamped_main(argv, plugins):
    seen["pytest.main"] = "torch" in sys.modules
    seen["checked_by_caller"] = "--mla-checked-by-caller" in argv
    return main(argv, plugins=plugins) if sys.argv[1] == "real" else 0
def stamped_setup(self, *a, **k):
    seen["workers spawned"] = "torch" in sys.modules
    return setup(self, *a, **k)
pytest.main, wm.NodeManager.setup_nodes = stamped_main, stamped_setup
from mlacheck.cli import main as cli_main
code = cli_main(sys.argv[2:])
seen["code"] = code
print(json.dumps(seen))
"""


@pytest.fixture
def one(tmp_path: Path) -> Path:
    p = tmp_path / "one.yaml"
    p.write_text(ONE_CASE)
    return p


def _stamped(tmp_path: Path, mode: str, *args: str) -> tuple[dict[str, object], str]:
    script = tmp_path / "stamped.py"
    script.write_text(STAMPED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    r = subprocess.run([sys.executable, str(script), mode, "run", *args, "--results",
                        str(tmp_path / "r.jsonl"), "--no-report", "-n", "1"],
                       capture_output=True, text=True, timeout=300, env=env)
    lines = r.stdout.strip().splitlines()
    assert lines, r.stderr[-3000:]
    return json.loads(lines[-1]), r.stdout + r.stderr


def test_every_builtin_name_is_the_name_its_backend_records() -> None:
    """The controller takes a built-in name for the name its backend's verdicts record
    (registry.builtin_name) without building it: this keeps that true for every entry."""
    built = 0
    for name in BUILTIN:
        try:
            backend = resolve(name)
        except BackendError:  # not constructible here
            continue
        built += 1
        assert backend.name == name, f"BUILTIN[{name!r}] builds a backend named {backend.name!r}"
    assert built >= len([n for n in BUILTIN if n.startswith("torch")]), built


def test_the_controller_spawns_its_workers_without_torch(one: Path, tmp_path: Path) -> None:
    """A real run: neither when pytest starts nor when xdist spawns the workers has the
    controller imported torch (the expansion, the scheduler's estimates included); it has
    with --device auto, which needs torch to be known."""
    seen, out = _stamped(tmp_path, "real", "-b", "torch", "--device", "cpu", "--matrix", str(one))
    assert seen == {"pytest.main": False, "checked_by_caller": True, "workers spawned": False,
                    "code": outcome.EXIT_OK}, out[-3000:]
    seen, out = _stamped(tmp_path, "stub", "-b", "torch", "--device", "auto", "--matrix",
                         str(one))
    assert seen["pytest.main"] is True and seen["checked_by_caller"] is False, out[-3000:]


def test_a_device_torch_does_not_see_is_exit_2_with_its_line(one: Path, tmp_path: Path) -> None:
    """--device cuda:0 on a machine without one: the probe's check, before any item, gives
    the line and the code the check before pytest gave; an earlier results file is kept."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    from mlacheck.preflight import PreflightError, resolve_device

    with pytest.raises(PreflightError) as expected:
        resolve_device("cuda:0")
    res = tmp_path / "r.jsonl"
    res.write_text("an earlier run\n")
    seen, out = _stamped(tmp_path, "real", "-b", "torch", "--device", "cuda:0", "--matrix",
                         str(one))
    assert seen["code"] == outcome.EXIT_USAGE and seen["workers spawned"] is False, out[-3000:]
    assert f"mlacheck: error: {expected.value}\n" in out, out[-3000:]
    assert res.read_text() == "an earlier run\n"


def test_a_fault_that_does_not_exist_is_exit_2_before_pytest_and_torch(one: Path,
                                                                       tmp_path: Path) -> None:
    seen, out = _stamped(tmp_path, "stub", "-b", "fault:no-such-fault", "--device", "cpu",
                         "--matrix", str(one))
    assert seen == {"code": outcome.EXIT_USAGE}, out[-3000:]
    assert "mlacheck: error: unknown fault 'fault:no-such-fault'; known faults: " in out


def _in_process(monkeypatch: pytest.MonkeyPatch, one: Path, tmp_path: Path, device: str,
                backends: str, pytest_code: int | None = None) -> int:
    """`mlacheck run` here, its probe answered in this process (no interpreter to start it
    with), pytest.main a stand-in: it asks the gate before the first item as pytest's session
    does, or (`pytest_code`) stops before asking, as a usage or internal error does."""
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    session = types.SimpleNamespace(config=types.SimpleNamespace(stash={}))

    def stand_in(argv: list[str], plugins: list[object]) -> int:
        if pytest_code is not None:
            return pytest_code
        if plugins[1].pytest_runtestloop(session) is None:  # type: ignore[attr-defined]
            pytest.fail("the run went on to its items")
        return 0

    monkeypatch.setattr(pytest, "main", stand_in)
    return cli.main(["run", "-b", backends, "--device", device, "--matrix", str(one),
                     "--results", str(tmp_path / "r.jsonl"), "--no-report", "-n", "1"])


def _raising_factory() -> object:
    raise RuntimeError("no backend today")


@pytest.mark.parametrize("pytest_code", [None, outcome.EXIT_PYTEST_USAGE])
def test_a_builtin_whose_factory_fails_is_exit_2_with_the_line_of_the_check_before_pytest(
        pytest_code: int | None, one: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The same line as --device auto gives (resolved before pytest starts), whether the
    gate asked or pytest stopped before it could."""
    from mlacheck.backends import torch_ref

    monkeypatch.setattr(torch_ref, "factory", _raising_factory)
    assert cli.main(["run", "-b", "torch", "--device", "auto", "--matrix", str(one),
                     "--results", str(tmp_path / "auto.jsonl")]) == outcome.EXIT_USAGE
    before = capsys.readouterr().err
    assert before == ("mlacheck: error: backend 'torch': factory mlacheck.backends.torch_ref:"
                      "factory failed: RuntimeError: no backend today\n")
    rc = _in_process(monkeypatch, one, tmp_path, "cpu", "torch", pytest_code)
    assert rc == outcome.EXIT_USAGE and capsys.readouterr().err == before


def test_a_required_backend_that_is_not_usable_is_exit_6(
        one: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from mlacheck.backends import torch_ref

    monkeypatch.setattr(torch_ref.TorchBackend, "unavailable", lambda self: "switched off")
    rc = _in_process(monkeypatch, one, tmp_path, "cpu", "torch")
    assert rc == outcome.EXIT_NOT_ENOUGH_RAN
    assert capsys.readouterr().err == ("mlacheck: not run: backend torch is not usable here: "
                                       "switched off\n")


def test_a_builtin_that_records_another_name_stops_the_run(
        one: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """What test_every_builtin_name_is_the_name_its_backend_records keeps from happening,
    where a backend is built only on the GPU: checked at run time too."""
    from mlacheck.backends import torch_ref

    monkeypatch.setattr(torch_ref, "factory", lambda: torch_ref.TorchBackend(name="other"))
    assert _in_process(monkeypatch, one, tmp_path, "cpu", "torch") == outcome.EXIT_USAGE
    assert "backend 'torch' records its verdicts as 'other'" in capsys.readouterr().err
