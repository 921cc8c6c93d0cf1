"""The GSM8K task definition the gate runs, and per-sample scoring helpers (pure).

``GSM8K_TASK_CONFIG`` mirrors lm-eval 0.4.13's ``lm_eval/tasks/gsm8k/gsm8k.yaml``
(task version 3.0) field for field; ``tests/unit/gate`` checks it against the installed
lm-eval so that drift is caught when lm-eval is upgraded. The gate pins its own copy rather
than reading lm-eval's file at run time so that baselines recorded months apart used the
same prompt, stop sequences, filters and metric.

The scoring helpers re-implement lm-eval's ``regex`` + ``take_first`` filters and its
``exact_match`` metric for the two filters of this config. They are only used to score the
responses of a run that aborted before lm-eval could score it (partial record), and to flag
outputs without a number; complete runs take correctness from lm-eval itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Name under which the generated task is registered with lm-eval's TaskManager. The gate's
# TaskManager is built with include_defaults=False, so it cannot clash with lm-eval's own.
TASK_NAME = "gsm8k"

# Hugging Face dataset used when no local data directory is given (as in lm-eval's yaml).
HUB_DATASET_PATH = "openai/gsm8k"
HUB_DATASET_NAME = "main"

# File names of an offline data directory: GSM8K's own release layout
# (github.com/openai/grade-school-math, grade_school_math/data/{train,test}.jsonl).
DATA_TRAIN_FILE = "train.jsonl"
DATA_TEST_FILE = "test.jsonl"

STRICT = "strict-match"
FLEXIBLE = "flexible-extract"
FILTERS = (STRICT, FLEXIBLE)

# lm-eval's RegexFilter returns this when the pattern does not match.
REGEX_FALLBACK = "[invalid]"

# lm-eval 0.4.13 lm_eval/tasks/gsm8k/gsm8k.yaml, verbatim apart from YAML -> Python syntax.
GSM8K_TASK_CONFIG: dict[str, Any] = {
    "tag": ["math_word_problems"],
    "task": "gsm8k",
    "dataset_path": HUB_DATASET_PATH,
    "dataset_name": HUB_DATASET_NAME,
    "output_type": "generate_until",
    "training_split": "train",
    "fewshot_split": "train",
    "test_split": "test",
    "doc_to_text": "Question: {{question}}\nAnswer:",
    "doc_to_target": "{{answer}}",
    "metric_list": [
        {
            "metric": "exact_match",
            "aggregation": "mean",
            "higher_is_better": True,
            "ignore_case": True,
            "ignore_punctuation": False,
            "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"],
        }
    ],
    "generation_kwargs": {
        "until": ["Question:", "</s>", "<|im_end|>"],
        "do_sample": False,
        "temperature": 0.0,
    },
    "repeats": 1,
    "num_fewshot": 5,
    "filter_list": [
        {
            "name": STRICT,
            "filter": [
                {"function": "regex", "regex_pattern": "#### (\\-?[0-9\\.\\,]+)"},
                {"function": "take_first"},
            ],
        },
        {
            "name": FLEXIBLE,
            "filter": [
                {
                    "function": "regex",
                    "group_select": -1,
                    "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)",
                },
                {"function": "take_first"},
            ],
        },
    ],
    "metadata": {"version": 3.0},
}

# Fields that only say where the documents come from; everything else defines the protocol.
_DATASET_FIELDS = ("task", "tag", "dataset_path", "dataset_name", "dataset_kwargs")

# Degenerate-output detection (repetition loops, a classic symptom of broken attention):
# a response is degenerate if some run of REPEAT_NGRAM_WORDS whitespace-separated words occurs
# at least REPEAT_NGRAM_MIN_COUNT times, or if a unit of at most REPEAT_UNIT_MAX_CHARS
# characters repeats back to back at least REPEAT_UNIT_MIN_COUNT times. Chosen so that
# ordinary GSM8K solutions (a few sentences with distinct numbers, decimals such as
# 0.3333333333333333 with 16 repeated digits) are not flagged, while "the the the ...",
# sentence loops and "!!!!..." / "ababab..." tails are.
REPEAT_NGRAM_WORDS = 6
REPEAT_NGRAM_MIN_COUNT = 5
REPEAT_UNIT_MAX_CHARS = 10
REPEAT_UNIT_MIN_COUNT = 20

_REPEAT_UNIT_RE = re.compile(
    rf"(.{{1,{REPEAT_UNIT_MAX_CHARS}}}?)\1{{{REPEAT_UNIT_MIN_COUNT - 1},}}", re.DOTALL
)


def task_config(data_dir: Path | None) -> dict[str, Any]:
    """The task config to hand to lm-eval: the mirrored gsm8k config, reading from the hub,
    or from ``data_dir/{train,test}.jsonl`` through the ``json`` dataset builder."""
    cfg = copy.deepcopy(GSM8K_TASK_CONFIG)
    cfg["task"] = TASK_NAME
    if data_dir is not None:
        data_dir = data_dir.resolve()
        cfg.pop("tag", None)
        cfg.pop("dataset_name", None)
        cfg["dataset_path"] = "json"
        cfg["dataset_kwargs"] = {
            "data_files": {
                "train": str(data_dir / DATA_TRAIN_FILE),
                "test": str(data_dir / DATA_TEST_FILE),
            }
        }
    return cfg


def protocol_sha256(cfg: Mapping[str, Any], num_fewshot: int, max_gen_toks: int) -> str:
    """Hash of everything that decides what is asked and how it is scored (prompt format,
    stop sequences, filters, metric, shots, generation length), but not where the documents
    are read from. Two runs are comparable only if their protocol hashes agree."""
    proto = {k: v for k, v in cfg.items() if k not in _DATASET_FIELDS}
    proto["num_fewshot_used"] = num_fewshot
    proto["max_gen_toks"] = max_gen_toks
    blob = json.dumps(proto, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def doc_hash(question: str) -> str:
    """Short identity of a document: the first 16 hex digits of sha256(question)."""
    return hashlib.sha256(question.encode("utf-8")).hexdigest()[:16]


def gold_answer(answer: str) -> str:
    """The final number of a GSM8K answer field (the text after ``#### ``)."""
    return answer.split("#### ")[-1].strip()


def _filter_spec(name: str) -> Mapping[str, Any]:
    for entry in GSM8K_TASK_CONFIG["filter_list"]:
        if entry["name"] == name:
            return entry["filter"][0]
    raise KeyError(name)


def extract(response: str, filter_name: str) -> str:
    """Mirror of lm-eval's ``regex`` filter followed by ``take_first`` for ``filter_name``."""
    spec = _filter_spec(filter_name)
    matches = re.findall(spec["regex_pattern"], response)
    if not matches:
        return REGEX_FALLBACK
    match = matches[spec.get("group_select", 0)]
    if isinstance(match, tuple):
        parts = [m for m in match if m]
        if not parts:
            return REGEX_FALLBACK
        match = parts[0]
    return match.strip()


def _normalise(text: str) -> str:
    metric = GSM8K_TASK_CONFIG["metric_list"][0]
    for pattern in metric["regexes_to_ignore"]:
        text = re.sub(pattern, "", text)
    if metric["ignore_case"]:
        text = text.lower()
    return text


def exact_match(prediction: str, target: str) -> bool:
    """Mirror of lm-eval's ``exact_match`` with the gsm8k metric options (``target`` is the
    full answer field; ``(?s).*#### `` reduces it to the final number)."""
    return _normalise(prediction) == _normalise(target)


def is_degenerate(response: str) -> bool:
    """True if the response loops (see the REPEAT_* constants)."""
    if _REPEAT_UNIT_RE.search(response):
        return True
    words = response.split()
    if len(words) < REPEAT_NGRAM_WORDS + REPEAT_NGRAM_MIN_COUNT - 1:
        return False
    counts = Counter(
        tuple(words[i : i + REPEAT_NGRAM_WORDS]) for i in range(len(words) - REPEAT_NGRAM_WORDS + 1)
    )
    return max(counts.values()) >= REPEAT_NGRAM_MIN_COUNT
