"""Shared pieces of the e2e unit tests (imported as `_e2e_helpers`): a tiny random
DeepSeek-V3-architecture model."""

from __future__ import annotations

from typing import Any

import torch

from mlacheck.e2e.config import DEEPSEEK_V3_ROPE_SCALING, ModelConfig
from mlacheck.e2e.model import MLAModel


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
