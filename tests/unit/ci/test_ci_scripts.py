"""The CI scripts (ci/premerge.sh, ci/nightly.sh) run end to end in their CPU mode.

premerge: a tiny matrix (three small cases) on the embedded default backend passes and leaves
JUnit XML, JSON lines, the HTML report and a one-screen summary; a deliberately wrong backend
(tests/fixtures/bad_backends.py) makes it exit 1 with the failure named in the summary;
REQUIRE_GPU=1 on a machine without a GPU is one line on stderr and exit 2.
nightly: a missing baseline, an unreachable server and a server command that dies are each one
line on stderr and exit 2, before any matrix runs; without a URL the gate is skipped with a
clear line; with SERVER_CMD (a fake OpenAI-compatible server on 127.0.0.1) the server is
started, waited for, gated against a baseline and stopped, and the combined report has every
step. The scripts are also checked with `bash -n` and, where installed, shellcheck.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
CI = REPO / "ci"
FIXTURES = REPO / "tests" / "fixtures"
FAKE_SERVER = Path(__file__).with_name("fake_completions_server.py")

# Knobs of the scripts (the `NAME=${NAME:-...}` lines at their top), cleared from the inherited
# environment so each test sees only its own.
KNOBS = frozenset(
    m.group(1)
    for script in ("premerge.sh", "nightly.sh")
    for m in re.finditer(r"^([A-Z][A-Z0-9_]*)=\$\{\1[:}]", (CI / script).read_text(), re.M)
) | {"NIGHTLY_ENV", "GITHUB_SHA"}

TINY_MATRIX = """\
name: tiny
description: three small cases for the CI script tests
groups:
  - name: decode
    kind: decode
    base: {requests: [[1, 40], [1, 33]], num_heads: 16, page_size: 16}
  - name: prefill
    kind: prefill
    base: {segments: [[24, 0], [16, 8]], num_heads: 16}
  - name: paged-prefill
    kind: prefill
    base: {segments: [[20, 0], [12, 9]], num_heads: 16, paging: {page_size: 16, layout: linear}}
"""


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def run_script(
    name: str, env: Mapping[str, str], tmp_path: Path, timeout: float = 480
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in KNOBS}
    full.update(
        PYTHON=sys.executable,
        ARTIFACTS=str(tmp_path / "artifacts"),
        NIGHTLY_ENV=str(tmp_path / "none.env"),
    )
    if _has_gpu():  # these tests are about the CPU mode
        full["DEVICE"] = "cpu"
    full.update(env)
    return subprocess.run(
        ["bash", str(CI / name)], env=full, cwd=tmp_path, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    return lines[0]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_MATRIX)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- premerge


def test_premerge_cpu_mode_passes(tmp_path: Path, tiny: Path) -> None:
    r = run_script("premerge.sh", {"MATRIX": str(tiny)}, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert r.stderr.strip() == ""
    art = tmp_path / "artifacts"
    for f in ("junit.xml", "results.jsonl", "report.html", "report.md", "summary.md"):
        assert (art / f).stat().st_size > 0, f
    suite = ET.parse(art / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None and int(suite.get("tests", "0")) == 6
    assert int(suite.get("failures", "0")) == 0 and int(suite.get("errors", "0")) == 0
    lines = (art / "results.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "mlacheck_results" not in r]
    # CPU fallback: no --backend, so the embedded default backends ran
    from mlacheck.backends.registry import DEFAULT_BACKENDS

    assert {r["backend"] for r in records} == set(DEFAULT_BACKENDS) and len(records) == 6
    assert "no GPU: CPU mode" in r.stdout
    # the one-screen summary: title, totals, the backend x op table, the verdict
    out = r.stdout
    assert "== mlacheck premerge: tiny ==" in out
    assert "6 cases: " in out and "result: PASS (0 FAIL, 0 CRASH; exit 0)" in out
    assert any(
        line.startswith(DEFAULT_BACKENDS[0]) and "mla_decode" in line for line in out.splitlines()
    )
    assert "<html" in (art / "report.html").read_text()[:2000].lower()


def test_premerge_failing_backend_exits_1_and_names_the_failure(tmp_path: Path, tiny: Path) -> None:
    env = {
        "MATRIX": str(tiny),
        "BACKENDS": "bad_backends:perturb_request",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FIXTURES), os.environ.get("PYTHONPATH")])),
    }
    r = run_script("premerge.sh", env, tmp_path)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr
    summary = r.stdout[r.stdout.index("== mlacheck premerge: tiny ==") :]
    assert "result: FAIL (3 FAIL, 0 CRASH; exit 1)" in summary
    failures = [line.strip() for line in summary.splitlines() if line.startswith("  FAIL ")]
    assert len(failures) == 3
    decode = next(line for line in failures if " mla_decode " in line)
    # the one-line reason says which backend, which case, what failed and where: request 1
    assert decode.startswith("FAIL perturb-request mla_decode dec-")
    assert "row_error" in decode and "at row_error: request 1 " in decode
    prefill = next(line for line in failures if " mla_prefill " in line)
    assert "segment 1 " in prefill
    art = tmp_path / "artifacts"
    md = (art / "summary.md").read_text()
    assert "**FAIL**" in md and "perturb-request" in md
    suite = ET.parse(art / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None and int(suite.get("failures", "0")) == 3


@pytest.mark.skipif(_has_gpu(), reason="needs a machine without a GPU")
def test_premerge_require_gpu_without_gpu_is_one_line_exit_2(tmp_path: Path) -> None:
    r = run_script("premerge.sh", {"REQUIRE_GPU": "1"}, tmp_path, timeout=120)
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert line.startswith("premerge: error: ") and "REQUIRE_GPU=1" in line
    assert not (tmp_path / "artifacts" / "results.jsonl").exists()


def test_premerge_with_a_backend_that_runs_nothing_is_not_a_pass(tmp_path: Path, tiny: Path) -> None:
    """Issue 12: `BACKENDS="aiter torch"` on a machine without AITER printed `result: PASS`.
    Issue 27: every backend of the job is required; one that is not usable here ends the job
    (exit 6) with one line naming it, why, and how to run without it."""
    r = run_script("premerge.sh", {"MATRIX": str(tiny), "BACKENDS": "aiter torch"}, tmp_path)
    assert r.returncode == 6, r.stdout[-3000:] + r.stderr
    assert "result: PASS" not in r.stdout
    assert ("premerge: error: required backend aiter is not usable here: aiter not installed "
            "(pip install mlacheck[rocm] -> amd-aiter) (OPTIONAL_BACKENDS=aiter runs without it)"
            ) in r.stderr.splitlines()


def test_premerge_unknown_backend_is_one_line_exit_2(tmp_path: Path, tiny: Path) -> None:
    r = run_script("premerge.sh", {"MATRIX": str(tiny), "BACKENDS": "no-such-backend"}, tmp_path)
    assert r.returncode == 2
    assert "no-such-backend" in one_line(r.stderr)


# --------------------------------------------------------------------------- nightly


def write_baseline(path: Path) -> Path:
    """A small complete gate record: enough to pass the up-front baseline check."""
    from mlacheck.gate.record import GateRecord, RunMetadata, SampleRecord, metrics_from_samples
    from mlacheck.gate.task import doc_hash

    samples = tuple(
        SampleRecord(doc_id=i, doc_hash=doc_hash(f"question {i}"), target="1",
                     strict_correct=True, flexible_correct=True, strict_answer="1",
                     flexible_answer="1", no_number=False, degenerate=False)
        for i in range(4)
    )  # fmt: skip
    rec = GateRecord(
        metadata=RunMetadata(model="m", backend="test"),
        metrics=metrics_from_samples(samples),
        n_planned=len(samples),
        samples=samples,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rec.dumps())
    return path


def test_nightly_missing_baseline_is_one_line_exit_2(tmp_path: Path) -> None:
    env = {
        "MLACHECK_GSM8K_URL": f"http://127.0.0.1:{free_port()}/v1",
        "MLACHECK_GSM8K_MODEL": "some-model",
        "BASELINE": "no-such-baseline",
        "REFS_DIR": str(tmp_path / "refs"),
    }
    r = run_script("nightly.sh", env, tmp_path, timeout=120)
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert line.startswith("nightly: error: ") and "no-such-baseline.json does not exist" in line
    assert not (tmp_path / "artifacts" / "matrix").exists()  # checked before any work


def test_nightly_unreachable_server_is_one_line_exit_2(tmp_path: Path) -> None:
    write_baseline(tmp_path / "refs" / "base.json")
    url = f"http://127.0.0.1:{free_port()}/v1"
    # the URL comes from the config file, the rest from the environment
    (tmp_path / "nightly.env").write_text(f"MLACHECK_GSM8K_URL={url}\nBASELINE=not-this-one\n")
    env = {
        "NIGHTLY_ENV": str(tmp_path / "nightly.env"),
        "MLACHECK_GSM8K_MODEL": "some-model",
        "BASELINE": "base",  # the environment wins over the file
        "REFS_DIR": str(tmp_path / "refs"),
    }
    r = run_script("nightly.sh", env, tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line(r.stderr)
    assert line.startswith("nightly: error: cannot reach server at ") and url in line
    assert not (tmp_path / "artifacts" / "matrix").exists()


def test_nightly_server_cmd_that_dies_is_one_line_exit_2(tmp_path: Path) -> None:
    write_baseline(tmp_path / "refs" / "base.json")
    env = {
        "STEPS": "gate",
        "SERVER_CMD": "echo 'cannot load the model' >&2; exit 3",
        "SERVER_URL": f"http://127.0.0.1:{free_port()}/v1",
        "SERVER_POLL": "0.2",
        "MLACHECK_GSM8K_MODEL": "some-model",
        "BASELINE": str(tmp_path / "refs" / "base.json"),
    }
    r = run_script("nightly.sh", env, tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line(r.stderr)
    assert "exited before answering" in line and "server.log" in line
    art = tmp_path / "artifacts"
    assert "cannot load the model" in (art / "server.log").read_text()
    assert "ERROR" in (art / "nightly.md").read_text()  # the report is still written


def test_nightly_without_url_skips_the_gate(tmp_path: Path) -> None:
    r = run_script("nightly.sh", {"STEPS": "gate"}, tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stderr.strip() == ""
    assert "gate skipped: no MLACHECK_GSM8K_URL and no SERVER_CMD" in r.stdout
    assert "GSM8K gate | skipped" in (tmp_path / "artifacts" / "nightly.md").read_text()


def _gsm8k_data(d: Path) -> Path:
    d.mkdir(parents=True)
    for name, n, off in (("train", 5, 1), ("test", 8, 100)):
        docs = []
        for i in range(n):
            a, b = i + off, 2 * i + 3
            docs.append(
                {
                    "question": f"Ann has {a} apples and gets {b} more. How many apples?",
                    "answer": f"Ann has {a} + {b} = {a + b} apples.\n#### {a + b}",
                }
            )
        (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    return d


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.skipif(shutil.which("setsid") is None, reason="setsid not installed")
def test_nightly_gate_with_server_cmd_end_to_end(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    data = _gsm8k_data(tmp_path / "gsm8k")
    py = sys.executable
    # the baseline: a gate run against the fake server, promoted as the docs say
    port = free_port()
    server = subprocess.Popen([py, str(FAKE_SERVER), str(port), str(data)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert "fake server" in (server.stdout.readline() if server.stdout else "")
        mla = [py, "-m", "mlacheck.cli", "gate", "gsm8k"]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        subprocess.run(
            [*mla, "run", "--base-url", f"http://127.0.0.1:{port}", "--model", "fake",
             "--out", str(tmp_path / "base-run.json"), "--data-dir", str(data), "--num-concurrent", "2"],
            check=True, capture_output=True, env=env, timeout=120,
        )  # fmt: skip
        subprocess.run(
            [*mla, "promote", str(tmp_path / "base-run.json"), "--name", "fake-base",
             "--reason", "test baseline", "--refs-dir", str(tmp_path / "refs")],
            check=True, capture_output=True, env=env, timeout=60,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(10)

    port = free_port()
    (tmp_path / "nightly.env").write_text(
        f"SERVER_CMD='exec {py} {FAKE_SERVER} {port} {data}'\n"
        f"SERVER_URL=http://127.0.0.1:{port}/v1\n"
        "MLACHECK_GSM8K_MODEL=model-from-the-file\n"
        "BASELINE=fake-base\n"
    )
    env = {
        "NIGHTLY_ENV": str(tmp_path / "nightly.env"),
        "STEPS": "gate",
        "MLACHECK_GSM8K_MODEL": "fake",
        "REFS_DIR": str(tmp_path / "refs"),
        "SERVER_POLL": "0.2",
        "GSM8K_DATA_DIR": str(data),
        "GSM8K_CONCURRENT": "2",
        # 8 questions resolve nothing finer than tens of points
        "GATE_COMPARE_ARGS": "--margin-points 60 --invalid-ceiling-percent 50",
    }
    r = run_script("nightly.sh", env, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert r.stderr.strip() == ""
    out = r.stdout
    assert "starting the server" in out and "server answers" in out and "stopping the server" in out
    assert _port_closed(port)  # stopped at the end
    art = tmp_path / "artifacts"
    from mlacheck.gate.record import GateRecord

    run = GateRecord.load(art / "gsm8k" / "run.json")
    assert run.complete and run.metadata.model == "fake"  # the environment won over the file
    assert (art / "gsm8k" / "gsm8k_gate.md").is_file()
    report = (art / "nightly.md").read_text()
    assert "| GSM8K gate | PASS |" in report
    assert "| selftest | skipped (not in STEPS) |" in report
    assert "### GSM8K gate: PASS" in report


STUB_MLACHECK = """\
import sys
if sys.argv[1:2] == ["selftest"]:
    mode = sys.argv[-1]
    if mode == "--absent":
        print("mlacheck: error: selftest is not available: No module named 'x'", file=sys.stderr)
        sys.exit(2)
    print("| fault | caught |\\n| perturb-row | no |")
    sys.exit(0 if mode == "--pass" else 1)
sys.exit(3)
"""


@pytest.mark.parametrize(
    ("mode", "code", "row"),
    [
        ("--absent", 0, "selftest: skipped (not available in this mlacheck)"),
        ("--pass", 0, "selftest: PASS"),
        ("--escape", 1, "selftest: FAIL (exit 1)"),
    ],
)
def test_nightly_selftest_step(tmp_path: Path, mode: str, code: int, row: str) -> None:
    stub = tmp_path / "stub_mlacheck.py"
    stub.write_text(STUB_MLACHECK)
    env = {"STEPS": "selftest", "MLACHECK": f"{sys.executable} {stub}", "SELFTEST_ARGS": mode}
    r = run_script("nightly.sh", env, tmp_path, timeout=120)
    assert r.returncode == code, r.stdout + r.stderr
    assert r.stderr.strip() == ""
    assert f"nightly:   {row}" in r.stdout
    report = (tmp_path / "artifacts" / "nightly.md").read_text()
    assert "## Selftest" in report and ("perturb-row" in report) == (mode != "--absent")


# --------------------------------------------------------------------------- the scripts


@pytest.mark.parametrize("script", ["premerge.sh", "nightly.sh", "lib.sh"])
def test_bash_syntax(script: str) -> None:
    subprocess.run(["bash", "-n", str(CI / script)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean() -> None:
    r = subprocess.run(
        ["shellcheck", "-x", "premerge.sh", "nightly.sh", "lib.sh", "nightly.env"],
        cwd=CI, capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr


def test_combined_report_demotes_headings_and_keeps_images(tmp_path: Path) -> None:
    sys.path.insert(0, str(CI))
    try:
        import mlacheck_ci
    finally:
        sys.path.remove(str(CI))
    (tmp_path / "gate").mkdir()
    (tmp_path / "gate" / "g.md").write_text("# Gate: PASS\n\n## Checks\n\n![plot](g.png)\n")
    (tmp_path / "log.txt").write_text("| fault | caught |\n")
    out = tmp_path / "all.md"
    code = mlacheck_ci.main(["combine", "--out", str(out), "--title", "T", "--step", "gate=PASS",
                             "--section", f"Gate={tmp_path / 'gate' / 'g.md'}",
                             "--section", f"Log={tmp_path / 'log.txt'}",
                             "--section", "Missing="])  # fmt: skip
    assert code == 0
    text = out.read_text()
    assert text.startswith("# T\n") and "| gate | PASS |" in text
    assert "### Gate: PASS" in text and "#### Checks" in text and "![plot](gate/g.png)" in text
    assert "```text\n| fault | caught |\n```" in text
    assert "## Missing" in text and "step skipped" in text


def test_premerge_merges_the_shards_of_a_split_run(tmp_path: Path, tiny: Path) -> None:
    """Issue 27: N runners each run SHARD=K/N; one job joins them (MERGE): the summary and
    the exit code are the single run's, and a missing shard is INCOMPLETE (exit 6)."""
    shards = tmp_path / "shards"
    for k in (1, 2):
        r = subprocess.run(
            [sys.executable, "-m", "mlacheck.cli", "run", "-b", "torch", "--matrix", str(tiny),
             "--shard", f"{k}/2", "--workers", "1", "--no-report",
             "--results", str(shards / f"s{k}" / "results.jsonl")],
            capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = run_script("premerge.sh", {"MERGE": f"{shards}/*/results.jsonl"}, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert "running: mlacheck merge " in r.stdout and "result: PASS" in r.stdout
    assert "3 cases: " in r.stdout  # the union of the two shards
    r = run_script("premerge.sh", {"MERGE": str(shards / "s1" / "results.jsonl")}, tmp_path)
    assert r.returncode == 6, r.stdout[-3000:] + r.stderr
    assert "gate: INCOMPLETE: shard(s) 2/2 missing (1 of 2 merged)" in r.stdout
    assert "result: NOT ENOUGH RAN" in r.stdout


def test_premerge_seed_knob_draws_another_sample(tmp_path: Path, tiny: Path) -> None:
    """SEED=N passes --seed N: a nightly can take a new draw each night, recorded per case
    (the tiny matrix's cases have seed 0, so each case's seed is the offset itself)."""
    r = run_script("premerge.sh", {"MATRIX": str(tiny), "SEED": "3"}, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert " --seed 3" in r.stdout
    results = (tmp_path / "artifacts" / "results.jsonl").read_text().splitlines()
    seeds = [json.loads(x)["case"]["seed"] for x in results if '"case_id"' in x]
    assert len(seeds) >= 3 and set(seeds) == {3}, seeds
    # the summary names the draw too (docs/ci.md: "the summary and results name it")
    summary = (tmp_path / "artifacts" / "summary.txt").read_text()
    assert "note: matrix tiny, embedded default backends, seed offset 3;" in summary, summary
