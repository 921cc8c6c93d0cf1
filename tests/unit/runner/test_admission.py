"""Workers sharing one GPU reserve memory in a ledger (mlacheck.admission); CPU-testable parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mlacheck import admission, footprint
from mlacheck.matrices import load


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: the pid names no process now
    return p.pid


def test_a_case_waits_for_other_live_workers_reservations(tmp_path: Path) -> None:
    ledger = tmp_path / "gpu.json"
    ledger.write_text(json.dumps({str(os.getppid()): 70}))  # a live sibling holds 70 of 100
    assert not admission._try_reserve(ledger, 40, budget=100)
    assert admission._try_reserve(ledger, 30, budget=100)
    assert json.loads(ledger.read_text())[str(os.getpid())] == 30
    admission._release(ledger)
    assert str(os.getpid()) not in json.loads(ledger.read_text())


def test_dead_workers_and_a_torn_ledger_hold_nothing(tmp_path: Path) -> None:
    ledger = tmp_path / "gpu.json"
    ledger.write_text(json.dumps({str(_dead_pid()): 10**12}))
    assert admission._try_reserve(ledger, 90, budget=100)
    ledger.write_text('{"12')  # cut mid-write by a kill
    admission._release(ledger)
    assert json.loads(ledger.read_text()) == {}


def test_alone_on_the_device_a_case_always_starts(tmp_path: Path) -> None:
    """does_not_fit already judged it against the idle device; the ledger must not starve it."""
    assert admission._try_reserve(tmp_path / "gpu.json", 10**15, budget=100)


def test_reserved_gives_up_as_a_suite_error_and_frees_on_exit(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    ledger = tmp_path / "gpu.json"
    monkeypatch.setattr(admission, "ledger_path", lambda device: ledger)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (0, 100 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    case = load("smoke").cases[0].case
    need = footprint.estimate(case).total
    ledger.write_text(json.dumps({str(os.getppid()): 80 * 2**30}))  # sibling: 80 of 80 GiB budget
    start = time.monotonic()
    with pytest.raises(admission.NoRoomNow, match="other workers"), \
            admission.reserved(case, "cuda", wait_s=1.0):
        pass
    assert 1.0 <= time.monotonic() - start < 5
    ledger.write_text("{}")
    with admission.reserved(case, "cuda", wait_s=1.0):
        assert json.loads(ledger.read_text()) == {str(os.getpid()): need}
    assert json.loads(ledger.read_text()) == {}


def test_cpu_runs_take_no_reservation(tmp_path: Path) -> None:
    with admission.reserved(load("smoke").cases[0].case, "cpu"):
        pass


def test_a_kernel_out_of_memory_beside_other_workers_is_the_suites_error(monkeypatch) -> None:
    """An OOM while other workers' cases hold the GPU is the schedule's fault (ERROR, run again
    by --resume); alone on the device the same OOM is the kernel's (CRASH)."""
    from mlacheck import harness, spec
    from mlacheck.backends.torch_ref import TorchBackend
    from mlacheck.verdict import CRASH, ERROR

    class Greedy(TorchBackend):
        def run(self, case, inputs):  # noqa: ANN001, ANN201
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 74.00 MiB")

    case = spec.DecodeCase(requests=(spec.Request(1, 40),), num_heads=2)
    monkeypatch.setattr(admission, "others_hold_memory", lambda device: True)
    v = harness.run_case(case, Greedy(name="greedy"))
    assert v.status == ERROR and "other workers" in v.reason, v.reason
    monkeypatch.setattr(admission, "others_hold_memory", lambda device: False)
    assert harness.run_case(case, Greedy(name="greedy")).status == CRASH
