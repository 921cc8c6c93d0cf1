"""The model is transformers' DeepseekV3ForCausalLM (same names, same numbers), and its MLA
pieces give the same attention in the MHA and the absorbed view."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _e2e_helpers import (
    COMMITTED_MODELS,
    DEEPSEEK_DIMS,
    MOE,
    fuse_experts,
    has_weights,
    tiny_config,
    tiny_model,
)

from mlacheck.e2e.checkpoint import load_model
from mlacheck.e2e.config import RopeScaling
from mlacheck.e2e.model import MLAModel, math_attention, sdpa_attention
from mlacheck.inputs import absorb_q, unabsorb_out


def _hf(model: MLAModel):  # noqa: ANN202
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    hc = transformers.DeepseekV3Config.from_dict(model.config.to_dict())
    hc._attn_implementation = "eager"
    hf = transformers.DeepseekV3ForCausalLM(hc).eval()
    state = dict(model.state_dict())
    # transformers 5 keeps routed experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    if any(k.endswith("mlp.experts.gate_up_proj") for k in hf.state_dict()):
        state = fuse_experts(state)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return hf


def _bias_the_routers(model: MLAModel) -> None:
    """A non-zero correction bias in every routed layer, so that it matters."""
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, 8))


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"q_lora_rank": 24},
        {"rope_interleave": False},
        {"rope_scaling": None},
        {"tie_word_embeddings": True},
        # mixture of experts: layer 1 routed (V3 noaux_tc: sigmoid, groups, correction bias)
        MOE,
        # the settings where transformers and DeepSeek's remote code differ (docs/e2e.md §1):
        # top-1 routing normalised (weight 1 x routed_scaling_factor)
        {**MOE, "num_experts_per_tok": 1, "norm_topk_prob": True},
        # moe_layer_freq ignored: both layers routed
        {**MOE, "first_k_dense_replace": 0, "moe_layer_freq": 2},
        # YaRN cos/sin scale with only one of mscale / mscale_all_dim
        {"rope_scaling": RopeScaling(factor=40.0, mscale=0.707)},
        {"rope_scaling": RopeScaling(factor=40.0, mscale_all_dim=0.707)},
        DEEPSEEK_DIMS,
    ],
    ids=[
        "dense",
        "q-lora",
        "no-interleave",
        "no-yarn",
        "tied",
        "moe",
        "moe-top1-norm",
        "moe-layer-freq-2",
        "yarn-mscale-only",
        "yarn-mscale-all-dim-only",
        "deepseek-dims",
    ],
)
def test_logits_match_transformers(over: dict) -> None:
    model = tiny_model(**over)
    _bias_the_routers(model)
    hf = _hf(model)
    ids = torch.randint(0, 100, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids, math_attention), hf(ids).logits
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(model.config.softmax_scale)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(model.rotary.scale)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    # and the training path (SDPA) agrees with the written-out softmax
    with torch.no_grad():
        torch.testing.assert_close(model(ids, sdpa_attention), ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("over", [{}, MOE], ids=["dense", "moe"])
def test_transformers_saved_checkpoint_loads_with_the_same_logits(
    tmp_path: Path, over: dict
) -> None:
    """What `DeepseekV3ForCausalLM.save_pretrained` writes (config.json in transformers'
    spelling, fused experts in transformers 5) loads here and gives transformers' logits."""
    pytest.importorskip("safetensors", reason="needs safetensors")
    model = tiny_model(**over)
    _bias_the_routers(model)
    hf = _hf(model)
    hf.save_pretrained(tmp_path)
    back = load_model(tmp_path)
    ids = torch.randint(0, 100, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids, math_attention), hf(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", sorted(COMMITTED_MODELS))
def test_committed_model_loads_into_transformers_with_the_same_logits(preset: str) -> None:
    """`DeepseekV3ForCausalLM.from_pretrained` reads the committed directory as it is (no
    missing or unexpected tensors, the model's softmax scale) and gives our logits on a
    held-out prompt."""
    directory = COMMITTED_MODELS[preset]
    if not has_weights(directory):
        pytest.skip(f"no trained model committed in {directory.name} yet")
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    from mlacheck.e2e.problems import held_out_set, prompt
    from mlacheck.e2e.tokenizer import load_tokenizer

    ours = load_model(directory, dtype=torch.float32)
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tok = load_tokenizer(directory, ours.config.bos_token_id, ours.config.eos_token_id)
    text = prompt(held_out_set(1)[0].question) + " "
    ids = torch.tensor([tok.encode(text, add_bos=True)])
    with torch.no_grad():
        theirs = hf.eval()(ids).logits
        mine = ours(ids, math_attention)
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(ours.config.softmax_scale)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_mha_and_absorbed_views_agree() -> None:
    """softmax(q·k / s) v in the MHA view == the absorbed view through W_UK / W_UV, with the
    SAME softmax scale (the model's, YaRN mscale included)."""
    model = tiny_model()
    attn = model.model.layers[0].self_attn
    t = 11
    x = torch.randn(t, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    cos, sin = model.rotary.cos_sin(torch.arange(t))
    with torch.no_grad():
        q_nope, q_pe = attn.queries(x, cos, sin)
        c_kv, k_pe = attn.latents(x, cos, sin)
        k_nope, v = attn.expand(c_kv)
        w = attn.absorption()
        scale = model.config.softmax_scale
        q = torch.cat([q_nope, q_pe], -1).transpose(0, 1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, attn.num_heads, -1)], -1).transpose(0, 1)
        mha = math_attention(q, k, v.transpose(0, 1), scale).transpose(0, 1)
        qa = absorb_q(q_nope, q_pe, w).transpose(0, 1)  # [H, T, latent]
        lat = torch.cat([c_kv, k_pe], -1)[None]  # one shared latent "head"
        o_lat = math_attention(qa, lat, lat[..., : model.config.kv_lora_rank], scale)
        absorbed = unabsorb_out(o_lat.transpose(0, 1), w)
    torch.testing.assert_close(absorbed, mha, rtol=1e-4, atol=1e-5)


def test_v2_softmax_router_picks_the_top_experts() -> None:
    cfg = tiny_config(
        first_k_dense_replace=0,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        scoring_func="softmax",
        topk_method="greedy",
        model_type="deepseek_v2",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )
    router = MLAModel(cfg).model.layers[0].mlp.gate
    with torch.no_grad():
        router.weight.copy_(torch.eye(4, cfg.hidden_size))
    x = torch.zeros(1, cfg.hidden_size)
    x[0, :4] = torch.tensor([0.0, 3.0, 1.0, 2.0])
    w, idx = router(x)
    assert sorted(idx[0].tolist()) == [1, 3]
    p = torch.softmax(x[0, :4], 0)
    assert sorted(w[0].tolist()) == pytest.approx(sorted([p[1].item(), p[3].item()]))


@pytest.mark.parametrize("norm", [True, False])
def test_top1_routing_normalises_as_transformers_does(norm: bool) -> None:
    """transformers' DeepseekV3MoE.route_tokens_to_experts normalises the top-k weights whenever
    norm_topk_prob is set, k = 1 included (weight 1, times routed_scaling_factor); DeepSeek's
    remote code only for k > 1 (it would give sigmoid(logit) x routed_scaling_factor)."""
    cfg = tiny_config(
        **{**MOE, "first_k_dense_replace": 0, "num_experts_per_tok": 1}, norm_topk_prob=norm
    )
    router = MLAModel(cfg).model.layers[0].mlp.gate
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        router.weight.copy_(
            torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(4))
        )
        w, idx = router(x)
    assert idx.shape == (5, 1)
    if norm:
        torch.testing.assert_close(w, torch.full((5, 1), 2.5))
    else:
        logits = (x @ router.weight.T).sigmoid().gather(1, idx)
        torch.testing.assert_close(w, logits * 2.5)
