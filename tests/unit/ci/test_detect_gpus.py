"""ci/lib.sh detect_gpus on a GPU node, with a stand-in torch (no GPU needed): the GPUs a job
may use stay those its runner gave it, in the variable the runtime reads."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[3] / "ci" / "lib.sh"


def _detect(tmp_path: Path, build: str, env: dict[str, str]) -> dict[str, str]:
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True, exist_ok=True)
    hip = '"6.2"' if build == "rocm" else "None"
    cuda = '"12.8"' if build == "cuda" else "None"
    n = len([e for e in env.get("VISIBLE_DEVICES", "").split(",") if e]) or 2
    (fake / "__init__.py").write_text(
        f"class version:\n    hip = {hip}\n    cuda = {cuda}\n"
        f"class cuda:\n    is_available = staticmethod(lambda: True)\n"
        f"    device_count = staticmethod(lambda: {n})\n")
    bin_dir = tmp_path / "bin"  # no amd-smi / rocm-smi / nvidia-smi on PATH
    bin_dir.mkdir(exist_ok=True)
    for tool in ("bash", "python3", "mktemp", "cat", "rm", "seq", "dirname", "timeout"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).unlink(missing_ok=True)
            (bin_dir / tool).symlink_to(found)
    script = (f'source "{LIB}"; PYTHON=python3; DEVICE=auto; REQUIRE_GPU=0; detect_gpus; '
              'echo "MODE=$MODE"; echo "HIP=${HIP_VISIBLE_DEVICES-unset}"; '
              'echo "CUDA=${CUDA_VISIBLE_DEVICES-unset}"')
    base = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES")}
    r = subprocess.run([str(bin_dir / "bash"), "-c", script], capture_output=True, text=True,
                       env={**base, "PATH": str(bin_dir), "PYTHONPATH": str(tmp_path / "fake"),
                            "CI_NAME": "t", **env}, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line
                and line.split("=", 1)[0] in ("MODE", "HIP", "CUDA"))


@pytest.mark.parametrize(("build", "env", "hip", "cuda"), [
    ("rocm", {}, "0,1", "unset"),
    # the HIP runtime reads CUDA_VISIBLE_DEVICES when HIP_VISIBLE_DEVICES is unset: the job
    # keeps GPUs 2 and 3 (HIP_VISIBLE_DEVICES=0,1 would have moved it onto GPUs 0 and 1)
    ("rocm", {"CUDA_VISIBLE_DEVICES": "2,3"}, "2,3", "2,3"),
    ("rocm", {"HIP_VISIBLE_DEVICES": "1,3"}, "1,3", "unset"),
    ("rocm", {"VISIBLE_DEVICES": "4,5,6"}, "4,5,6", "unset"),
    ("cuda", {}, "unset", "0,1"),
    ("cuda", {"CUDA_VISIBLE_DEVICES": "2,3"}, "unset", "2,3"),
    ("cuda", {"VISIBLE_DEVICES": "1"}, "unset", "1"),
])
def test_detect_gpus_keeps_the_jobs_gpus(tmp_path: Path, build: str, env: dict[str, str],
                                          hip: str, cuda: str) -> None:
    got = _detect(tmp_path, build, env)
    assert got == {"MODE": "gpu", "HIP": hip, "CUDA": cuda}
