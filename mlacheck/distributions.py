"""What each input tensor of an MLA layer looks like: per-tensor input distributions.

A kernel that dequantises one tensor with another's FP8 scale, or mixes up the rope and the
latent part of a row, is only wrong by as much as those tensors differ. Unit-variance noise
in every tensor hides such bugs (every per-tensor amax scale is then the same to ~1 %: an
audit found 0 of 22 such bugs caught on those inputs, 21 of 22 when only the draw changed).
Real layers differ per tensor and per channel, so the inputs do too. A case names one of:

- `gaussian` (the default): normal values with one standard deviation per tensor role, set
  so every score distribution is what it was with unit variance (std_q x std_k = 1: the
  softmax temperature the tolerances were calibrated on) while each tensor's per-tensor
  amax scale sits a factor 2-4 from the others' (a mix-up then costs 50-300 %).
- `layer`: shaped like a trained layer's activations (numbers and sources below): separate
  ranges for q_nope, q_pe, the latent c_kv, k_pe and V; per-channel and per-128-channel-group
  gains; heavy outlier channels in the latent; massive values with a consistent sign in the
  low-frequency rope channels of q and k (not in V); per-token and per-head magnitudes.
- `ties`: keys (and the latent) repeat a few vectors with a 1e-3 jitter, so many scores tie
  or nearly tie: online-softmax max updates, top-k selection and tie-breaking.

Sources of the `layer` numbers (ratios, not absolute values: a case is a synthetic layer):
1. mlacheck's own trained DeepSeek-V3-architecture model (references/e2e_model, 4 layers,
   kv_lora_rank 64, rope 16), activations measured on 64 held-out prompts (layers 1-3):
   std q_nope 0.64-1.11, q_pe 1.2-2.0 (2x q_nope), absorbed q_nope 0.24-0.56, c_kv (after
   kv_a_layernorm) 0.71-0.86, k_pe 1.4-2.8 (2-3x c_kv), k_nope 0.30-0.38, V 0.55-0.83;
   per-channel std max / median 1.2-1.8 (q, k_nope, V), 1.8-2.9 (c_kv), 2.3-3.1 (k_pe);
   largest |channel mean| / std 2.5-4.7 in c_kv (RMSNorm massive channels), ~1 in k_pe;
   amax / std 4-13; per-token norm p95 / p5 1.3 (c_kv), 2-6.5 (q, k_pe, V); score row std
   1.4-5.1, 80-95 % of it from the rope part; LSE median 6-13, max 41.
2. SnapMLA (Zhang et al., arXiv 2602.10718): in DeepSeek-class MLA KV caches the rope part
   has outlier tails spanning up to ~103 while the latent content is tightly centred on 0.
3. Jin et al., "Massive Values in Self-Attention Modules are the Key to Contextual Knowledge
   Understanding" (ICML 2025): massive values concentrate in the same low-frequency rope
   dimensions of Q and K, and not in V.
4. DeepSeek-V3.2 / FlashMLA's FP8 sparse cache: the 512 latent channels stored with one scale
   per 128-channel tile and the 64 rope channels in bf16 (docs/flashmla.md): channel groups
   and the rope part have ranges that one scale serves badly. The V3.2 indexer rotates q and
   k with a Hadamard transform before FP8 (outliers spread over channels; per-token
   magnitudes remain), hence its roles here have token, not channel, structure.
5. vLLM computes separate q, k and v scales (calc_kv_scales: amax / Q_, K_, V_SCALE_CONSTANT,
   200 / 200 / 100): per-tensor scales that differ are the normal case.

Everything is drawn from mlacheck.rng's counter-based streams keyed by the case, and every
gain is computed on the CPU and applied with one correctly rounded fp32 operation per pass,
so a case's tensors are the same bits on every device. Drawing a tensor for a new op:
`draw(case, "index_k", (n, 1, 128), device)` (roles below; add one to ROLES_OF).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mlacheck import rng
from mlacheck.spec import DISTRIBUTIONS, Case

DEFAULT = "gaussian"


@dataclass(frozen=True)
class Part:
    """How the values of one channel range of a tensor are drawn (all gains multiply)."""

    std: float = 1.0
    channel_sigma: float = 0.0  # per-channel gain exp(sigma * z): channels differ in range
    group_channels: int = 0  # channels per group sharing an extra gain (0: none)
    group_sigma: float = 0.0  # ... exp(sigma * z) per group (FlashMLA's 128-channel tiles)
    outliers: int = 0  # channels whose gain is multiplied by outlier_gain (heavy channels)
    outlier_gain: float = 1.0
    massive: int = 0  # channels carrying a consistent offset (massive values)
    massive_mean: float = 0.0  # that offset, in units of std
    # massive channels are the part's last ones with a positive offset (the low-frequency rope
    # pairs, the same in q and k); otherwise drawn per case with random signs
    massive_last: bool = False
    token_sigma: float = 0.0  # per-token gain exp(sigma * z) (shared by a token's heads)
    head_sigma: float = 0.0  # per-head gain exp(sigma * z)
    shared_heads: bool = False  # every head holds head 0's values (k_pe in the MHA view)


@dataclass(frozen=True)
class Role:
    """A tensor role: its leading channels (`body`) and its trailing rope channels (the
    case's qk_rope of them; `rope` None: no rope part). `codes` > 0: every token's row is
    one of `codes` vectors plus `jitter` x std noise (near-ties)."""

    body: Part
    rope: Part | None = None
    codes: int = 0
    jitter: float = 0.0


# --------------------------------------------------------------------------- profiles

_GAUSSIAN = {
    # MHA view (prefill): q [T, H, 192], k [T, H, 192], v [T, H, 128]
    "q": Role(Part(2.0)),
    "k": Role(Part(0.5)),
    "v": Role(Part(1.0)),
    # absorbed view (decode, sparse): q [T, H, 576], the latent cache [N, 1, 576]
    "q_latent": Role(Part(2.0)),
    "kv_latent": Role(Part(0.5)),
    # DeepSeek-V3.2 lightning indexer: q [T, H_idx, D_idx], keys [N, 1, D_idx]
    "index_q": Role(Part(2.0)),
    "index_k": Role(Part(0.5)),
}

# Low-frequency rope channels with massive values (source 3), in q and in k.
_Q_PE = Part(0.85, channel_sigma=0.25, massive=4, massive_mean=1.0, massive_last=True,
             token_sigma=0.25, head_sigma=0.15)
_K_PE = Part(2.3, channel_sigma=0.4, massive=4, massive_mean=1.0, massive_last=True,
             token_sigma=0.3, shared_heads=True)
_LAYER = {
    "q": Role(Part(1.0, channel_sigma=0.15, token_sigma=0.25, head_sigma=0.15), _Q_PE),
    "k": Role(Part(0.35, channel_sigma=0.2, token_sigma=0.25, head_sigma=0.15), _K_PE),
    "v": Role(Part(0.35, channel_sigma=0.1, token_sigma=0.35, head_sigma=0.15)),
    "q_latent": Role(Part(0.4, channel_sigma=0.25, token_sigma=0.25, head_sigma=0.15), _Q_PE),
    # c_kv after kv_a_layernorm: per-channel and per-128-group gains, 2 heavy channels, 4
    # massive channels, nearly constant token norms (it is normalised); then k_pe
    "kv_latent": Role(Part(0.8, channel_sigma=0.25, group_channels=128, group_sigma=0.3,
                           outliers=2, outlier_gain=4.0, massive=4, massive_mean=3.5,
                           token_sigma=0.08), _K_PE),
    "index_q": Role(Part(1.0, token_sigma=0.3, head_sigma=0.2)),
    "index_k": Role(Part(0.6, token_sigma=0.3)),
}

_TIE_CODES, _TIE_JITTER = 8, 1e-3
_TIES = {
    **_GAUSSIAN,
    "k": Role(Part(0.5), codes=_TIE_CODES, jitter=_TIE_JITTER),
    "kv_latent": Role(Part(0.5), codes=_TIE_CODES, jitter=_TIE_JITTER),
    "index_k": Role(Part(0.5), codes=_TIE_CODES, jitter=_TIE_JITTER),
}

PROFILES: dict[str, dict[str, Role]] = {"gaussian": _GAUSSIAN, "layer": _LAYER, "ties": _TIES}
ROLES: tuple[str, ...] = tuple(_GAUSSIAN)


def _check_profiles() -> None:
    """The case spec (torch-free) names the distributions; this module must define exactly
    those, each with every role."""
    if tuple(PROFILES) != tuple(DISTRIBUTIONS):
        raise ImportError(f"mlacheck.distributions defines {tuple(PROFILES)}, the spec names "
                          f"{tuple(DISTRIBUTIONS)}")
    for name, roles in PROFILES.items():
        if set(roles) != set(ROLES):
            raise ImportError(f"distribution {name!r} lacks roles {set(ROLES) - set(roles)}")


_check_profiles()


# --------------------------------------------------------------------------- drawing


def draw(case: Case, role: str, shape: tuple[int, ...], device: torch.device | str = "cpu",
         stream: str | None = None) -> torch.Tensor:
    """The case's tensor of `role` (fp32, `shape` = [tokens, heads, channels] or [tokens,
    channels]; the last qk_rope channels are the rope part where the role has one), drawn
    from the case's stream `stream` (default: the role's name) under the case's distribution.
    """
    dist = getattr(case, "distribution", DEFAULT)
    return draw_from(case.seed_material, dist, role, shape, device, case.dims.qk_rope, stream)


def draw_from(seed: int, distribution: str, role: str, shape: tuple[int, ...],
              device: torch.device | str = "cpu", rope_width: int = 64,
              stream: str | None = None) -> torch.Tensor:
    """draw() for inputs that are not a case's (any seed, distribution and rope width)."""
    try:
        spec = PROFILES[distribution][role]
    except KeyError:
        raise ValueError(f"no role {role!r} in distribution {distribution!r}; distributions: "
                         f"{', '.join(PROFILES)}; roles: {', '.join(ROLES)}") from None
    key = rng.stream_key(seed, stream or role)
    x = rng.normal(shape, key, device)
    channels = shape[-1]
    tokens = math.prod(shape[:-2]) if len(shape) >= 3 else math.prod(shape[:-1])
    heads = shape[-2] if len(shape) >= 3 else 1
    view = x.view(tokens, heads, channels)
    if spec.codes:
        _repeat_codes(view, spec, key)
    parts = _parts(spec, channels, rope_width)
    gain = np.concatenate([_channel_gains(p, b - a, key, i) for i, (a, b, p) in enumerate(parts)])
    view.mul_(torch.from_numpy(gain).to(x.device))
    for i, (a, b, p) in enumerate(parts):
        seg = view[..., a:b]
        if p.token_sigma and tokens > 1:
            g = _lognormal(tokens, p.token_sigma, rng.stream_key(key, "tokens", i))
            seg.mul_(torch.from_numpy(g).to(x.device).view(tokens, 1, 1))
        if p.head_sigma and heads > 1:
            g = _lognormal(heads, p.head_sigma, rng.stream_key(key, "heads", i))
            seg.mul_(torch.from_numpy(g).to(x.device).view(1, heads, 1))
        if p.massive and p.massive_mean:
            seg.add_(torch.from_numpy(_offsets(p, b - a, key, i)).to(x.device))
        if p.shared_heads and heads > 1:
            seg[:, 1:].copy_(seg[:, :1].expand(-1, heads - 1, -1))
    return x


def _parts(spec: Role, channels: int, rope_width: int) -> list[tuple[int, int, Part]]:
    """(first, end, part) channel ranges: the body, then the rope part where there is one."""
    if spec.rope is None or rope_width <= 0 or rope_width >= channels:
        return [(0, channels, spec.body)]
    cut = channels - rope_width
    return [(0, cut, spec.body), (cut, channels, spec.rope)]


def _lognormal(n: int, sigma: float, key: int) -> np.ndarray:
    """exp(sigma * z) for n counter-based normals z, computed on the CPU in float64."""
    z = rng.normal((n,), key).numpy().astype(np.float64)
    return np.exp(sigma * z).astype(np.float32)


def _channel_gains(p: Part, width: int, key: int, index: int) -> np.ndarray:
    """The part's per-channel gains: std x channel x group x outlier gains (fp32)."""
    g = np.full(width, p.std, dtype=np.float64)
    if p.channel_sigma:
        g *= _lognormal(width, p.channel_sigma, rng.stream_key(key, "channels", index))
    if p.group_channels and p.group_sigma:
        groups = -(-width // p.group_channels)
        per = _lognormal(groups, p.group_sigma, rng.stream_key(key, "groups", index))
        g *= np.repeat(per.astype(np.float64), p.group_channels)[:width]
    if p.outliers:
        g[_pick(width, p.outliers, rng.stream_key(key, "outliers", index))] *= p.outlier_gain
    return g.astype(np.float32)


def _offsets(p: Part, width: int, key: int, index: int) -> np.ndarray:
    """The consistent per-channel offsets of the massive channels (0 elsewhere)."""
    off = np.zeros(width, dtype=np.float32)
    n = min(p.massive, width)
    if p.massive_last:
        off[width - n:] = p.massive_mean * p.std
        return off
    at = _pick(width, n, rng.stream_key(key, "massive", index))
    signs = np.sign(rng.normal((n,), rng.stream_key(key, "massive-sign", index)).numpy())
    off[at] = (p.massive_mean * p.std * signs).astype(np.float32)
    return off


def _pick(width: int, n: int, key: int) -> np.ndarray:
    """n distinct channels of width, drawn from the stream `key` (argsort of its values)."""
    return np.argsort(rng.normal((width,), key).numpy(), kind="stable")[: min(n, width)]


def _repeat_codes(view: torch.Tensor, spec: Role, key: int) -> None:
    """Rows become one of spec.codes vectors (per token, the same code for every head) plus
    jitter x the row's own values, in place: view [tokens, heads, channels]."""
    tokens, heads, channels = view.shape
    book = rng.normal((spec.codes, heads, channels), rng.stream_key(key, "codebook"),
                      view.device)
    which = rng.integers(tokens, spec.codes, rng.stream_key(key, "codes"), view.device)
    view.mul_(spec.jitter).add_(book[which])


def profile(distribution: str, role: str) -> Role:
    return PROFILES[distribution][role]
