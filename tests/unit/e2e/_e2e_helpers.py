"""Shared pieces of the e2e unit tests (imported as `_e2e_helpers`): a tiny random
DeepSeek-V3-architecture model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from mlacheck.e2e.config import DEEPSEEK_V3_ROPE_SCALING, ModelConfig
from mlacheck.e2e.model import MLAModel

REPO = Path(__file__).resolve().parents[3]
# The committed trained models (references/e2e_model/train.py presets -> directories): the
# small CPU demo and the one with DeepSeek's attention dims that production kernels accept.
COMMITTED_MODELS: dict[str, Path] = {
    "small": REPO / "references" / "e2e_model",
    "deepseek-dims": REPO / "references" / "e2e_model_deepseek_dims",
}

# DeepSeek-V3's attention: 576-wide latent (512 + 64), q/k 192, v 128, q-LoRA, 16 heads (128
# at tensor parallelism 8); for tiny_config, whose hidden size stays small.
DEEPSEEK_DIMS: dict[str, Any] = dict(
    num_attention_heads=16,
    q_lora_rank=24,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)


def has_weights(directory: Path) -> bool:
    return any((directory / f).is_file() for f in ("model.safetensors", "model.pt"))


# A routed mixture of experts for tiny_config: V3's noaux_tc router (sigmoid, 2 groups of 4,
# correction bias), top-2 of 8 experts plus one shared expert.
MOE: dict[str, Any] = dict(
    first_k_dense_replace=1,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
)


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A per-expert state dict in transformers' fused layout, built the way transformers'
    checkpoint conversion for deepseek_v3 builds it (conversion_mapping.py: gate_proj / up_proj
    `[MergeModulelist(dim=0), Concatenate(dim=1)]` -> `mlp.experts.gate_up_proj` [E, 2I, H];
    down_proj `[MergeModulelist(dim=0)]` -> `mlp.experts.down_proj` [E, H, I])."""
    out = dict(state)
    prefixes = sorted(
        {k.rsplit(".", 3)[0] for k in state if re.search(r"\.mlp\.experts\.\d+\.", k)}
    )
    for pre in prefixes:  # "model.layers.N.mlp.experts"
        n = 1 + max(int(k[len(pre) + 1 :].split(".")[0]) for k in state if k.startswith(pre + "."))
        gate = torch.stack([out.pop(f"{pre}.{e}.gate_proj.weight") for e in range(n)])
        up = torch.stack([out.pop(f"{pre}.{e}.up_proj.weight") for e in range(n)])
        out[f"{pre}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        out[f"{pre}.down_proj"] = torch.stack(
            [out.pop(f"{pre}.{e}.down_proj.weight") for e in range(n)]
        ).contiguous()
    return out


def tiny_config(**over: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_scaling=DEEPSEEK_V3_ROPE_SCALING,
        max_position_embeddings=163840,
        first_k_dense_replace=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(over)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, std: float = 0.25, **over: Any) -> MLAModel:
    """Random weights large enough (std) that attention is far from uniform."""
    torch.manual_seed(seed)
    m = MLAModel(tiny_config(**over))
    m.init_weights(seed, std=std)
    return m.eval()
