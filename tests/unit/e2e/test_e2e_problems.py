"""Generated problems: GSM8K format, correct arithmetic, deterministic, disjoint splits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mlacheck.e2e import problems as P
from mlacheck.e2e.tokenizer import CharTokenizer, load_tokenizer
from mlacheck.gate.task import STRICT
from mlacheck.gate.tasks.gsm8k import GSM8K, gold_answer

STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)")
OPS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a // b,
}
REPO = Path(__file__).resolve().parents[3]


def test_answers_are_worked_and_right() -> None:
    probs = P.generate(3000, "train") + P.held_out_set(500)
    assert {p.template for p in probs} == set(P.TEMPLATES)
    for p in probs:
        lines = p.answer.split("\n")
        assert lines[-1] == f"#### {p.final}" and p.final >= 0
        steps = [STEP.search(line) for line in lines[:-1]]
        assert all(steps) and 1 <= len(steps) <= 2, p
        for m in steps:
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert OPS[op](a, b) == c and (op != "/" or a % b == 0), p
        assert int(steps[-1][4]) == p.final
        # every number the first step uses comes from the question
        assert {steps[0][1], steps[0][3]} <= set(re.findall(r"\d+", p.question)) | {"2"}, p
        # lm-eval's strict-match filter reads the final answer
        assert GSM8K.extract(f" {p.answer}", STRICT) == gold_answer(p.answer) == str(p.final)
        assert len(P.prompt(p.question)) + len(P.target(p.answer)) + 2 <= 256


def test_deterministic_by_seed_and_splits_disjoint() -> None:
    a, b = P.generate(500, "train", seed=3), P.generate(500, "train", seed=3)
    assert a == b and a != P.generate(500, "train", seed=4)
    train = P.generate(20000, "train")
    test = P.held_out_set(500)
    assert len({p.question for p in test}) == 500
    assert all(P.split_of(p.template, p.numbers) == "test" for p in test)
    assert not {p.key for p in test} & {p.key for p in train}
    assert not {p.question for p in test} & {p.question for p in train}
    assert P.held_out_set(100) == test[:100]  # a --limit takes a prefix of the same set
    with pytest.raises(ValueError, match="split"):
        P.generate(1, "valid")


def test_data_dir_is_what_the_gate_reads(tmp_path: Path) -> None:
    d = P.write_gsm8k_dir(tmp_path / "data", n_train=10, n_test=30)
    assert GSM8K.check_data_dir(d, 0).startswith("json:")
    rows = [json.loads(x) for x in (d / "test.jsonl").read_text().splitlines()]
    assert [r["question"] for r in rows] == [p.question for p in P.held_out_set(30)]


def test_tokenizer_round_trip_and_committed_vocab(tmp_path: Path) -> None:
    tok = CharTokenizer()
    text = P.prompt("Mia has 3 apples.") + P.target("3 + 5 = 8\n#### 8")
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
    assert tok.decode(tok.encode("caf\u00e9")) == "caf"  # unknown -> <unk>, dropped on decode
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).encode(text) == ids
    committed = json.loads((REPO / "references" / "e2e_model" / "tokenizer.json").read_text())
    assert committed == tok.to_json()


def test_e2e_package_does_not_import_lm_eval_or_safetensors() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import mlacheck.e2e, mlacheck.e2e.runner, mlacheck.e2e.checkpoint, mlacheck.e2e.problems\n"
        "import mlacheck.e2e.evaluate, mlacheck.e2e.tokenizer, mlacheck.e2e.__main__\n"
        "opt = ('lm_eval', 'safetensors', 'transformers', 'tokenizers')\n"
        "bad = [m for m in opt if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_answers_fit_the_e2e_gate_generation_budget() -> None:
    """tests/e2e runs with max_gen_toks 96: every answer (with its leading space) fits."""
    longest = max(len(P.target(p.answer)) for p in P.generate(20000, "train") + P.held_out_set(500))
    assert longest < 96
