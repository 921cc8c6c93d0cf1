"""A gate task: one lm-eval generative task pinned as data, and the gate's scoring of it (pure).

A :class:`GateTask` holds the task config the gate hands to lm-eval, copied from lm-eval's
YAML into the package rather than read from lm-eval at run time, so that baselines recorded
months apart used the same prompt, stop sequences, filters and metric (each task's test
compares its copy with the installed lm-eval). Around it: which document fields identify a
question and hold its answer, the offline data files, and the words reports use. Tasks are
registered by name in :mod:`mlacheck.gate.tasks`; the name also gives a task's record schema
(:mod:`mlacheck.gate.record`), report files (:mod:`mlacheck.gate.compare`) and baselines
directory (:mod:`mlacheck.gate.cli`).

Every task is scored with lm-eval's ``exact_match`` under two *roles*: ``strict-match``, the
answer in the format the prompt teaches (what the gate decides on by default), and
``flexible-extract``, a lenient extraction reported alongside, whose finding nothing makes an
output invalid. A task maps each role to one of its lm-eval filters (both to the same one
when it has a single filter).

The scoring methods mirror lm-eval's filter steps (``regex``, ``remove_whitespace``,
``lowercase``, ``uppercase``, ``take_first``) and its ``exact_match`` options. They only score
the responses of a run that aborted before lm-eval could score it (partial record), and flag
outputs without an answer; complete runs take correctness from lm-eval itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlacheck.gate.errors import GateError

STRICT = "strict-match"
FLEXIBLE = "flexible-extract"
ROLES = (STRICT, FLEXIBLE)

# lm-eval's RegexFilter returns this when the pattern does not match (its default fallback).
REGEX_FALLBACK = "[invalid]"
# The filter lm-eval applies to a task without a filter_list: take_first, named "none".
NO_FILTER = "none"

# lm-eval filter functions the scoring mirror reproduces, other than "regex" (text -> text).
_TEXT_STEPS: dict[str, Callable[[str], str]] = {
    "remove_whitespace": str.strip,
    "lowercase": str.lower,
    "uppercase": str.upper,
    "take_first": str,  # one response per request: the first is the response itself
}
_SPLIT_KEYS = ("training_split", "validation_split", "fewshot_split", "test_split")
_NO_PUNCTUATION = str.maketrans("", "", string.punctuation)
_NO_DIGITS = str.maketrans("", "", string.digits)
# A task name is an lm-eval task name, a CLI word and part of file names.
TASK_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")

# Fields that only say where the documents come from; everything else defines the protocol.
_DATASET_FIELDS = ("task", "tag", "dataset_path", "dataset_name", "dataset_kwargs")

# Degenerate-output detection (repetition loops, a classic symptom of broken attention):
# a response is degenerate if some run of REPEAT_NGRAM_WORDS whitespace-separated words occurs
# at least REPEAT_NGRAM_MIN_COUNT times, or if a unit of at most REPEAT_UNIT_MAX_CHARS
# characters repeats back to back at least REPEAT_UNIT_MIN_COUNT times. Chosen so that
# ordinary worked answers (a few GSM8K sentences with distinct numbers, decimals such as
# 0.3333333333333333 with 16 repeated digits) are not flagged, while "the the the ...",
# sentence loops and "!!!!..." / "ababab..." tails are.
REPEAT_NGRAM_WORDS = 6
REPEAT_NGRAM_MIN_COUNT = 5
REPEAT_UNIT_MAX_CHARS = 10
REPEAT_UNIT_MIN_COUNT = 20

_REPEAT_UNIT_RE = re.compile(
    rf"(.{{1,{REPEAT_UNIT_MAX_CHARS}}}?)\1{{{REPEAT_UNIT_MIN_COUNT - 1},}}", re.DOTALL
)


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


@dataclass(frozen=True)
class GateTask:
    """One lm-eval generative task with an exact-match (numeric or text) answer, as the gate
    runs, records and reports it. Checked when made: a task the gate cannot mirror fails at
    import, not in the middle of a run."""

    name: str  # lm-eval task name (config["task"]) and CLI word
    title: str  # how reports name it, e.g. "GSM8K"
    config: Mapping[str, Any]  # the pinned lm-eval task config (its YAML as Python)
    question_field: str  # document field that identifies a question (hashed into doc_hash)
    answer_field: str  # document field lm-eval's doc_to_target renders (the scoring target)
    gold: Callable[[str], str] = str.strip  # answer field -> the gold answer a record shows
    answer_marker: str = ""  # text every answer field of the offline data contains
    role_filters: Mapping[str, str] = field(  # role -> name of the lm-eval filter playing it
        default_factory=lambda: {STRICT: STRICT, FLEXIBLE: FLEXIBLE}
    )
    data_files: Mapping[str, str] = field(  # split -> file name in an offline data directory
        default_factory=lambda: {"train": "train.jsonl", "test": "test.jsonl"}
    )
    no_answer: str = "without an answer"  # reports: outputs the flexible filter found nothing in

    def __post_init__(self) -> None:
        problems = self._definition_problems()
        if problems:
            raise ValueError(f"gate task {self.name!r}: {'; '.join(problems)}")

    def _definition_problems(self) -> list[str]:
        cfg, out = self.config, []
        if not TASK_NAME_RE.match(self.name):
            out.append(f"name must match {TASK_NAME_RE.pattern}")
        if cfg.get("task") != self.name:
            out.append(f"config names task {cfg.get('task')!r}")
        if cfg.get("output_type") != "generate_until":
            out.append("only generate_until tasks can be gated")
        if [m.get("metric") for m in cfg.get("metric_list") or ()] != ["exact_match"]:
            out.append("metric_list must be exactly one exact_match")
        if cfg.get("doc_to_target") != "{{" + self.answer_field + "}}":
            out.append(f"doc_to_target must be the answer field {{{{{self.answer_field}}}}}")
        filters = self._filters()
        if set(self.role_filters) != set(ROLES):
            out.append(f"role_filters must map exactly {', '.join(ROLES)}")
        for role, name in self.role_filters.items():
            if name not in filters:
                out.append(f"{role} maps to unknown filter {name!r}")
        for name, steps in filters.items():
            for fn in (step.get("function") for step in steps):
                if fn != "regex" and fn not in _TEXT_STEPS:
                    out.append(f"filter {name!r} uses {fn!r}, which the gate does not mirror")
        if "test_split" not in cfg:
            out.append("config has no test_split")
        for key in _SPLIT_KEYS:
            if key in cfg and cfg[key] not in self.data_files:
                out.append(f"{key} {cfg[key]!r} has no data file")
        return out

    # --- lm-eval -----------------------------------------------------------------------

    @property
    def num_fewshot(self) -> int:
        """The task's own number of shots (lm-eval's default for it)."""
        return int(self.config.get("num_fewshot", 0))

    @property
    def hub_source(self) -> str:
        """Data-source line of a run reading the hub dataset of the config."""
        name = self.config.get("dataset_name")
        return f"hub:{self.config['dataset_path']}" + (f"/{name}" if name else "")

    def lm_eval_config(self, data_dir: Path | None) -> dict[str, Any]:
        """The config to hand to lm-eval: the pinned one, reading from the hub, or from the
        ``data_files`` under ``data_dir`` through the ``json`` dataset builder."""
        cfg = copy.deepcopy(dict(self.config))
        if data_dir is not None:
            data_dir = data_dir.resolve()
            cfg.pop("tag", None)
            cfg.pop("dataset_name", None)
            cfg["dataset_path"] = "json"
            cfg["dataset_kwargs"] = {
                "data_files": {split: str(data_dir / f) for split, f in self.data_files.items()}
            }
        return cfg

    def check_data_dir(self, data_dir: Path, num_fewshot: int) -> str:
        """Validate an offline data directory; return its data-source line (with the test
        file's digest, so that a record says which questions it answered)."""
        if not data_dir.is_dir():
            raise GateError(f"data directory {data_dir} does not exist")
        fewshot_split = self.config.get("fewshot_split", self.config.get("training_split"))
        marker = f"... {self.answer_marker}..." if self.answer_marker else "..."
        shape = f'{{"{self.question_field}": ..., "{self.answer_field}": "{marker}"}}'
        digests = {}
        for split, name in self.data_files.items():
            path = data_dir / name
            if not path.is_file():
                raise GateError(f"data directory {data_dir} has no {name}")
            raw = path.read_bytes()
            rows = 0
            for lineno, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
                if not line.strip():
                    continue
                if not self._is_doc(line):
                    raise GateError(f"{path}:{lineno}: not a {self.title} record (need {shape})")
                rows += 1
            if rows == 0:
                raise GateError(f"{path} is empty")
            if split == fewshot_split and rows < num_fewshot:
                raise GateError(f"{path} has {rows} examples, fewer than {num_fewshot} shots")
            digests[split] = hashlib.sha256(raw).hexdigest()[:16]
        test = self.config["test_split"]
        return f"json:{data_dir.resolve()} {self.data_files[test]} sha256={digests[test]}"

    def _is_doc(self, line: str) -> bool:
        try:
            doc = json.loads(line)
        except ValueError:
            return False
        if not isinstance(doc, dict) or not isinstance(doc.get(self.question_field), str):
            return False
        answer = doc.get(self.answer_field)
        return isinstance(answer, str) and self.answer_marker in answer

    # --- documents and scoring ---------------------------------------------------------

    def hash_doc(self, doc: Mapping[str, Any]) -> str:
        """A document's identity in records: doc_hash of its question field."""
        return doc_hash(doc[self.question_field])

    def gold_of(self, doc: Mapping[str, Any]) -> str:
        """The gold answer a record shows for a document."""
        return self.gold(doc[self.answer_field])

    def _filters(self) -> dict[str, list[Mapping[str, Any]]]:
        entries = self.config.get("filter_list") or ()
        return {e["name"]: list(e["filter"]) for e in entries} or {
            NO_FILTER: [{"function": "take_first"}]
        }

    def extract(self, response: str, role: str) -> str:
        """Mirror of what lm-eval's filter for ``role`` extracts from ``response``."""
        text = response
        for step in self._filters()[self.role_filters[role]]:
            fn = step["function"]
            text = _regex_step(text, step) if fn == "regex" else _TEXT_STEPS[fn](text)
        return text

    def found_nothing(self, flexible_answer: str) -> bool:
        """True if the flexible role's filter extracted no answer (blank or its fallback)."""
        steps = self._filters()[self.role_filters[FLEXIBLE]]
        fallbacks = {s.get("fallback", REGEX_FALLBACK) for s in steps if s["function"] == "regex"}
        return not flexible_answer.strip() or flexible_answer in fallbacks

    def exact_match(self, prediction: str, target: str) -> bool:
        """Mirror of lm-eval's ``exact_match`` with this task's options; ``target`` is the
        answer field (for GSM8K the whole worked answer: ``(?s).*#### `` reduces it)."""
        return self._normalise(prediction) == self._normalise(target)

    def _normalise(self, text: str) -> str:
        opts = self.config["metric_list"][0]
        for pattern in opts.get("regexes_to_ignore") or ():
            text = re.sub(pattern, "", text)
        if opts.get("ignore_case"):
            text = text.lower()
        if opts.get("ignore_punctuation"):
            text = text.translate(_NO_PUNCTUATION)
        if opts.get("ignore_numbers"):
            text = text.translate(_NO_DIGITS)
        return text


def _regex_step(text: str, step: Mapping[str, Any]) -> str:
    """Mirror of lm-eval's ``regex`` filter on one response."""
    fallback = step.get("fallback", REGEX_FALLBACK)
    matches = re.findall(step["regex_pattern"], text)
    if not matches:
        return fallback
    match = matches[step.get("group_select", 0)]
    if isinstance(match, tuple):
        parts = [m for m in match if m]
        if not parts:
            return fallback
        match = parts[0]
    return match.strip()


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
