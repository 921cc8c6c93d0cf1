"""`mlacheck run --shard K/N` (issue 27): a partition of the selection, the same on every runner,
balanced by estimated time, stable under --resume; each shard's header says which run it is
part of."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlacheck import cost, shard
from mlacheck.matrices import load

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"

SIX = """
name: six
description: six small cases of different sizes for the shard tests
groups:
  - name: decode
    kind: decode
    base: {requests: [[1, 70], [2, 130]], page_size: 16}
    axes:
      num_heads: [16, 32, 64]
  - name: prefill
    kind: prefill
    base: {segments: [[20, 10], [24, 0]]}
    axes:
      num_heads: [8, 16, 32]
"""


def mlacheck(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(FIXTURES), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "mlacheck.cli", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def _lines(path: Path) -> tuple[list[dict], list[dict]]:
    docs = [json.loads(x) for x in path.read_text().splitlines()]
    return ([d["run"] for d in docs if "mlacheck_results" in d],
            [d for d in docs if "mlacheck_results" not in d])


# --------------------------------------------------------------------------- the partition


@pytest.mark.parametrize("matrix", ["premerge", "nightly"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_shards_are_a_balanced_partition_for_any_n(matrix: str, n: int) -> None:
    backends = ["torch", "aiter-model", "aiter-triton"]
    costs = {mc.case.id: cost.case_s(mc.case, backends) for mc in load(matrix).cases}
    parts = shard.partition(costs, n)
    every = [u for p in parts for u in p]
    assert sorted(every) == sorted(costs) and len(every) == len(set(every))  # exactly once
    assert parts == shard.partition(dict(reversed(costs.items())), n)  # not order-dependent
    loads = [sum(costs[u] for u in p) for p in parts]
    # LPT: no shard exceeds the least loaded one by more than the largest single case
    assert max(loads) - min(loads) <= max(costs.values()) + 1e-9
    for k in range(1, n + 1):
        assert shard.units_of(shard.Shard(k, n), costs) == set(parts[k - 1])


def test_shard_spec_is_checked() -> None:
    assert str(shard.parse(" 2 / 4 ")) == "2/4"
    for bad in ("0/4", "5/4", "2", "a/b", ""):
        with pytest.raises(shard.ShardError):
            shard.parse(bad)


def test_the_run_key_names_what_makes_shards_one_run() -> None:
    base = dict(matrix="six", seed=None, backends=["torch"], keyword="", markexpr="", count=3,
                case_ids=["a", "b"])
    key = shard.run_key(**base)
    assert key == shard.run_key(**{**base, "case_ids": ["b", "a"]})
    for change in ({"seed": 1}, {"backends": ["torch", "x"]}, {"markexpr": "not slow"},
                   {"count": 4}, {"case_ids": ["a"]}, {"keyword": "dec"}):
        assert shard.run_key(**{**base, **change}) != key, change


# --------------------------------------------------------------------------- end to end


def test_shards_run_the_matrix_once_between_them(tmp_path: Path) -> None:
    matrix = tmp_path / "six.yaml"
    matrix.write_text(SIX)
    args = ["run", "-b", "torch", "--matrix", str(matrix), "--no-report", "--workers", "1"]
    whole = tmp_path / "whole.jsonl"
    r = mlacheck(*args, "--results", str(whole))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    _, all_recs = _lines(whole)
    seen: list[str] = []
    keys = set()
    for k in (1, 2, 3):
        res = tmp_path / f"shard{k}.jsonl"
        r = mlacheck(*args, "--results", str(res), "--shard", f"{k}/3")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert f"shard {k}/3 of its cases" in r.stdout
        (header,), recs = _lines(res)
        assert header["shard"] == f"{k}/3" and header["matrix"] == "six"
        keys.add(header["run_key"])
        assert sorted(c for _, c in header["expected"]) == sorted(x["case_id"] for x in recs)
        seen += [x["case_id"] for x in recs]
    assert len(keys) == 1  # one run
    assert sorted(seen) == sorted(x["case_id"] for x in all_recs)  # each item exactly once
    merged = tmp_path / "merged" / "results.jsonl"
    shards = [str(tmp_path / f"shard{k}.jsonl") for k in (1, 2, 3)]
    r = mlacheck("merge", *shards, "--results", str(merged))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "3 of 3 file(s) merged" in r.stdout and "6 of 6 item(s) with a verdict" in r.stdout
    assert sorted(x["case_id"] for x in _lines(merged)[1]) == sorted(seen)
    assert (merged.parent / "report.html").is_file()
    r = mlacheck("merge", shards[0], shards[2], "--results", str(merged))
    assert r.returncode == 6 and "INCOMPLETE: shard(s) 2/3 missing" in r.stdout


def test_a_resumed_shard_keeps_its_cases(tmp_path: Path) -> None:
    """--resume leaves out what has a verdict after the partition, not before it: a resumed
    shard must not take another shard's cases."""
    matrix = tmp_path / "six.yaml"
    matrix.write_text(SIX)
    res = tmp_path / "s.jsonl"
    args = ["run", "-b", "torch", "--matrix", str(matrix), "--no-report", "--workers", "1",
            "--results", str(res), "--shard", "2/2"]
    r = mlacheck(*args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (header,), recs = _lines(res)
    mine = sorted(x["case_id"] for x in recs)
    lines = res.read_text().splitlines()
    res.write_text("\n".join(lines[:2]) + "\n")  # the header and one verdict: interrupted
    r = mlacheck(*args, "--resume")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    headers, recs = _lines(res)
    assert sorted(x["case_id"] for x in recs) == mine
    assert headers[1]["run_key"] == header["run_key"] and len(headers[1]["expected"]) == len(mine) - 1


def test_join_finds_the_missing_and_the_foreign_shards() -> None:
    def f(path: str, k: int, n: int = 3, key: str = "run") -> shard.ShardFile:
        return shard.ShardFile(path, (f"{k}/{n}",), (key,))

    whole = shard.join([f("a", 1), f("b", 2), f("c", 3)])
    assert whole.members == ["a", "b", "c"] and whole.problems == []
    resumed = shard.join([shard.ShardFile("a", ("1/2", "1/2"), ("run", "run")), f("b", 2, 2)])
    assert resumed.problems == []
    missing = shard.join([f("a", 1), f("c", 3)])
    assert missing.problems == ["INCOMPLETE: shard(s) 2/3 missing (2 of 3 merged)"]
    foreign = shard.join([f("a", 1), f("x", 2, key="other"), f("c", 3)])
    assert foreign.members == ["a", "c"]
    assert foreign.problems[0].startswith("x is a shard of another run (run key other, not run)")
    assert "shard(s) 2/3 missing" in foreign.problems[1]
    plain = shard.join([f("a", 1, 1), shard.ShardFile("p", ("",), ("",))])
    assert plain.members == ["a"] and plain.problems == [
        "p is not a shard (no --shard run header): left out"]
    assert shard.join([]).problems == ["no shard of a split run among the files"]


# --------------------------------------------------------------------------- merge


def _write_run(path: Path, items: list[tuple[str, str, str, bool]], shard_of: str = "",
               key: str = "") -> None:
    """A results file: a header naming `items` (backend, case, status, known), their lines."""
    from mlacheck import results

    header = results.new_header([(b, c) for b, c, _, _ in items], sorted({b for b, *_ in items}),
                                "six", "cpu", 1, shard_of, key)
    path.write_text(header.to_line() + "".join(
        json.dumps({"case_id": c, "backend": b, "op": "mla_decode", "status": s,
                    "known_failure": "a documented finding" if k else ""}) + "\n"
        for b, c, s, k in items))


@pytest.mark.parametrize("statuses, code", [
    (["PASS"] * 6, 0),
    (["PASS", "PASS", "FAIL", "PASS", "SKIP", "PASS"], 1),  # a FAIL in one shard
    (["PASS", ("FAIL", True), "PASS", "PASS", "PASS", "SKIP"], 0),  # a KNOWN failure
    (["PASS", "PASS", "PASS", ("PASS", True), "PASS", "PASS"], 1),  # a strict XPASS
    (["PASS", "ERROR", "PASS", "PASS", "PASS", "PASS"], 3),
], ids=["pass", "fail", "known", "xpass", "suite-error"])
def test_merged_shards_exit_as_the_single_run(tmp_path: Path, statuses: list, code: int) -> None:
    from mlacheck import merge
    from mlacheck.session import RunRequest, outcome

    torch = RunRequest(backends=("torch",))

    items = [("torch", f"case{i}", *(s if isinstance(s, tuple) else (s, False)))
             for i, s in enumerate(statuses)]
    single = tmp_path / "single.jsonl"
    _write_run(single, items)
    assert outcome(single, torch).code == code
    shards = [tmp_path / f"s{k}.jsonl" for k in (1, 2, 3)]
    for k, path in enumerate(shards):
        _write_run(path, items[2 * k: 2 * k + 2], f"{k + 1}/3", "run-a")
    out = tmp_path / "merged" / "results.jsonl"
    assert merge.main([*map(str, shards), "--results", str(out), "--no-report"]) == code
    merged = json.loads(json.dumps([x for x in _lines(out)[1]]))
    assert sorted(x["case_id"] for x in merged) == [c for _, c, _, _ in items]
    # a shard missing: as a single run that stopped before its items: INCOMPLETE (6), unless a
    # failure on record wins
    stopped = tmp_path / "stopped.jsonl"
    _write_run(stopped, items)
    kept = [line for line in stopped.read_text().splitlines()
            if '"case2"' not in line and '"case3"' not in line or "mlacheck_results" in line]
    stopped.write_text("\n".join(kept) + "\n")
    single_code = outcome(stopped, torch).code
    assert single_code in (1, 3, 6)
    assert merge.main([str(shards[0]), str(shards[2]), "--results", str(out),
                       "--no-report"]) == single_code


def test_merge_names_missing_and_foreign_shards(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from mlacheck import merge

    items = [("torch", f"case{i}", "PASS", False) for i in range(4)]
    a, b, other = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "other.jsonl"
    _write_run(a, items[:2], "1/2", "run-a")
    _write_run(b, items[2:], "2/2", "run-a")
    _write_run(other, items[2:], "2/2", "run-b")  # the same shard of another run
    out = tmp_path / "m.jsonl"
    assert merge.main([str(a), str(b), "--results", str(out), "--no-report"]) == 0
    assert merge.main([str(a), str(other), "--results", str(out), "--no-report"]) == 6
    text = capsys.readouterr().out
    assert "is a shard of another run (run key run-b, not run-a): left out" in text
    assert "INCOMPLETE: shard(s) 2/2 missing (1 of 2 merged)" in text
    assert merge.main([str(a), str(tmp_path / "gone.jsonl"), "--results", str(out),
                       "--no-report"]) == 6
    assert "gone.jsonl: no such results file" in capsys.readouterr().out
    assert merge.main([str(a), "--results", str(a)]) == 2  # never over its own input
