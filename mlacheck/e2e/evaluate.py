"""Held-out accuracy of a model on generated problems, without lm-eval (training reports).

Prompt and scoring follow the gate's 0-shot protocol: `Question: ...\\nAnswer:`, greedy, stop
at `Question:` or EOS, correct iff the number after `#### ` (lm-eval's strict-match regex)
equals the problem's answer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlacheck.e2e.problems import Problem, prompt
from mlacheck.e2e.runner import MLARunner
from mlacheck.e2e.tokenizer import CharTokenizer, HFTokenizer

STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
STOP = "Question:"


def strict_answer(text: str) -> str | None:
    m = STRICT_RE.search(text)
    return m.group(1).replace(",", "").rstrip(".") if m else None


@dataclass(frozen=True)
class EvalResult:
    correct: int
    n: int
    seconds: float
    samples: tuple[tuple[str, str, bool], ...]  # (question, generation, correct)

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else 0.0


def greedy_texts(
    generate: Callable[[list[list[int]], int], list[list[int]]],
    tok: CharTokenizer | HFTokenizer,
    questions: Sequence[str],
    max_new_tokens: int,
    batch_size: int,
) -> list[str]:
    out: list[str] = []
    for b0 in range(0, len(questions), batch_size):
        batch = [tok.encode(prompt(q), add_bos=True) for q in questions[b0 : b0 + batch_size]]
        for toks in generate(batch, max_new_tokens):
            out.append(tok.decode(toks).split(STOP)[0])
    return out


def evaluate_runner(
    runner: MLARunner,
    tok: CharTokenizer | HFTokenizer,
    problems: Sequence[Problem],
    max_new_tokens: int = 160,
    batch_size: int = 128,
) -> EvalResult:
    """Accuracy of the runner (attention through its backend) on `problems`."""
    t0 = time.perf_counter()

    def gen(batch: list[list[int]], n: int) -> list[list[int]]:
        def stop(_: int, toks: list[int]) -> bool:
            return STOP in tok.decode(toks[-len(STOP) :])

        return runner.generate(batch, n, tok.eos_token_id, stop)

    texts = greedy_texts(gen, tok, [p.question for p in problems], max_new_tokens, batch_size)
    return _score(problems, texts, time.perf_counter() - t0)


def _score(problems: Sequence[Problem], texts: Sequence[str], seconds: float) -> EvalResult:
    samples = tuple(
        (p.question, t, strict_answer(t) == str(p.final))
        for p, t in zip(problems, texts, strict=True)
    )
    return EvalResult(sum(s[2] for s in samples), len(samples), seconds, samples)


def score_texts(
    problems: Sequence[Problem], texts: Sequence[str], seconds: float = 0.0
) -> EvalResult:
    return _score(problems, texts, seconds)
