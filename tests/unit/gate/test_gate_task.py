"""The GSM8K gate task (mirrored lm-eval config, scoring mirror) and the scoring helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mlacheck.gate import task
from mlacheck.gate.tasks.gsm8k import GSM8K, GSM8K_TASK_CONFIG, gold_answer


def _installed_gsm8k_yaml() -> dict:
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is needed to compare with its task")
    path = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    return yaml.safe_load(path.read_text())


def test_config_mirrors_installed_lm_eval_gsm8k_yaml() -> None:
    installed = _installed_gsm8k_yaml()
    assert installed == GSM8K_TASK_CONFIG


def test_hub_config_is_lm_eval_config_and_offline_config_only_moves_the_data(
    tmp_path: Path,
) -> None:
    assert GSM8K.lm_eval_config(None) == GSM8K_TASK_CONFIG
    offline = GSM8K.lm_eval_config(tmp_path)
    assert offline["dataset_path"] == "json"
    assert offline["dataset_kwargs"]["data_files"] == {
        "train": str(tmp_path.resolve() / "train.jsonl"),
        "test": str(tmp_path.resolve() / "test.jsonl"),
    }
    moved = {"tag", "dataset_path", "dataset_name", "dataset_kwargs"}
    strip = lambda c: {k: v for k, v in c.items() if k not in moved}  # noqa: E731
    assert strip(offline) == strip(GSM8K_TASK_CONFIG)
    assert "include" not in offline


def test_protocol_hash_ignores_data_location_but_not_protocol(tmp_path: Path) -> None:
    hub = task.protocol_sha256(GSM8K.lm_eval_config(None), 5, 256)
    assert task.protocol_sha256(GSM8K.lm_eval_config(tmp_path), 5, 256) == hub
    assert task.protocol_sha256(GSM8K.lm_eval_config(None), 8, 256) != hub
    assert task.protocol_sha256(GSM8K.lm_eval_config(None), 5, 512) != hub
    changed = GSM8K.lm_eval_config(None)
    changed["doc_to_text"] = "Q: {{question}}\nA:"
    assert task.protocol_sha256(changed, 5, 256) != hub


RESPONSES = [
    " Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72",
    " The answer is $1,234.50.",
    " #### -3",
    " 2 + 2 = 4. So 4",
    " nothing here",
    "",
    " She earns 10. Then 12.5 and finally 1,000\n#### 1,000",
    " #### 5.",
]


@pytest.mark.parametrize("response", RESPONSES)
@pytest.mark.parametrize("name", task.ROLES)
def test_extract_matches_lm_eval_regex_filter(response: str, name: str) -> None:
    pytest.importorskip("lm_eval", reason="lm-eval's filter is the reference")
    from lm_eval.filters.extraction import RegexFilter

    spec = next(f for f in GSM8K_TASK_CONFIG["filter_list"] if f["name"] == name)["filter"][0]
    kwargs = {k: v for k, v in spec.items() if k != "function"}
    expected = RegexFilter(**kwargs).apply([[response]], [{}])[0][0]
    assert GSM8K.extract(response, name) == expected


@pytest.mark.parametrize(
    "prediction,target",
    [
        ("72", "Natalia sold ... clips.\n#### 72"),
        ("$1,234.50", "x\n#### 1234.50"),
        ("72.", "x\n#### 72"),
        ("71", "x\n#### 72"),
        ("[invalid]", "x\n#### 72"),
        ("-3", "x\n#### -3"),
    ],
)
def test_exact_match_matches_lm_eval_metric(prediction: str, target: str) -> None:
    pytest.importorskip("lm_eval", reason="lm-eval's metric is the reference")
    from lm_eval.api.metrics import exact_match_hf_evaluate

    opts = {
        k: v
        for k, v in GSM8K_TASK_CONFIG["metric_list"][0].items()
        if k in ("regexes_to_ignore", "ignore_case", "ignore_punctuation")
    }
    expected = bool(exact_match_hf_evaluate([prediction], [target], **opts)["exact_match"] == 1.0)
    assert GSM8K.exact_match(prediction, target) is expected


def test_degenerate_detection() -> None:
    healthy = [
        RESPONSES[0],
        " 1/3 of 1 is 0.3333333333333333 so the answer is 0.3333333333333333.\n#### 0.33",
        " Day 1: 5 apples. Day 2: 6 apples. Day 3: 7 apples. Day 4: 8 apples.\n#### 26",
    ]
    looping = [
        " the" * 12,
        " He has 5 apples and then he has 5 apples and" * 6,
        " !" * 3 + "!" * 40,
        " 3" + "ab" * 25,
    ]
    assert not any(task.is_degenerate(r) for r in healthy)
    assert all(task.is_degenerate(r) for r in looping)


def test_doc_hash_and_gold() -> None:
    assert task.doc_hash("What is 1+1?") == task.doc_hash("What is 1+1?")
    assert task.doc_hash("What is 1+1?") != task.doc_hash("What is 1+2?")
    assert len(task.doc_hash("q")) == 16
    assert gold_answer("step\n#### 1,200") == "1,200"
