"""Which backends a CI job runs (issue 27): read from `mlacheck list --json`, never from text a
library can interleave; required unless named optional.

On the H100 the old parse of `mlacheck list 2>&1` ended the backend list at AITER's import
log line, and the GPU gate ran the reference alone and said PASS. Here an importable fake
library prints on import (Python print to stdout and stderr, a write to file descriptor 1,
a C printf left in the C buffer) and registers backends by entry point: the listing stays
one JSON document, and the CI script chooses the same backends with the noise as without.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_ci_scripts import CI, TINY_MATRIX, run_script  # noqa: I001  (this folder, on sys.path via rootdir insertion)

sys.path.insert(0, str(CI))
try:
    import mlacheck_ci
finally:
    sys.path.remove(str(CI))

NOISE = ("[noisy] Triton ops only: a log line at import",
         "[noisy] a line on stderr at import",
         "noisy: written straight to file descriptor 1",
         "noisy: C printf, left in the C stdio buffer")

NOISY_LIB = f'''
import ctypes, os, sys
if not os.environ.get("NOISY_QUIET"):
    print({NOISE[0]!r})
    print({NOISE[1]!r}, file=sys.stderr)
    os.write(1, {NOISE[2]!r}.encode() + b"\\n")
    ctypes.CDLL(None).printf({NOISE[3]!r}.encode() + b"\\n")
'''

NOISY_BACKENDS = '''
import noisy_mla_lib  # noqa: F401  (the printing happens here)
from mlacheck.backends.torch_ref import TorchBackend


def factory():
    return TorchBackend(name="noisy")


def after_factory():
    return TorchBackend(name="zz-after")


class _Gone(TorchBackend):
    def unavailable(self):
        return "noisy-gone needs a library this machine lacks"


def gone_factory():
    return _Gone(name="noisy-gone")
'''


@pytest.fixture
def noisy_site(tmp_path: Path) -> Path:
    """A site folder with the printing library and a distribution registering its backends."""
    site = tmp_path / "site"
    dist = site / "noisy_mla-1.0.dist-info"
    dist.mkdir(parents=True)
    (site / "noisy_mla_lib.py").write_text(NOISY_LIB)
    (site / "noisy_mla_backends.py").write_text(NOISY_BACKENDS)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: noisy-mla\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[mlacheck.backends]\nnoisy = noisy_mla_backends:factory\n"
        "zz-after = noisy_mla_backends:after_factory\n"
        "noisy-gone = noisy_mla_backends:gone_factory\n")
    return site


def _env(site: Path, quiet: bool = False) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    if quiet:
        env["NOISY_QUIET"] = "1"
    return env


def _mlacheck(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlacheck.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)


def test_list_json_is_one_document_whatever_a_library_prints(noisy_site: Path) -> None:
    r = _mlacheck("list", "--json", env=_env(noisy_site))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)  # the whole of stdout: nothing before or after the document
    for line in NOISE:
        assert line not in r.stdout and line in r.stderr, line
    by_name = {b["name"]: b for b in doc["backends"]}
    assert by_name["noisy"]["usable"] and by_name["zz-after"]["usable"]
    assert by_name["noisy"]["source"] == "entry point" and by_name["torch"]["source"] == "builtin"
    assert by_name["noisy-gone"] == {**by_name["noisy-gone"], "usable": False,
                                     "reason": "noisy-gone needs a library this machine lacks"}
    assert by_name["torch"]["version"].startswith("mlacheck ")
    assert "mla_decode" in by_name["torch"]["capabilities"]
    # smoke's count from the loader, not a literal (it grew 51 -> 61 with issues 29 and 34)
    from mlacheck.matrices import load

    assert {"name": "smoke", "cases": len(load("smoke").cases)} in doc["matrices"]
    assert doc["platform"]["torch_build"] in ("cpu", "cuda", "rocm")
    assert doc[mlacheck_ci_schema_key()] == 1
    # what a CI job asks: only its backends, no matrices (seconds, not a matrix expansion)
    asked = _mlacheck("list", "--json", "-b", "noisy,torch", "-b", "noisy-gone",
                      env=_env(noisy_site))
    doc = json.loads(asked.stdout)
    assert [b["name"] for b in doc["backends"]] == ["noisy", "torch", "noisy-gone"]
    assert "matrices" not in doc and NOISE[0] in asked.stderr
    # the human listing is where the noise lands among the backends (the old parse's trap)
    human = _mlacheck("list", env=_env(noisy_site)).stdout.splitlines()
    noise_at = human.index(NOISE[0])
    assert noise_at < next(i for i, line in enumerate(human) if line.split()[:1] == ["zz-after"])


def mlacheck_ci_schema_key() -> str:
    from mlacheck.inventory import SCHEMA_KEY

    return SCHEMA_KEY


def test_the_ci_script_runs_the_same_backends_with_a_noisy_library(
        noisy_site: Path, tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(TINY_MATRIX)
    ran = []
    for quiet in (True, False):
        work = tmp_path / ("quiet" if quiet else "noisy")
        work.mkdir()
        env = {"MATRIX": str(tiny), "BACKENDS": "noisy torch noisy-gone zz-after",
               "OPTIONAL_BACKENDS": "noisy-gone",
               "PYTHONPATH": _env(noisy_site, quiet)["PYTHONPATH"]}
        if quiet:
            env["NOISY_QUIET"] = "1"
        r = run_script("premerge.sh", env, work)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        assert ("note: optional backend noisy-gone (OPTIONAL_BACKENDS): not run: noisy-gone "
                "needs a library this machine lacks") in r.stdout
        assert "note: required backends: noisy torch zz-after" in r.stdout
        results = work / "artifacts" / "results.jsonl"
        recs = [json.loads(x) for x in results.read_text().splitlines()]
        ran.append(sorted({x["backend"] for x in recs if "case_id" in x}))
        if not quiet:
            assert NOISE[1] in (work / "artifacts" / "backends.log").read_text()
    assert ran[0] == ran[1] == ["noisy", "torch", "zz-after"]


def test_a_required_backend_that_is_not_usable_is_named_with_its_reason(
        noisy_site: Path, tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(TINY_MATRIX)
    env = {"MATRIX": str(tiny), "BACKENDS": "torch noisy-gone",
           "PYTHONPATH": _env(noisy_site)["PYTHONPATH"]}
    r = run_script("premerge.sh", env, tmp_path)
    assert r.returncode == 6, r.stdout[-3000:] + r.stderr[-2000:]
    assert "result: PASS" not in r.stdout
    assert "noisy-gone" in r.stderr + r.stdout
    assert "noisy-gone needs a library this machine lacks" in r.stderr + r.stdout


# --------------------------------------------------------------------------- the plan itself


def _listing(**usable: bool | str) -> dict:
    """A listing where each named backend is usable (True) or not (the reason)."""
    from mlacheck.inventory import SCHEMA, SCHEMA_KEY

    return {SCHEMA_KEY: SCHEMA, "backends": [
        {"name": n.replace("_", "-"), "usable": u is True, "reason": None if u is True else u}
        for n, u in usable.items()]}


def test_rocm_requires_aiter_and_never_gates_on_torch_alone() -> None:
    listing = _listing(aiter="aiter not installed", aiter_nonpersistent="aiter not installed",
                       aiter_triton="triton not installed", torch=True)
    run, notes, unusable = mlacheck_ci.plan_backends(listing, "rocm", "", "")
    assert run == ["aiter", "aiter-nonpersistent", "aiter-triton", "torch"]
    assert unusable == [("aiter", "aiter not installed"),
                        ("aiter-nonpersistent", "aiter not installed"),
                        ("aiter-triton", "triton not installed")]
    assert notes == ["required backends: aiter aiter-nonpersistent aiter-triton torch"]
    # dropping them is explicit, and said at the top of the summary
    run, notes, unusable = mlacheck_ci.plan_backends(
        listing, "rocm", "", "aiter-nonpersistent aiter-triton")
    assert run == ["aiter", "torch"] and unusable == [("aiter", "aiter not installed")]
    assert notes[0] == "required backends: aiter torch"
    assert notes[1:] == [
        "optional backend aiter-nonpersistent (OPTIONAL_BACKENDS): not run: aiter not installed",
        "optional backend aiter-triton (OPTIONAL_BACKENDS): not run: triton not installed"]


def test_cuda_requires_aiter_triton_and_runs_the_others_when_installed() -> None:
    listing = _listing(aiter_triton=True, flashinfer=True, flashinfer_fa3=True,
                       flashmla="flash_mla not installed", torch=True)
    run, notes, unusable = mlacheck_ci.plan_backends(listing, "cuda", "", "")
    assert run == ["aiter-triton", "flashinfer", "flashinfer-fa3", "torch"] and not unusable
    assert "optional backend flashmla (OPTIONAL_BACKENDS): not run: flash_mla not installed" in notes
    listing = _listing(aiter_triton="triton not installed", torch=True)
    run, _, unusable = mlacheck_ci.plan_backends(listing, "cuda", "", "")
    assert unusable[0] == ("aiter-triton", "triton not installed") and "aiter-triton" in run


def test_named_backends_are_all_required_and_cpu_keeps_the_embedded_default() -> None:
    listing = _listing(flashinfer="flashinfer not installed", torch=True)
    run, _, unusable = mlacheck_ci.plan_backends(listing, "cuda", "flashinfer,torch", "")
    assert run == ["flashinfer", "torch"] and unusable == [("flashinfer", "flashinfer not installed")]
    assert mlacheck_ci.plan_backends(listing, "none", "", "") == ([], [], [])
    # an import path is not in the listing: `mlacheck run` resolves and checks it
    run, _, unusable = mlacheck_ci.plan_backends(listing, "none", "pkg.mod:factory", "")
    assert run == ["pkg.mod:factory"] and not unusable
    with pytest.raises(ValueError, match="OPTIONAL_BACKENDS names aiter"):
        mlacheck_ci.plan_backends(listing, "cuda", "torch", "aiter")
    with pytest.raises(ValueError, match="not `mlacheck list --json` output"):
        mlacheck_ci.plan_backends({"backends": []}, "cuda", "", "")


def test_the_usability_probe_answers_as_the_listing_does_and_without_its_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`mlacheck run` asks in a probe process (mlacheck.inventory.UsabilityProbe): the
    listing's reasons, and the first backend that cannot be resolved (its error); where that
    process cannot start, the same question is answered in this one: never no answer."""
    import sys

    from mlacheck.inventory import UsabilityProbe, backend_status, check_run

    listed = [backend_status(s) for s in ("torch", "aiter")]
    assert check_run(["torch", "aiter"]).unusable == {s.name: s.reason for s in listed
                                                      if not s.usable}
    specs = ["torch", "nosuch-backend"]
    expected = check_run(specs)
    assert expected.names == {"torch": "torch"} and not expected.unusable
    assert expected.error.startswith("unknown backend 'nosuch-backend'")
    assert UsabilityProbe(specs).result() == expected
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    probe = UsabilityProbe(specs)
    assert probe._proc is None and probe.result() == expected


# torch as on a host whose NVML sees a GPU that the CUDA runtime cannot use (a driver older
# than torch's CUDA, nvidia-uvm not loaded, a MIG GPU without instances): torch.cuda's
# device_count() asks NVML (torch/cuda/__init__.py, device_count / _device_count_nvml), and
# is_available() does too where PYTORCH_NVML_BASED_CUDA_CHECK=1 (_nvml_based_avail), else the
# runtime (cudaGetDeviceCount), which finds no GPU there
NVML_SEES_A_GPU = """
import os
import torch
torch.cuda.is_available = lambda: os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"
torch.cuda.device_count = lambda: 1
open(os.environ["FAKE_TORCH_SEEN"], "a").write(str(os.getpid()) + "\\n")
"""


def test_the_probe_checks_the_device_as_the_workers_will(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`mlacheck run --device cuda`: the probe's answer is the one its workers will meet (they
    resolve the device with torch's runtime); with torch's NVML check the probe let the run
    start, each worker's collection failed on the device, and the run ended in exit 6 with
    tracebacks instead of the one-line exit 2 (found in review of e9eb022)."""
    from mlacheck import inventory

    (tmp_path / "sitecustomize.py").write_text(NVML_SEES_A_GPU)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("FAKE_TORCH_SEEN", str(tmp_path / "seen"))
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    probe = inventory.UsabilityProbe(["torch"], "cuda")
    proc = probe._proc
    answer = probe.result()
    assert proc is not None and proc.returncode == 0  # answered by the probe, not in here
    assert (tmp_path / "seen").read_text().split() == [str(proc.pid)]  # with the fake torch
    assert answer.error.startswith("device 'cuda' requested but torch")


@pytest.mark.parametrize(("knob", "left_at_once"), [(None, True), ("1", False)])
def test_the_probe_process_leaves_once_its_answer_is_written(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, knob: str | None,
        left_at_once: bool) -> None:
    """No interpreter teardown of what it imported (the first item waits for its end), unless
    the slow exit is kept for a coverage tool, as for the workers."""
    from mlacheck import inventory, processes

    exits: list[int] = []

    def leave(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(inventory.os, "_exit", leave)
    if knob is None:
        monkeypatch.delenv(processes.SLOW_EXIT_ENV, raising=False)
    else:
        monkeypatch.setenv(processes.SLOW_EXIT_ENV, knob)
    answer = tmp_path / "answer.json"
    with contextlib.suppress(SystemExit):
        inventory._probe_main(str(answer), None, ["torch"])
    assert exits == ([0] if left_at_once else [])
    assert json.loads(answer.read_text())["names"] == {"torch": "torch"}


@pytest.mark.parametrize(("device", "woken"), [("cuda", True), ("cuda:1", True), ("cpu", False),
                                               (None, False)])
def test_the_probe_wakes_the_driver_before_it_imports_anything(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, device: str | None, woken: bool) -> None:
    """A probe that checks a GPU device starts cuInit first (the check itself stays torch's
    runtime's, as in the workers); one that checks no device, or the CPU, leaves the driver."""
    from mlacheck import cuda_context, inventory

    order: list[str] = []
    monkeypatch.setattr(cuda_context, "init_driver", lambda: order.append("cuInit"))
    monkeypatch.setattr(inventory, "_write_check", lambda *a: order.append("check"))

    def leave(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(inventory.os, "_exit", leave)
    with pytest.raises(SystemExit):
        inventory._probe_main(str(tmp_path / "answer.json"), device, ["torch"])
    assert order == [*(["cuInit"] if woken else []), "check"]
