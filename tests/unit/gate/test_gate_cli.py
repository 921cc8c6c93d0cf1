"""``mlacheck gate gsm8k compare|promote`` and CLI error handling."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mlacheck.gate.cli import main
from mlacheck.gate.compare import REPORT_JSON, REPORT_MARKDOWN, REPORT_PLOT
from mlacheck.gate.record import GateRecord

Factory = Callable[..., GateRecord]
N = 1319


def _save(path: Path, record: GateRecord) -> Path:
    record.save(path)
    return path


@pytest.fixture
def runs(tmp_path: Path, record_factory: Factory) -> dict[str, Path]:
    base = [i < 1050 for i in range(N)]
    equal = list(base)
    for i in range(25):  # 25 flips each way
        equal[i], equal[1050 + i] = False, True
    worse = list(base)
    for i in range(70):
        worse[i] = False
    return {
        "base": _save(tmp_path / "base.json", record_factory(base)),
        "equal": _save(tmp_path / "equal.json", record_factory(equal)),
        "worse": _save(tmp_path / "worse.json", record_factory(worse)),
        "aborted": _save(tmp_path / "aborted.json", record_factory(base[:100], failed_requests=3)),
    }


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlacheck gate: error: "), err
    return err[0]


def test_compare_exit_codes(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gsm8k", "compare", str(runs["base"]), str(runs["equal"])]) == 0
    assert capsys.readouterr().out.startswith("# GSM8K gate: PASS")
    assert main(["gsm8k", "compare", str(runs["base"]), str(runs["worse"])]) == 1
    assert capsys.readouterr().out.startswith("# GSM8K gate: FAIL")
    assert main(["gsm8k", "compare", str(runs["base"]), str(runs["aborted"])]) == 1
    # the worse run passes a 10-point margin
    args = ["gsm8k", "compare", str(runs["base"]), str(runs["worse"]), "--margin-points", "10"]
    assert main(args) == 0


def test_compare_writes_report(
    tmp_path: Path, runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert (
        main(["gsm8k", "compare", str(runs["base"]), str(runs["worse"]), "--out-dir", str(out)])
        == 1
    )
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0].startswith("FAIL gsm8k strict-match") and "b=70, c=0" in stdout[0]
    md = (out / REPORT_MARKDOWN).read_text()
    assert md.startswith("# GSM8K gate: FAIL") and "## Power" in md
    verdict = json.loads((out / REPORT_JSON).read_text())
    assert verdict["passed"] is False and verdict["primary"]["b"] == 70
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (out / REPORT_PLOT).exists() is has_matplotlib
    assert (f"]({REPORT_PLOT})" in md) is has_matplotlib


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["gsm8k", "compare", "missing.json", "also-missing.json"], "no such file"),
        (["gsm8k", "compare"], "the following arguments are required"),
        (["gsm8k", "frobnicate"], "invalid choice"),
        (["gsm8k", "compare", "BASE", "CAND", "--margin-points", "abc"], "invalid float value"),
        (["gsm8k", "compare", "BASE", "CAND", "--alpha", "0.7"], "alpha must lie in"),
        (["gsm8k", "run", "--base-url", "ftp://x", "--model", "m", "--out", "o.json"], "http(s)"),
        (["gsm8k", "promote", "BASE", "--name", "../evil", "--reason", "r"], "baseline name"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    argv: list[str], fragment: str, runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        str(runs["base"]) if a == "BASE" else str(runs["equal"]) if a == "CAND" else a for a in argv
    ]
    assert main(argv) == 2
    assert fragment in _one_error_line(capsys)


def test_incomparable_runs_exit_2(
    tmp_path: Path,
    runs: dict[str, Path],
    record_factory: Factory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    other = _save(tmp_path / "other.json", record_factory([True] * N, protocol="x" * 64))
    assert main(["gsm8k", "compare", str(runs["base"]), str(other)]) == 2
    assert "different task protocol" in _one_error_line(capsys)


def test_help_returns_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gsm8k", "compare", "--help"]) == 0
    assert "--margin-points" in capsys.readouterr().out


def test_promote_and_compare_by_name(
    tmp_path: Path, runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    refs = tmp_path / "refs"
    argv = ["gsm8k", "promote", str(runs["base"]), "--name", "dsv3-bf16", "--reason",
            "bf16 reference on MI300X", "--by", "alice", "--refs-dir", str(refs)]  # fmt: skip
    assert main(argv) == 0
    promoted = GateRecord.load(refs / "dsv3-bf16.json")
    assert promoted.provenance is not None
    assert (promoted.provenance.name, promoted.provenance.promoted_by) == ("dsv3-bf16", "alice")
    assert promoted.provenance.reason == "bf16 reference on MI300X"
    assert promoted.provenance.source == str(runs["base"]) and promoted.provenance.promoted_at
    assert promoted.samples == GateRecord.load(runs["base"]).samples
    capsys.readouterr()
    # no silent overwrite
    assert main(argv) == 2
    assert "exists; pass --force" in _one_error_line(capsys)
    assert main([*argv, "--force"]) == 0
    # a baseline is found by name
    compare = ["gsm8k", "compare", "dsv3-bf16", str(runs["equal"]), "--refs-dir", str(refs)]
    assert main(compare) == 0
    assert "promoted by alice" in capsys.readouterr().out


def test_promote_refuses_aborted_run(
    tmp_path: Path, runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["gsm8k", "promote", str(runs["aborted"]), "--name", "x", "--reason", "r",
            "--refs-dir", str(tmp_path / "refs")]  # fmt: skip
    assert main(argv) == 2
    assert "only a complete run" in _one_error_line(capsys)
    assert not (tmp_path / "refs" / "x.json").exists()


def test_promote_lm_eval_results_gives_unpaired_baseline(
    tmp_path: Path, runs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results_2026.json"
    results.write_text(
        json.dumps(
            {
                "results": {
                    "gsm8k": {
                        "exact_match,strict-match": 1050 / N,
                        "exact_match_stderr,strict-match": 0.011,
                        "exact_match,flexible-extract": 1060 / N,
                        "exact_match_stderr,flexible-extract": 0.011,
                    }
                },
                "n-samples": {"gsm8k": {"original": N, "effective": N}},
                "n-shot": {"gsm8k": 5},
                "config": {"model": "local-completions", "model_args": "model=ds"},
            }
        )
    )
    refs = tmp_path / "refs"
    argv = ["gsm8k", "promote", str(results), "--name", "published", "--reason", "paper",
            "--refs-dir", str(refs)]  # fmt: skip
    assert main(argv) == 0
    assert "aggregate-only" in capsys.readouterr().out
    compare = ["gsm8k", "compare", "published", str(runs["equal"]), "--refs-dir", str(refs),
               "--margin-points", "4"]  # fmt: skip
    assert main(compare) == 0
    out = capsys.readouterr().out
    assert "| strict-match (gate) | unpaired |" in out and "unpaired comparison" in out
