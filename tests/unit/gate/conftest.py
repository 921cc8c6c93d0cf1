"""Shared fixtures of the GSM8K gate tests: a tiny offline GSM8K data set, canned answers of
known correctness, and a factory for synthetic run records."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlacheck.gate.record import (
    STATUS_ABORTED,
    STATUS_COMPLETE,
    GateRecord,
    RunMetadata,
    SampleRecord,
    metrics_from_samples,
)
from mlacheck.gate.task import doc_hash

N_TRAIN = 5
N_TEST = 12

# Canned kinds of answer and their expected (strict-match, flexible-extract) correctness,
# no-number flag and degenerate flag.
RIGHT = "right"  # "... #### gold"
WRONG = "wrong"  # "... #### gold+1"
LOST_FORMAT = "lost-format"  # right number, no "####": strict wrong, flexible right
NO_NUMBER = "no-number"
LOOPING = "looping"  # repetition loop without a number
EXPECTED = {
    RIGHT: (True, True, False, False),
    WRONG: (False, False, False, False),
    LOST_FORMAT: (False, True, False, False),
    NO_NUMBER: (False, False, True, False),
    LOOPING: (False, False, True, True),
}
# The kind the fake model answers for each test doc id.
KINDS = [
    RIGHT,
    WRONG,
    RIGHT,
    LOST_FORMAT,
    RIGHT,
    NO_NUMBER,
    WRONG,
    RIGHT,
    LOOPING,
    RIGHT,
    WRONG,
    RIGHT,
]
assert len(KINDS) == N_TEST


def _doc(i: int, offset: int) -> dict[str, str]:
    a, b = i + offset, 2 * i + 3
    return {
        "question": f"Ann has {a} apples and gets {b} more. How many apples does she have?",
        "answer": f"Ann has {a} + {b} = {a + b} apples.\n#### {a + b}",
    }


def canned_response(kind: str, answer: str) -> str:
    gold = int(answer.split("#### ")[-1])
    if kind == RIGHT:
        return f" She has {gold} apples.\n#### {gold}"
    if kind == WRONG:
        return f" She has {gold + 1} apples.\n#### {gold + 1}"
    if kind == LOST_FORMAT:
        return f" She has {gold}."
    if kind == NO_NUMBER:
        return " I cannot tell."
    if kind == LOOPING:
        return " apples" + " and more apples" * 40
    raise ValueError(kind)


@dataclass(frozen=True)
class Gsm8kCase:
    """A tiny offline GSM8K data set and the fake model's answers to it."""

    data_dir: Path
    train: tuple[dict[str, str], ...]
    test: tuple[dict[str, str], ...]
    kinds: tuple[str, ...] = tuple(KINDS)

    def answer(self, doc_id: int, doc: dict[str, str]) -> str:
        return canned_response(self.kinds[doc_id], doc["answer"])

    def expected(self, doc_id: int) -> tuple[bool, bool, bool, bool]:
        """(strict correct, flexible correct, no number, degenerate)."""
        return EXPECTED[self.kinds[doc_id]]

    def accuracy(self, column: int) -> float:
        return sum(EXPECTED[k][column] for k in self.kinds) / len(self.kinds)


@pytest.fixture(scope="session")
def gsm8k(tmp_path_factory: pytest.TempPathFactory) -> Gsm8kCase:
    d = tmp_path_factory.mktemp("gsm8k")
    train = tuple(_doc(i, 1) for i in range(N_TRAIN))
    test = tuple(_doc(i, 100) for i in range(N_TEST))
    for name, docs in (("train", train), ("test", test)):
        with (d / f"{name}.jsonl").open("w") as f:
            for doc in docs:
                f.write(json.dumps(doc) + "\n")
    return Gsm8kCase(d, train, test)


def make_record(
    correct: Sequence[bool],
    *,
    flexible: Sequence[bool] | None = None,
    invalid: Sequence[bool] | None = None,
    status: str = STATUS_COMPLETE,
    failed_requests: int = 0,
    hashes: Sequence[str] | None = None,
    doc_ids: Sequence[int] | None = None,
    protocol: str = "p" * 64,
    num_fewshot: int = 5,
    model: str = "m",
) -> GateRecord:
    """A synthetic record: per-doc strict-match correctness ``correct``."""
    flexible = list(correct) if flexible is None else list(flexible)
    invalid = [False] * len(correct) if invalid is None else list(invalid)
    ids = list(range(len(correct))) if doc_ids is None else list(doc_ids)
    samples = tuple(
        SampleRecord(
            doc_id=i,
            doc_hash=hashes[k] if hashes is not None else doc_hash(f"question {i}"),
            target="1",
            strict_correct=ok,
            flexible_correct=fx,
            strict_answer="1" if ok else "2",
            flexible_answer="[invalid]" if bad else ("1" if fx else "2"),
            no_number=bad,
            degenerate=False,
        )
        for k, (i, ok, fx, bad) in enumerate(zip(ids, correct, flexible, invalid, strict=True))
    )
    return GateRecord(
        metadata=RunMetadata(
            model=model, backend="test", num_fewshot=num_fewshot, protocol_sha256=protocol
        ),
        metrics=metrics_from_samples(samples),
        n_planned=len(samples) + failed_requests,
        samples=samples,
        status=STATUS_ABORTED if failed_requests else status,
        failed_requests=failed_requests,
        error="ClientConnectorError: boom" if failed_requests else None,
    )


@pytest.fixture
def record_factory() -> Callable[..., GateRecord]:
    return make_record
