"""The Hugging Face DeepSeek layout: config.json + safetensors (single, sharded, FP8 blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _e2e_helpers import tiny_model

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
