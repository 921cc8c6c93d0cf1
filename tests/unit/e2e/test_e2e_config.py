"""Model configuration: DeepSeek's config.json keys, both rope spellings, the softmax scale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _e2e_helpers import tiny_model

from mlacheck.e2e.config import E2EError, ModelConfig
from mlacheck.spec import DEEPSEEK_V3

# DeepSeek-V3's config.json (hub), the keys that matter here.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def test_deepseek_v3_config_gives_the_v3_dims_and_scale() -> None:
    cfg = ModelConfig.from_dict(DEEPSEEK_V3_CONFIG)
    assert cfg.mla_dims == DEEPSEEK_V3
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)
    assert cfg.is_moe_model and not cfg.is_moe_layer(2) and cfg.is_moe_layer(3)
    assert cfg.extra["quantization_config"]["quant_method"] == "fp8"
    # carried through a save / load round trip, in DeepSeek's spelling
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert cfg.to_dict()["rope_scaling"]["type"] == "yarn"


def test_rope_parameters_spelling_and_no_scaling(tmp_path: Path) -> None:
    d = dict(DEEPSEEK_V3_CONFIG)
    rs = dict(d.pop("rope_scaling"))
    rs["rope_type"] = rs.pop("type")
    rs["rope_theta"] = d.pop("rope_theta")
    d["rope_parameters"] = rs
    assert ModelConfig.from_dict(d).softmax_scale == pytest.approx(0.135234, abs=1e-6)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    plain = ModelConfig.from_dict(d)
    assert plain.rope_scaling is None and plain.softmax_scale == pytest.approx(192**-0.5)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert ModelConfig.load(tmp_path) == plain


def test_mscale_all_dim_absent_leaves_the_scale_alone() -> None:
    """DeepSeek multiplies by mscale^2 only when mscale_all_dim is set (non-zero)."""
    d = json.loads(json.dumps(DEEPSEEK_V3_CONFIG))
    del d["rope_scaling"]["mscale_all_dim"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.softmax_scale == pytest.approx(192**-0.5)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.cos_sin_scale == pytest.approx(
        0.1 * 1.0 * __import__("math").log(40) + 1
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "not a DeepSeek"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "not supported"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"kv_lora_rank": None}, "lacks kv_lora_rank"),
    ],
)
def test_bad_configs_are_one_line_errors(change: dict, message: str) -> None:
    d = {**DEEPSEEK_V3_CONFIG, **change}
    with pytest.raises(E2EError, match=message):
        ModelConfig.from_dict(d)


def test_parameter_count_matches_the_model() -> None:
    for over in ({}, {"q_lora_rank": 24}, {"tie_word_embeddings": True}):
        m = tiny_model(**over)
        assert m.config.num_parameters() == sum(p.numel() for p in m.parameters()), over
