"""references/e2e_model/train.py runs on CPU end to end (tiny preset, a few steps), and the
`python -m mlacheck.e2e` commands work on what it writes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from _e2e_helpers import COMMITTED_MODELS

from mlacheck.e2e.__main__ import main as e2e_main
from mlacheck.e2e.checkpoint import load_model

SCRIPT = Path(__file__).resolve().parents[3] / "references" / "e2e_model" / "train.py"


def test_train_script_cpu_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("e2e_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    out = tmp_path / "model"
    rc = train.main(
        [
            "--out",
            str(out),
            "--steps",
            "6",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--batch-size",
            "8",
            "--pool",
            "64",
            "--eval-n",
            "2",
            "--dense-eval-n",
            "2",
            "--log-every",
            "3",
            "--lr",
            "3e-3",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "held-out accuracy through the mlacheck runner (torch backend" in text
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 6 and log["last_loss"] < log["first_loss"]
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    model = load_model(out)
    assert model.config.softmax_scale == pytest.approx(model.config.mla_dims.softmax_scale)

    data = tmp_path / "data"
    assert e2e_main(["data", str(data), "--n-train", "3", "--n-test", "4"]) == 0
    assert e2e_main(["eval", "--model", str(out), "--n", "2", "--kv", "fp8_e4m3fn"]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    assert e2e_main(["eval", "--model", str(tmp_path / "nope"), "--n", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: cannot read")


def _train_module(name: str):  # noqa: ANN202
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    return train


def test_committed_config_is_the_scripts_model() -> None:
    train = _train_module("e2e_train_cfg")
    from mlacheck.e2e.config import ModelConfig
    from mlacheck.e2e.tokenizer import CharTokenizer

    committed = ModelConfig.load(COMMITTED_MODELS["small"] / "config.json")
    assert committed == train.model_config("small", CharTokenizer())
    assert committed.softmax_scale == pytest.approx(0.270468, abs=1e-6)
    assert committed.num_parameters() == 3_281_408


def test_deepseek_dims_preset() -> None:
    """The preset production kernels can serve: DeepSeek-V3's attention dims and scale, q-LoRA,
    16 heads, and small enough to commit (<= 25 MB in bf16); the committed directory, once
    there, holds exactly this model."""
    train = _train_module("e2e_train_ds")
    from mlacheck.e2e.config import DEEPSEEK_V3_ROPE_SCALING, ModelConfig
    from mlacheck.e2e.tokenizer import CharTokenizer
    from mlacheck.spec import DEEPSEEK_V3

    cfg = train.model_config("deepseek-dims", CharTokenizer())
    assert cfg.mla_dims == DEEPSEEK_V3
    assert cfg.num_attention_heads >= 16 and cfg.q_lora_rank is not None
    assert cfg.rope_scaling == DEEPSEEK_V3_ROPE_SCALING
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)  # DeepSeek-V3's
    assert cfg.num_parameters() == 11_409_024
    assert 2 * cfg.num_parameters() <= 25e6
    directory = COMMITTED_MODELS["deepseek-dims"]
    if (directory / "config.json").is_file():
        assert ModelConfig.load(directory / "config.json") == cfg
