"""GSM8K (grade-school maths, numeric answers): the gate's first task.

``GSM8K_TASK_CONFIG`` mirrors lm-eval 0.4.13's ``lm_eval/tasks/gsm8k/gsm8k.yaml`` (task
version 3.0) field for field; ``tests/unit/gate/test_gate_task.py`` checks it against the
installed lm-eval so that drift is caught when lm-eval is upgraded. Offline data use GSM8K's
own release layout (github.com/openai/grade-school-math, ``grade_school_math/data/
{train,test}.jsonl``), the task's default data files.
"""

from __future__ import annotations

from typing import Any

from mlacheck.gate.task import FLEXIBLE, STRICT, GateTask

# lm-eval 0.4.13 lm_eval/tasks/gsm8k/gsm8k.yaml, verbatim apart from YAML -> Python syntax.
GSM8K_TASK_CONFIG: dict[str, Any] = {
    "tag": ["math_word_problems"],
    "task": "gsm8k",
    "dataset_path": "openai/gsm8k",
    "dataset_name": "main",
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


def gold_answer(answer: str) -> str:
    """The final number of a GSM8K answer field (the text after ``#### ``)."""
    return answer.split("#### ")[-1].strip()


GSM8K = GateTask(
    name="gsm8k",
    title="GSM8K",
    config=GSM8K_TASK_CONFIG,
    question_field="question",
    answer_field="answer",
    gold=gold_answer,
    answer_marker="#### ",
    no_answer="without a number",
)
