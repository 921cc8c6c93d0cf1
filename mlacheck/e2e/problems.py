"""Arithmetic word problems in GSM8K's format, for the small e2e model.

Each problem is one of a few sentence templates with small numbers and one or two operations
(+, -, *, exact /); the answer spells the computation out, one line per step, and ends with
GSM8K's `#### N` line, e.g.

    Question: Mia has 12 apples. She buys 7 more and then gives 5 to Leo. How many apples
              does Mia have now?
    Answer:   Mia has 12 + 7 = 19 apples.
              Then Mia has 19 - 5 = 14 apples.
              #### 14

Deterministic by seed (Python's `random.Random`, seeded with a string). The held-out test
split is disjoint from train by construction: a problem's *key* is its template and its
numbers, the key's hash puts it in train or test (TEST_PERCENT of the key space is test), and
each split only ever draws keys of its own side, so no test question (not even with other
names or objects) occurs in training.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

TEST_PERCENT = 10
DEFAULT_SEED = 0
SPLITS = ("train", "test")

NAMES = (
    ("Mia", "She"),
    ("Leo", "He"),
    ("Ava", "She"),
    ("Sam", "He"),
    ("Zoe", "She"),
    ("Max", "He"),
    ("Lily", "She"),
    ("Ben", "He"),
    ("Emma", "She"),
    ("Tom", "He"),
    ("Nora", "She"),
    ("Jack", "He"),
    ("Ella", "She"),
    ("Owen", "He"),
    ("Ruby", "She"),
    ("Liam", "He"),
)
OBJECTS = (
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "cookies",
    "books",
    "cards",
    "shells",
    "toys",
    "stamps",
    "balloons",
    "candies",
    "eggs",
    "flowers",
    "coins",
    "crayons",
)
ITEMS = (
    ("notebook", "notebooks"),
    ("pen", "pens"),
    ("toy car", "toy cars"),
    ("sandwich", "sandwiches"),
    ("ticket", "tickets"),
    ("ball", "balls"),
    ("mug", "mugs"),
    ("kite", "kites"),
)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # worked steps, then "#### N"
    final: int
    template: str
    numbers: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"{self.template}:{','.join(map(str, self.numbers))}"

    def to_gsm8k(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.answer}


def split_of(template: str, numbers: tuple[int, ...]) -> str:
    """Which split a (template, numbers) key belongs to (a hash: fixed forever)."""
    key = f"{template}:{','.join(map(str, numbers))}"
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return "test" if h % 100 < TEST_PERCENT else "train"


@dataclass(frozen=True)
class _Ctx:
    name: str
    pron: str
    name2: str
    obj: str
    item: tuple[str, str]


Drawn = tuple[tuple[int, ...], str, str, int]  # numbers, question, answer body, final
Template = Callable[[random.Random, _Ctx], Drawn | None]


def _add_buy(r: random.Random, c: _Ctx) -> Drawn:
    a, b = r.randint(2, 60), r.randint(2, 40)
    q = (
        f"{c.name} has {a} {c.obj}. {c.pron} buys {b} more. "
        f"How many {c.obj} does {c.name} have now?"
    )
    return (a, b), q, f"{c.name} has {a} + {b} = {a + b} {c.obj} now.", a + b


def _add_bags(r: random.Random, c: _Ctx) -> Drawn:
    a, b = r.randint(2, 50), r.randint(2, 50)
    q = (
        f"{c.name} has {a} {c.obj} in one bag and {b} {c.obj} in another bag. "
        f"How many {c.obj} does {c.name} have altogether?"
    )
    return (a, b), q, f"{c.name} has {a} + {b} = {a + b} {c.obj} altogether.", a + b


def _sub_give(r: random.Random, c: _Ctx) -> Drawn:
    a = r.randint(10, 90)
    b = r.randint(2, a - 2)
    q = (
        f"{c.name} had {a} {c.obj}. {c.pron} gave {b} of them to {c.name2}. "
        f"How many {c.obj} does {c.name} have left?"
    )
    return (a, b), q, f"{c.name} has {a} - {b} = {a - b} {c.obj} left.", a - b


def _sub_compare(r: random.Random, c: _Ctx) -> Drawn:
    a = r.randint(10, 90)
    b = r.randint(2, a - 2)
    q = (
        f"{c.name} has {a} {c.obj} and {c.name2} has {b} {c.obj}. "
        f"How many more {c.obj} does {c.name} have than {c.name2}?"
    )
    return (a, b), q, f"{c.name} has {a} - {b} = {a - b} more {c.obj}.", a - b


def _mul_boxes(r: random.Random, c: _Ctx) -> Drawn:
    a, b = r.randint(2, 12), r.randint(2, 12)
    q = f"There are {a} boxes. Each box has {b} {c.obj}. How many {c.obj} are there in all?"
    return (a, b), q, f"There are {a} * {b} = {a * b} {c.obj} in all.", a * b


def _mul_pages(r: random.Random, c: _Ctx) -> Drawn:
    a, b = r.randint(2, 12), r.randint(2, 10)
    q = f"{c.name} reads {a} pages every day. How many pages does {c.name} read in {b} days?"
    return (a, b), q, f"{c.name} reads {a} * {b} = {a * b} pages.", a * b


def _div_share(r: random.Random, c: _Ctx) -> Drawn:
    b, res = r.randint(2, 10), r.randint(2, 12)
    a = b * res
    q = (
        f"{c.name} shares {a} {c.obj} equally among {b} friends. "
        f"How many {c.obj} does each friend get?"
    )
    return (a, b), q, f"Each friend gets {a} / {b} = {res} {c.obj}.", res


def _half(r: random.Random, c: _Ctx) -> Drawn:
    a = 2 * r.randint(2, 50)
    q = (
        f"{c.name} had {a} {c.obj} and gave half of them to {c.name2}. "
        f"How many {c.obj} does {c.name} have left?"
    )
    return (a,), q, f"{c.name} has {a} / 2 = {a // 2} {c.obj} left.", a // 2


def _buy_give(r: random.Random, c: _Ctx) -> Drawn | None:
    a, b = r.randint(5, 50), r.randint(2, 30)
    s = a + b
    k = r.randint(2, s - 2)
    q = (
        f"{c.name} has {a} {c.obj}. {c.pron} buys {b} more and then gives {k} to {c.name2}. "
        f"How many {c.obj} does {c.name} have now?"
    )
    body = f"{c.name} has {a} + {b} = {s} {c.obj}.\nThen {c.name} has {s} - {k} = {s - k} {c.obj}."
    return (a, b, k), q, body, s - k


def _packs_plus(r: random.Random, c: _Ctx) -> Drawn:
    a, b, k = r.randint(2, 9), r.randint(2, 10), r.randint(2, 30)
    s = a * b
    q = (
        f"{c.name} buys {a} packs of {c.obj}. Each pack has {b} {c.obj}. {c.pron} already had "
        f"{k} {c.obj}. How many {c.obj} does {c.name} have now?"
    )
    body = f"The packs have {a} * {b} = {s} {c.obj}.\n{c.name} has {s} + {k} = {s + k} {c.obj} now."
    return (a, b, k), q, body, s + k


def _change(r: random.Random, c: _Ctx) -> Drawn | None:
    p, n = r.randint(2, 12), r.randint(2, 8)
    s = p * n
    bills = [m for m in (20, 50, 100) if m > s + 1]
    if not bills:
        return None
    m = r.choice(bills)
    one, many = c.item
    q = (
        f"A {one} costs ${p}. {c.name} buys {n} {many} and pays with a ${m} bill. "
        f"How much change does {c.name} get?"
    )
    body = f"The {many} cost {n} * {p} = ${s}.\nThe change is {m} - {s} = ${m - s}."
    return (p, n, m), q, body, m - s


def _wage_spend(r: random.Random, c: _Ctx) -> Drawn:
    w, h = r.randint(5, 15), r.randint(2, 8)
    s = w * h
    k = r.randint(2, s - 2)
    q = (
        f"{c.name} earns ${w} per hour and works {h} hours. Then {c.pron.lower()} spends ${k}. "
        f"How much money does {c.name} have left?"
    )
    body = f"{c.name} earns {w} * {h} = ${s}.\n{c.name} has {s} - {k} = ${s - k} left."
    return (w, h, k), q, body, s - k


def _times_together(r: random.Random, c: _Ctx) -> Drawn:
    a, b = r.randint(2, 15), r.randint(2, 5)
    s = a * b
    q = (
        f"{c.name} has {a} {c.obj}. {c.name2} has {b} times as many {c.obj} as {c.name}. "
        f"How many {c.obj} do they have together?"
    )
    body = (
        f"{c.name2} has {a} * {b} = {s} {c.obj}.\nTogether they have {a} + {s} = {a + s} {c.obj}."
    )
    return (a, b), q, body, a + s


def _buy_share(r: random.Random, c: _Ctx) -> Drawn:
    b, res = r.randint(2, 6), r.randint(2, 10)
    t = b * res
    a = r.randint(1, t - 1)
    k = t - a
    q = (
        f"{c.name} has {a} {c.obj} and buys {k} more. {c.pron} shares them equally among "
        f"{b} friends. How many {c.obj} does each friend get?"
    )
    body = f"{c.name} has {a} + {k} = {t} {c.obj}.\nEach friend gets {t} / {b} = {res} {c.obj}."
    return (a, k, b), q, body, res


TEMPLATES: dict[str, Template] = {
    "add_buy": _add_buy,
    "add_bags": _add_bags,
    "sub_give": _sub_give,
    "sub_compare": _sub_compare,
    "mul_boxes": _mul_boxes,
    "mul_pages": _mul_pages,
    "div_share": _div_share,
    "half": _half,
    "buy_give": _buy_give,
    "packs_plus": _packs_plus,
    "change": _change,
    "wage_spend": _wage_spend,
    "times_together": _times_together,
    "buy_share": _buy_share,
}


def _context(r: random.Random) -> _Ctx:
    (name, pron), (name2, _) = r.sample(NAMES, 2)
    return _Ctx(name, pron, name2, r.choice(OBJECTS), r.choice(ITEMS))


def iter_problems(split: str, seed: int = DEFAULT_SEED) -> Iterator[Problem]:
    """An endless deterministic stream of problems of one split (may repeat questions)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    r = random.Random(f"mlacheck-e2e-{split}-{seed}")
    names = list(TEMPLATES)
    while True:
        template = r.choice(names)
        drawn = TEMPLATES[template](r, _context(r))
        if drawn is None:
            continue
        numbers, question, body, final = drawn
        if split_of(template, numbers) != split:
            continue
        yield Problem(question, f"{body}\n#### {final}", final, template, numbers)


def generate(
    n: int, split: str = "train", seed: int = DEFAULT_SEED, unique: bool = False
) -> list[Problem]:
    """The first n problems of a split's stream (with `unique`, distinct questions only)."""
    out: list[Problem] = []
    seen: set[str] = set()
    for p in iter_problems(split, seed):
        if len(out) >= n:
            break
        if unique:
            if p.question in seen:
                continue
            seen.add(p.question)
        out.append(p)
    return out


def held_out_set(n: int = 500, seed: int = DEFAULT_SEED) -> list[Problem]:
    """The held-out evaluation set: n distinct test-split questions."""
    return generate(n, "test", seed, unique=True)


def write_gsm8k_dir(
    directory: Path | str, n_train: int = 200, n_test: int = 500, seed: int = DEFAULT_SEED
) -> Path:
    """Write `train.jsonl` / `test.jsonl` in GSM8K's format (the gate's `--data-dir`)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, problems in (
        ("train.jsonl", generate(n_train, "train", seed, unique=True)),
        ("test.jsonl", held_out_set(n_test, seed)),
    ):
        lines = [json.dumps(p.to_gsm8k(), ensure_ascii=False) for p in problems]
        (d / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


# The prompt and target format of lm-eval's gsm8k task (0-shot): what the model is trained on.
def prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def target(answer: str) -> str:
    return f" {answer}"
