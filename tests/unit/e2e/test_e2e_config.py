"""Model configuration: DeepSeek's config.json keys, both rope spellings, the softmax scale."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _e2e_helpers import MOE, tiny_config, tiny_model

from mlacheck.e2e.config import E2EError, ModelConfig
from mlacheck.e2e.model import MLP, MLAModel, MoE
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
        0.1 * 1.0 * math.log(40) + 1
    )


# transformers' `_compute_yarn_parameters` (modeling_rope_utils.py):
#     if attention_factor is None:
#         if mscale and mscale_all_dim:
#             attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
#         else:
#             attention_factor = get_mscale(factor)
# with get_mscale(scale, mscale=1) = 0.1 * mscale * log(scale) + 1.
GET_MSCALE_40 = 0.1 * math.log(40) + 1  # 1.36889


@pytest.mark.parametrize(
    "keys, cos_sin, softmax_mscale",
    [
        # mscale alone: ignored by transformers (DeepSeek's remote code: 0.1*0.707*ln40+1 = 1.261)
        ({"mscale": 0.707}, GET_MSCALE_40, 1.0),
        # mscale_all_dim alone (mscale absent): transformers get_mscale(factor); DeepSeek's code
        # (mscale defaulting to 1) gave get_mscale(40, 1) / get_mscale(40, 1) = 1
        ({"mscale_all_dim": 1.0}, GET_MSCALE_40, GET_MSCALE_40),
        # both: the ratio, as both implementations compute it
        (
            {"mscale": 0.707, "mscale_all_dim": 1.0},
            (0.1 * 0.707 * math.log(40) + 1) / GET_MSCALE_40,
            GET_MSCALE_40,
        ),
        # neither
        ({}, GET_MSCALE_40, 1.0),
        # an explicit attention_factor wins
        ({"mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": 0.5}, 0.5, GET_MSCALE_40),
    ],
    ids=["mscale-only", "mscale-all-dim-only", "both", "neither", "attention-factor"],
)
def test_yarn_cos_sin_scale_follows_transformers(
    keys: dict, cos_sin: float, softmax_mscale: float
) -> None:
    d = json.loads(json.dumps(DEEPSEEK_V3_CONFIG))
    rs = {k: v for k, v in d["rope_scaling"].items() if k not in ("mscale", "mscale_all_dim")}
    d["rope_scaling"] = {**rs, **keys}
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling.cos_sin_scale == pytest.approx(cos_sin, rel=1e-12)
    # the attention scale: transformers' DeepseekV3Attention multiplies by
    # yarn_get_mscale(factor, mscale_all_dim)^2 only `if mscale_all_dim`
    assert cfg.softmax_scale == pytest.approx(softmax_mscale**2 / math.sqrt(192), rel=1e-12)
    # an absent key stays absent through a save / load round trip (absent mscale != 1.0)
    again = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert ("mscale" in cfg.to_dict()["rope_scaling"]) is ("mscale" in keys)
    # and the model's rotary tables carry it
    small = tiny_config(rope_scaling=cfg.rope_scaling)
    assert MLAModel(small).rotary.scale == pytest.approx(cos_sin, rel=1e-12)


def test_yarn_defaults_follow_transformers() -> None:
    """Absent `original_max_position_embeddings`: transformers' standardize_rope_params sets it
    to max_position_embeddings (DeepSeek's code: 4096); absent `factor`: max_position_embeddings
    / original_max_position_embeddings; `beta_fast` / `beta_slow` of 0 or null: 32 / 1."""
    d = json.loads(json.dumps(DEEPSEEK_V3_CONFIG))
    rs = d["rope_scaling"]
    del rs["original_max_position_embeddings"]
    rs["beta_fast"], rs["beta_slow"] = 0, None
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling.original_max_position_embeddings == 163840
    assert (cfg.rope_scaling.beta_fast, cfg.rope_scaling.beta_slow) == (32.0, 1.0)
    d = json.loads(json.dumps(DEEPSEEK_V3_CONFIG))
    del d["rope_scaling"]["factor"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 163840 / 4096


def test_moe_layer_freq_is_ignored_as_transformers_does() -> None:
    """transformers' DeepseekV3DecoderLayer: `if layer_idx >= config.first_k_dense_replace:
    self.mlp = DeepseekV3MoE(config)` — every layer from first_k_dense_replace on is routed,
    whatever moe_layer_freq says (DeepSeek's remote code: only layers with idx % freq == 0)."""
    cfg = tiny_config(
        **{**MOE, "first_k_dense_replace": 1, "num_hidden_layers": 4}, moe_layer_freq=2
    )
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    m = MLAModel(cfg)
    assert [type(layer.mlp) for layer in m.model.layers] == [MLP, MoE, MoE, MoE]
    # (the correction bias is a buffer in transformers' DeepseekV3TopkRouter, not counted)
    params = [p for n, p in m.named_parameters() if not n.endswith("e_score_correction_bias")]
    assert cfg.num_parameters() == sum(p.numel() for p in params)
    assert ModelConfig.from_dict(cfg.to_dict()).moe_layer_freq == 2  # carried, not used


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "not a DeepSeek"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "not supported"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"kv_lora_rank": None}, "lacks kv_lora_rank"),
        (
            {"rope_scaling": {**DEEPSEEK_V3_CONFIG["rope_scaling"], "truncate": False}},
            "truncate=false not supported",
        ),
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
