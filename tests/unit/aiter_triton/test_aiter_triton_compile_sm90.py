"""AITER's real Triton MLA kernels compiled (never launched) for CUDA sm_90 through the
aiter-triton backend and its compatibility layer, on a machine with no GPU: the launch-config
filtering against the kernels' real signatures (Triton raises the `waves_per_eu ... unrecognised`
KeyError at compile time), the FP8 head split and the page-size capabilities against the
H100's 227 KB shared-memory limit.

Needs AMD AITER (Triton-only build) and triton with its NVIDIA backend (ptxas ships in the
triton wheel); SKIPs with the reason otherwise (the CI machine has neither). Runs in a
subprocess: the compile-only driver it installs must not leak into other tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _missing() -> str | None:
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return "triton not installed"
    nvidia = Path(next(iter(spec.submodule_search_locations))) / "backends" / "nvidia"
    if not (nvidia / "bin" / "ptxas").is_file():
        return "triton has no NVIDIA backend / ptxas"
    spec = importlib.util.find_spec("aiter")
    if spec is None or not spec.submodule_search_locations:
        return "aiter (AMD AITER, Triton-only build) not installed"
    root = Path(next(iter(spec.submodule_search_locations)))
    if not (root / "ops" / "triton" / "attention" / "mla.py").is_file():
        return "installed aiter has no aiter/ops/triton/attention/mla.py"
    return None


def _compile(tmp: Path, *flags: str) -> list[dict]:
    why = _missing()
    if why:
        pytest.skip(why)
    env = dict(os.environ, AITER_TRITON_ONLY="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "mlacheck.tools.aiter_triton_check", "--compile-only", "--json",
           str(tmp), *flags]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return [json.loads(x) for x in (tmp / "aiter_triton_compile.jsonl").read_text().splitlines()]


def test_every_accepted_case_compiles_within_h100_limits(tmp_path: Path) -> None:
    recs = _compile(tmp_path, "--rope")
    compiled = [r for r in recs if r["kernel"] != "-"]
    assert compiled, recs
    bad = [r for r in compiled if r["status"] != "ok"]
    assert not bad, bad
    # the FP8-KV decode at 128 heads runs in launches of 64 heads: BLOCK_M 64, not 128
    fp8_128 = [r for r in compiled if r["case"] == "decode fp8 h128 p64 sentinel"
               and r["kernel"] == "triton_mla_decode_fwd_kernel"]
    assert fp8_128 and all(r["BLOCK_M"] == 64 and r["num_warps"] == 8 for r in fp8_128)
    refused = {r["case"]: r["status"] for r in recs if r["kernel"] == "-"}
    assert "K >= 32" in refused["decode fp8 h16 p16 (beyond capability)"]
    assert "page size 256" in refused["decode bf16 h16 p256 (beyond capability)"]


def test_the_refused_limits_are_real(tmp_path: Path) -> None:
    recs = _compile(tmp_path, "--force", "--only", "beyond capability")
    attn = {r["case"]: r["status"] for r in recs if r["kernel"] == "triton_mla_decode_fwd_kernel"}
    assert "K >= 32" in attn["decode fp8 h16 p16 (beyond capability)"]
    assert "shared-memory limit" in attn["decode bf16 h16 p256 (beyond capability)"]


def test_as_shipped_aiter_fails_on_cuda(tmp_path: Path) -> None:
    """Without the compatibility layer: the reduce kernel gets waves_per_eu as a launch option
    (it does not declare it) and the grouped-rope decode looks for a `90-*.json` config."""
    recs = _compile(tmp_path, "--as-shipped", "--rope", "--only", "bf16 h16 p16 sentinel")
    reduce = [r["status"] for r in recs if r["kernel"] == "triton_mla_decode_fwd_reduce_kernel"]
    assert reduce and all("waves_per_eu was specified but unrecognised" in s for s in reduce)
    rope = [r["status"] for r in recs if r["case"].startswith("rope ") and r["kernel"] == "-"]
    assert any("90-MLA_DECODE_ROPE-DEFAULT.json" in s for s in rope), recs


def test_prefill_compiles_and_fails_as_shipped(tmp_path: Path) -> None:
    ok = _compile(tmp_path / "compat", "--only", "prefill")
    attn = [r for r in ok if r["kernel"] == "attn_fwd"]
    assert attn and all(r["status"] == "ok" and "waves_per_eu" not in r for r in attn), ok
    assert {r["case"] for r in attn} >= {"prefill fp8 h16 2 segments",
                                        "prefill bf16 h16 context non-causal"}
    shipped = _compile(tmp_path / "shipped", "--only", "prefill", "--as-shipped")
    status = {r["case"]: r["status"] for r in shipped}
    assert "waves_per_eu was specified but unrecognised" in status["prefill bf16 h16 2 segments"]
    assert "does not support FP8" in status["prefill fp8 h16 2 segments"]
