"""Run records: JSON round trip, validation, lm-eval results conversion."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from mlacheck.gate.errors import GateError
from mlacheck.gate.record import (
    SCHEMA,
    GateRecord,
    MetricSummary,
    Provenance,
    RunMetadata,
    record_from_lmeval_results,
)
from mlacheck.gate.task import FLEXIBLE, STRICT


def test_round_trip(tmp_path: Path, record_factory: Callable[..., GateRecord]) -> None:
    rec = record_factory(
        [True, False, True], flexible=[True, True, True], invalid=[False, True, False]
    )
    rec = replace(
        rec,
        metadata=replace(
            rec.metadata,
            kv_dtype="fp8_e4m3",
            extra={"gpu": "MI300X"},
            versions={"lm_eval": "0.4.13"},
        ),
    ).with_provenance(Provenance("base", "alice", "2026-01-01T00:00:00+00:00", "release", "r.json"))
    path = tmp_path / "sub" / "run.json"
    rec.save(path)
    loaded = GateRecord.load(path)
    assert loaded == rec
    assert loaded.metric(STRICT).accuracy == pytest.approx(2 / 3)
    assert loaded.metric(FLEXIBLE).successes == 3
    assert loaded.invalid_count() == 1
    text = path.read_text()
    assert json.loads(text)["schema"] == SCHEMA
    # one sample per line
    assert sum(line.strip().startswith('{"doc_id"') for line in text.splitlines()) == 3


def test_aborted_record_round_trip(
    tmp_path: Path, record_factory: Callable[..., GateRecord]
) -> None:
    rec = record_factory([True, True], failed_requests=3)
    assert not rec.complete and rec.n_planned == 5
    rec.save(tmp_path / "a.json")
    assert GateRecord.load(tmp_path / "a.json") == rec


def test_aggregate_only_round_trip(tmp_path: Path) -> None:
    rec = GateRecord(
        metadata=RunMetadata(model="published", backend="lm-eval-results"),
        metrics={
            STRICT: MetricSummary(0.8, 0.011, 1319),
            FLEXIBLE: MetricSummary(0.81, None, 1319),
        },
        n_planned=1319,
    )
    rec.save(tmp_path / "agg.json")
    loaded = GateRecord.load(tmp_path / "agg.json")
    assert loaded == rec and not loaded.has_samples
    assert loaded.metric(STRICT).successes == 1055


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("{not json", "cannot read JSON"),
        ("[]", "not a gate record"),
        ('{"schema": "other/1"}', "unsupported schema"),
        (json.dumps({"schema": SCHEMA, "status": "complete"}), "not a valid gate record"),
    ],
)
def test_load_errors_are_one_line_gate_errors(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(GateError, match=fragment) as info:
        GateRecord.load(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_load_rejects_duplicate_docs(
    tmp_path: Path, record_factory: Callable[..., GateRecord]
) -> None:
    rec = record_factory([True, False])
    data = rec.to_json_dict()
    data["samples"][1]["doc_id"] = 0
    (tmp_path / "dup.json").write_text(json.dumps(data))
    with pytest.raises(GateError, match="duplicate doc_id"):
        GateRecord.load(tmp_path / "dup.json")
    with pytest.raises(GateError, match="no such file"):
        GateRecord.load(tmp_path / "missing.json")


def test_record_from_lmeval_results() -> None:
    data = {
        "results": {
            "gsm8k": {
                "exact_match,strict-match": 0.75,
                "exact_match_stderr,strict-match": 0.0119,
                "exact_match,flexible-extract": 0.76,
                "exact_match_stderr,flexible-extract": "N/A",
            }
        },
        "n-samples": {"gsm8k": {"original": 1319, "effective": 1319}},
        "n-shot": {"gsm8k": 5},
        "config": {"model": "local-completions", "model_args": "model=ds,base_url=x"},
    }
    rec = record_from_lmeval_results(data, "results.json")
    assert not rec.has_samples and rec.complete
    assert rec.metric(STRICT) == MetricSummary(0.75, 0.0119, 1319)
    assert rec.metric(FLEXIBLE).stderr is None
    assert rec.metadata.num_fewshot == 5
    with pytest.raises(GateError, match="not an lm-eval results file"):
        record_from_lmeval_results({"results": {"mmlu": {}}}, "x.json")
