"""The Hugging Face DeepSeek layout: config.json + safetensors (single, sharded, FP8 blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _e2e_helpers import MOE, fuse_experts, tiny_model

from mlacheck.e2e.checkpoint import dequant_block_fp8, load_model, save_model
from mlacheck.e2e.config import E2EError
from mlacheck.e2e.model import MLAModel

safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")


def _same(a: MLAModel, b: MLAModel, atol: float = 0.0) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sb[k].float(), sa[k].float(), rtol=0, atol=atol, msg=k)


@pytest.mark.parametrize("tied", [False, True])
def test_save_and_load_round_trip(tmp_path: Path, tied: bool) -> None:
    m = tiny_model(tie_word_embeddings=tied)
    path = save_model(m, tmp_path, dtype=torch.float32)
    assert path.name == "model.safetensors"
    names = set(safetensors_torch.load_file(str(path)))
    assert ("lm_head.weight" in names) is not tied
    assert "model.layers.1.self_attn.kv_b_proj.weight" in names
    back = load_model(tmp_path)
    _same(m, back)
    assert (back.lm_head.weight is back.model.embed_tokens.weight) is tied
    ids = torch.tensor([[1, 4, 9, 16, 25]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids), m(ids))


def test_bf16_checkpoint_loads_in_fp32(tmp_path: Path) -> None:
    m = tiny_model()
    save_model(m, tmp_path)  # bf16 on disk (the committed model's format)
    back = load_model(tmp_path, dtype=torch.float32)
    assert back.dtype == torch.float32
    _same(m, back, atol=0.01)


def _write_deepseek_style(tmp_path: Path, m: MLAModel, fp8: bool) -> None:
    """Sharded safetensors with an index, an extra MTP layer (skipped) and, with fp8, DeepSeek's
    block-quantised weights (`weight_scale_inv`, 128 x 128 blocks; here 8 x 8)."""
    cfg = m.config.to_dict()
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [8, 8]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    state = {k: v.detach().clone() for k, v in m.state_dict().items()}
    n_layers = m.config.num_hidden_layers
    state[f"model.layers.{n_layers}.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)  # MTP
    if fp8:
        for k in [k for k in state if k.endswith("proj.weight") and "layers.0" in k]:
            w = state[k]
            s = torch.rand((w.shape[0] + 7) // 8, (w.shape[1] + 7) // 8) * 0.01 + 0.001
            big = s.repeat_interleave(8, 0)[: w.shape[0]].repeat_interleave(8, 1)[:, : w.shape[1]]
            q = (w / big).to(torch.float8_e4m3fn)
            state[k] = q
            state[k + "_scale_inv"] = s
            m.state_dict()[k].copy_(dequant_block_fp8(q, s, (8, 8)))  # what loading must give
    keys = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
        "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
    }
    wmap = {}
    for fname, ks in shards.items():
        safetensors_torch.save_file({k: state[k].contiguous() for k in ks}, str(tmp_path / fname))
        wmap.update(dict.fromkeys(ks, fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))


@pytest.mark.parametrize("fp8", [False, True])
def test_sharded_deepseek_checkpoint(tmp_path: Path, fp8: bool) -> None:
    m = tiny_model()
    _write_deepseek_style(tmp_path, m, fp8)
    back = load_model(tmp_path)
    _same(m, back, atol=1e-6)


def test_incomplete_or_foreign_checkpoints_are_refused(tmp_path: Path) -> None:
    m = tiny_model()
    save_model(m, tmp_path, dtype=torch.float32)
    state = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    bad = dict(state)
    del bad["model.layers.0.self_attn.o_proj.weight"]
    safetensors_torch.save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        E2EError, match="lacks 1 model tensors, e.g. model.layers.0.self_attn.o_proj"
    ):
        load_model(tmp_path)
    bad = dict(state, **{"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(2, 2)})
    safetensors_torch.save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(E2EError, match="does not have, e.g. model.layers.0.mlp.experts.0"):
        load_model(tmp_path)
    bad = dict(state, **{"model.norm.weight": torch.ones(3)})
    safetensors_torch.save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(E2EError, match=r"model.norm.weight: checkpoint shape \(3,\)"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(E2EError, match="has no weights"):
        load_model(tmp_path)


def _write(tmp_path: Path, m: MLAModel, state: dict, config: dict | None = None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config or m.config.to_dict()))
    safetensors_torch.save_file(
        {k: v.detach().contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors")
    )


def test_transformers_fused_expert_layout_loads(tmp_path: Path) -> None:
    """transformers' save layout: `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
    `mlp.experts.down_proj` [E, H, I] are split into the per-expert weights."""
    m = tiny_model(**{**MOE, "first_k_dense_replace": 0})
    state = fuse_experts(m.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    assert not any(".experts.0." in k for k in state)
    _write(tmp_path, m, state)
    back = load_model(tmp_path)
    _same(m, back)
    ids = torch.tensor([[1, 4, 9, 16, 25, 36, 49]])
    with torch.no_grad():
        torch.testing.assert_close(back(ids), m(ids))
    # the gate half is the first: swapping the halves must change the weights
    swapped = dict(state)
    gu = state["model.layers.0.mlp.experts.gate_up_proj"]
    swapped["model.layers.0.mlp.experts.gate_up_proj"] = torch.cat(gu.chunk(2, dim=1)[::-1], dim=1)
    _write(tmp_path, m, swapped)
    wrong = load_model(tmp_path).model.layers[0].mlp.experts[3].gate_proj.weight
    assert torch.equal(wrong, m.model.layers[0].mlp.experts[3].up_proj.weight)


def test_bad_fused_experts_are_one_line_errors(tmp_path: Path) -> None:
    m = tiny_model(**MOE)
    state = fuse_experts(m.state_dict())
    name = "model.layers.1.mlp.experts.down_proj"
    _write(tmp_path, m, {**state, name: state[name][:5]})
    with pytest.raises(E2EError, match="down_proj: 5 experts, config has 8"):
        load_model(tmp_path)
    _write(tmp_path, m, {**state, name: state[name][0]})
    with pytest.raises(E2EError, match="fused experts must be 3-D"):
        load_model(tmp_path)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    _write(tmp_path, m, {**state, name: state[name][:, :-1]})
    with pytest.raises(E2EError, match="gate_up_proj rows must be 2 x moe_intermediate_size"):
        load_model(tmp_path)


def test_moe_layer_freq_checkpoints(tmp_path: Path) -> None:
    """moe_layer_freq 2 is ignored, as transformers does: a checkpoint routed in every layer
    >= first_k_dense_replace (what transformers saves) loads; one with DeepSeek's remote-code
    layout (a dense MLP in layer 1) is refused, naming moe_layer_freq."""
    m = tiny_model(**{**MOE, "first_k_dense_replace": 0}, moe_layer_freq=2)
    _write(tmp_path, m, m.state_dict())
    _same(m, load_model(tmp_path))
    state = {k: v for k, v in m.state_dict().items() if not k.startswith("model.layers.1.mlp.")}
    h, inter = m.config.hidden_size, m.config.intermediate_size
    state["model.layers.1.mlp.gate_proj.weight"] = torch.zeros(inter, h)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(inter, h)
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(h, inter)
    _write(tmp_path, m, state)
    with pytest.raises(E2EError, match=r"^moe_layer_freq 2 not supported: .*model\.layers\.1\.mlp"):
        load_model(tmp_path)
