"""The pytest plugin is loaded into every pytest session of the environment, the xdist
controller included: registering its markers must not import torch there (~0.15 GB of a
process that builds no case; issue 17's 3 GB budget for the test command)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROBE = '''
import os, sys

def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):
        return
    loaded = session.config.pluginmanager.hasplugin("mlacheck")
    with open(os.environ["PROBE_OUT"], "w") as out:
        out.write(f"{loaded} {'torch' in sys.modules}")
'''


def test_the_xdist_controller_registers_the_markers_without_importing_torch(
        tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(PROBE)
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the checkout's configuration
    out = tmp_path / "probe.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1",
                        "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
                        str(tmp_path)],
                       capture_output=True, text=True, timeout=300,
                       env={**env, "PROBE_OUT": str(out)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # the plugin was loaded (it registered its markers there), and torch stayed out
    assert out.read_text() == "True False"
