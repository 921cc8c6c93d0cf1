"""Rotary position embedding as DeepSeek-V2/V3 apply it: plain or YaRN frequencies, cos/sin
scaled by YaRN's `_mscale`, and DeepSeek's interleaved pair layout.

With `rope_interleave` (DeepSeek's checkpoints) the rotary dims are pairs `(x0, x1), (x2, x3),
...`; the rotated result is laid out de-interleaved `[evens ‖ odds]`, exactly as DeepSeek's
reference code (and transformers' `apply_rotary_pos_emb_interleave`) produce it. q_pe and
k_pe get the same layout, so their dot products are those of the reference.
"""

from __future__ import annotations

import math

import torch

from mlacheck.e2e.config import ModelConfig


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """DeepSeek's `DeepseekV3YarnRotaryEmbedding` frequencies (fp32, [rope/2])."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    rs = cfg.rope_scaling
    expo = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    freq_extra = 1.0 / (base**expo)
    if rs is None:
        return freq_extra.to(torch.float32)
    freq_inter = 1.0 / (rs.factor * base**expo)
    orig = rs.original_max_position_embeddings
    low = float(max(math.floor(_correction_dim(rs.beta_fast, dim, base, orig)), 0))
    high = float(min(math.ceil(_correction_dim(rs.beta_slow, dim, base, orig)), dim - 1))
    if low == high:
        high += 0.001  # DeepSeek's yarn_linear_ramp_mask guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extra_mask = 1.0 - ramp
    inv = freq_inter * (1 - extra_mask) + freq_extra * extra_mask
    return inv.to(torch.float32)


class Rotary:
    """cos/sin tables for given positions (computed on the fly: no length limit)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        self._master = yarn_inv_freq(cfg)  # on the CPU, whatever the default device
        self.inv_freq = self._master
        self.to(device)
        self.scale = cfg.rope_scaling.cos_sin_scale if cfg.rope_scaling is not None else 1.0
        self.interleave = cfg.rope_interleave

    def to(self, device: torch.device | str) -> Rotary:
        dev = torch.device(device)
        if dev.type != "meta":  # a model built on the meta device gets real tables later
            self.inv_freq = self._master.to(dev)
        return self

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (any shape, integer) -> cos, sin of shape positions.shape + [rope/2], fp32."""
        freqs = positions.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq
        return freqs.cos() * self.scale, freqs.sin() * self.scale


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate the last dim of x; cos/sin broadcast against x[..., :d/2]. Computed in fp32."""
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
