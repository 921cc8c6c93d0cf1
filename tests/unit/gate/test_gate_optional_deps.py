"""The gate works without its optional dependencies where it can, and says so where not."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from mlacheck.gate.record import GateRecord

# Run in a fresh interpreter in which lm-eval, statsmodels and matplotlib cannot be imported.
_BLOCK = (
    "import sys\nfor m in ('lm_eval', 'statsmodels', 'matplotlib'):\n    sys.modules[m] = None\n"
)


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[3]
    return subprocess.run(
        [sys.executable, "-c", _BLOCK + code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_import_and_compare_without_optional_deps(
    tmp_path: Path, record_factory: Callable[..., GateRecord]
) -> None:
    record_factory([True] * 900 + [False] * 100).save(tmp_path / "base.json")
    record_factory([True] * 900 + [False] * 100).save(tmp_path / "cand.json")
    code = (
        "import mlacheck, mlacheck.gate\n"
        "from mlacheck.gate import cli, compare, lmeval_runner, record, stats, task\n"
        "assert all(sys.modules.get(m) is None for m in ('lm_eval', 'statsmodels', 'matplotlib'))\n"
        "rc = cli.main(['gsm8k', 'compare', 'base.json', 'cand.json', '--out-dir', 'rep'])\n"
        "print('RC', rc)\n"
        "rc = cli.main(['gsm8k', 'run', '--base-url', 'http://127.0.0.1:9', '--model', 'm',"
        " '--out', 'x.json'])\n"
        "print('RC', rc)\n"
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("RC ") == 2 and "RC 0" in proc.stdout and "RC 2" in proc.stdout
    assert "matplotlib not installed; no plot" in proc.stderr
    assert "gsm8k run needs lm-eval" in proc.stderr
    assert (tmp_path / "rep" / "gsm8k_gate.md").exists()
    assert json.loads((tmp_path / "rep" / "gsm8k_gate.json").read_text())["passed"] is True
    assert not (tmp_path / "rep" / "gsm8k_gate.png").exists()
