"""Gate tasks as a registry: a second task, registered by a test, runs end to end.

``capitals`` is a small generative task with an exact-match text answer (a country's capital;
one ``remove_whitespace`` filter plays both scoring roles) on an offline data set of a few
lines. ``mlacheck gate capitals run`` evaluates it through lm-eval against the fake OpenAI
server of the gate tests, ``promote`` keeps a baseline and ``compare`` gates candidates
against it, exactly as for GSM8K.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _gate_fakes import FakeServer

from mlacheck.gate import tasks
from mlacheck.gate.cli import main
from mlacheck.gate.compare import report_names
from mlacheck.gate.lmeval_runner import responses_path, score_response
from mlacheck.gate.record import GateRecord
from mlacheck.gate.task import FLEXIBLE, STRICT, GateTask
from mlacheck.gate.tasks import get_task, register_task, task_names
from mlacheck.gate.tasks.gsm8k import GSM8K

pytest.importorskip("lm_eval", reason="needs lm-eval")

CAPITALS_CONFIG: dict[str, Any] = {
    "task": "capitals",
    "dataset_path": "example/capitals",
    "output_type": "generate_until",
    "training_split": "train",
    "fewshot_split": "train",
    "test_split": "test",
    "doc_to_text": "Country: {{country}}\nCapital:",
    "doc_to_target": "{{capital}}",
    "metric_list": [
        {
            "metric": "exact_match",
            "aggregation": "mean",
            "higher_is_better": True,
            "ignore_case": True,
            "ignore_punctuation": True,
        }
    ],
    "generation_kwargs": {"until": ["\n"], "do_sample": False, "temperature": 0.0},
    "num_fewshot": 2,
    "filter_list": [
        {"name": "exact", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}
    ],
    "metadata": {"version": 1.0},
}
CAPITALS = GateTask(
    name="capitals",
    title="Capitals",
    config=CAPITALS_CONFIG,
    question_field="country",
    answer_field="capital",
    role_filters={STRICT: "exact", FLEXIBLE: "exact"},
)

TRAIN = [("Germany", "Berlin"), ("Canada", "Ottawa"), ("Norway", "Oslo")]
TEST = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Egypt", "Cairo"),
        ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Spain", "Madrid")]  # fmt: skip
# The baseline model's answers and whether each is (correct, without an answer): case and
# punctuation are ignored by the task's exact_match; an empty answer is invalid.
BASELINE = [(" Paris", True, False), (" tokyo.", True, False), (" Rome", True, False),
            (" Alexandria", False, False), (" Lima", True, False), ("", False, True),
            (" Santiago", True, False), (" Madrid", True, False)]  # fmt: skip
WORSE = [" Paris"] + [" Berlin"] * (len(TEST) - 1)  # a broken kernel's model

_COUNTRY_RE = re.compile(r"Country: (.*?)\nCapital:$")


@pytest.fixture
def capitals(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Register the task for this test only; return its offline data directory."""
    monkeypatch.setattr(tasks, "_REGISTRY", dict(tasks._REGISTRY))
    register_task(CAPITALS)
    data = tmp_path / "capitals"
    data.mkdir()
    for name, rows in (("train.jsonl", TRAIN), ("test.jsonl", TEST)):
        lines = [json.dumps({"country": c, "capital": k}) for c, k in rows]
        (data / name).write_text("\n".join(lines) + "\n")
    return data


@pytest.fixture
def serve() -> Iterator[Callable[[list[str]], FakeServer]]:
    """Start a fake server answering the test countries, in order, with ``answers``."""
    servers: list[FakeServer] = []

    def start(answers: list[str]) -> FakeServer:
        by_country = {country: text for (country, _), text in zip(TEST, answers, strict=True)}

        def answer(prompt: str) -> str | None:
            m = _COUNTRY_RE.search(prompt.split("\n\n")[-1])
            return by_country.get(m.group(1)) if m else None

        servers.append(FakeServer(answer).__enter__())
        return servers[-1]

    yield start
    for server in servers:
        server.__exit__()


def _run(server: FakeServer, out: Path, data: Path) -> list[str]:
    return ["capitals", "run", "--base-url", server.url, "--model", "fake", "--out", str(out),
            "--data-dir", str(data), "--num-concurrent", "2", "--max-retries", "1"]  # fmt: skip


def test_registered_task_runs_promotes_and_compares(
    tmp_path: Path,
    capitals: Path,
    serve: Callable[[list[str]], FakeServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # run: lm-eval scores the task's own filter; the record is a capitals record
    base_path = tmp_path / "base.json"
    assert main(_run(serve([text for text, _, _ in BASELINE]), base_path, capitals)) == 0
    assert capsys.readouterr().out.startswith("capitals: strict-match 75.00%")
    base = GateRecord.load(base_path)
    assert base.task == "capitals" and base.complete and base.metadata.num_fewshot == 2
    assert json.loads(base_path.read_text())["schema"] == "mlacheck.gate.capitals/1"
    for s in base.samples:
        country, capital = TEST[s.doc_id]
        _, correct, no_answer = BASELINE[s.doc_id]
        assert (s.strict_correct, s.flexible_correct, s.no_number) == (correct, correct, no_answer)
        assert s.target == capital and s.doc_hash == CAPITALS.hash_doc({"country": country})
    assert base.metric(STRICT).accuracy == base.metric(FLEXIBLE).accuracy == 6 / 8
    # the mirror scorer (partial records) agrees with lm-eval on every response
    docs = [{"country": c, "capital": k} for c, k in TEST]
    for line in responses_path(base_path).read_text().splitlines():
        x = json.loads(line)
        mirrored = score_response(x["doc_id"], docs[x["doc_id"]], x["response"], CAPITALS)
        assert mirrored == base.samples[x["doc_id"]]

    # promote, then compare by name: the same answers pass, a broken model's fail
    refs = tmp_path / "refs"
    promote = ["capitals", "promote", str(base_path), "--name", "fake-base", "--reason", "test",
               "--refs-dir", str(refs)]  # fmt: skip
    assert main(promote) == 0
    assert GateRecord.load(refs / "fake-base.json").task == "capitals"
    loose = ["--refs-dir", str(refs), "--margin-points", "50", "--invalid-ceiling-percent", "50"]
    assert main(["capitals", "compare", "fake-base", str(base_path), *loose]) == 0
    capsys.readouterr()
    worse_path = tmp_path / "worse.json"
    assert main(_run(serve(WORSE), worse_path, capitals)) == 0
    capsys.readouterr()
    report = tmp_path / "report"
    compare = ["capitals", "compare", "fake-base", str(worse_path), "--refs-dir", str(refs),
               "--out-dir", str(report)]  # fmt: skip
    assert main(compare) == 1
    assert capsys.readouterr().out.startswith("FAIL capitals strict-match: candidate 12.50%")
    markdown, _, verdict_json = report_names("capitals")
    md = (report / markdown).read_text()
    assert md.startswith("# Capitals gate: FAIL") and "outputs without an answer or looping" in md
    verdict = json.loads((report / verdict_json).read_text())
    assert verdict["task"] == "capitals" and verdict["primary"]["b"] == 5

    # a record of one task is not gated as another's
    assert main(["gsm8k", "compare", str(base_path), str(worse_path)]) == 2
    assert "is a capitals record, not gsm8k" in capsys.readouterr().err


def test_cli_commands_follow_the_registry(
    capitals: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert task_names() == ("gsm8k", "capitals")
    assert main(["--help"]) == 0
    assert "capitals" in capsys.readouterr().out
    assert main(["capitals", "run", "--help"]) == 0
    assert "offline Capitals directory with train.jsonl and test.jsonl" in " ".join(
        capsys.readouterr().out.split()
    )
    assert main(["nope", "run", "--model", "m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mlacheck gate: error: unknown gate task 'nope'; registered: gsm8k, capitals"]


def test_task_definitions_are_checked_when_made() -> None:
    bad = {
        **CAPITALS_CONFIG,
        "output_type": "loglikelihood",
        "filter_list": [{"name": "exact", "filter": [{"function": "majority_vote"}]}],
    }
    with pytest.raises(ValueError, match="only generate_until.*'majority_vote'"):
        replace(CAPITALS, config=bad)
    with pytest.raises(ValueError, match="maps to unknown filter 'strict-match'"):
        replace(CAPITALS, role_filters={STRICT: STRICT, FLEXIBLE: "exact"})
    with pytest.raises(ValueError, match="already registered"):
        register_task(replace(GSM8K, title="Another GSM8K"))
    assert get_task("gsm8k") is GSM8K
