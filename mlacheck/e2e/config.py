"""The model configuration: transformers' DeepseekV3 keys (`config.json` of a DeepSeek checkpoint).

Only what the runner needs is kept; unknown keys are carried in `extra` (so a real
checkpoint's config round-trips). Both spellings of rotary scaling are read: the legacy
`rope_theta` + `rope_scaling` (what DeepSeek's own config.json files use; `type` or
`rope_type`) and transformers 5's `rope_parameters` (`rope_type`, `rope_theta`, ...).

The attention softmax scale is the model's, computed the way DeepSeek computes it:
`1/sqrt(qk_nope + qk_rope)`, times `yarn_get_mscale(factor, mscale_all_dim)^2` when YaRN
scaling is configured — i.e. `mlacheck.spec.softmax_scale` of `mla_dims`.

Where transformers' `DeepseekV3*` classes and DeepSeek's own remote code
(`modeling_deepseek.py`) disagree, this follows transformers (the reference the unit tests
compare logits against; docs/e2e.md §1 lists the cases): YaRN's cos/sin scale when only one of
`mscale` / `mscale_all_dim` is set, `original_max_position_embeddings` when absent, and
`moe_layer_freq` (ignored). What neither path here models is refused with an `E2EError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mlacheck.spec import MLADims, softmax_scale, yarn_mscale


class E2EError(ValueError):
    """A model, checkpoint or runner problem, said in one line."""


MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
DEFAULT_ARCHITECTURES = ["DeepseekV3ForCausalLM"]


@dataclass(frozen=True)
class RopeScaling:
    """YaRN rotary scaling as DeepSeek configures it (`rope_scaling` of config.json)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # None = absent from the config. Not the same as 1.0: transformers' YaRN ignores `mscale`
    # unless `mscale_all_dim` is set too, and then an absent `mscale` is not 1 (cos_sin_scale).
    mscale: float | None = None
    mscale_all_dim: float = 0.0  # absent == 0 everywhere (transformers tests truthiness)
    attention_factor: float | None = None  # explicit cos/sin scale (transformers key)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "type": "yarn",
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "mscale_all_dim": self.mscale_all_dim,
        }
        if self.mscale is not None:  # absent stays absent (see `mscale`)
            d["mscale"] = self.mscale
        if self.attention_factor is not None:
            d["attention_factor"] = self.attention_factor
        return d

    @property
    def cos_sin_scale(self) -> float:
        """The factor on cos/sin, as transformers' `_compute_yarn_parameters`
        (src/transformers/modeling_rope_utils.py) sets `attention_factor`:

            if attention_factor is None:
                if mscale and mscale_all_dim:
                    attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                else:
                    attention_factor = get_mscale(factor)

        DeepSeek's remote code instead always takes `yarn_get_mscale(factor, mscale) /
        yarn_get_mscale(factor, mscale_all_dim)` with defaults mscale 1, mscale_all_dim 0; the
        two agree when both keys are set (DeepSeek-V3: 1.0) or mscale is 1 and mscale_all_dim
        absent, and differ otherwise (e.g. mscale 0.707 alone: 1.369 here, 1.261 there).
        """
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor, 1.0)  # transformers' get_mscale(factor), mscale=1


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3-architecture model (transformers `DeepseekV3Config` key names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = None
    # Mixture of experts (layers >= first_k_dense_replace); an all-dense model sets
    # first_k_dense_replace = num_hidden_layers (or n_routed_experts = None).
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1  # carried for the round trip only: ignored, as transformers does
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"  # DeepSeek-V3: sigmoid (+ e_score_correction_bias); V2: softmax
    topk_method: str = "noaux_tc"  # V3: noaux_tc; V2: greedy / group_limited_greedy
    model_type: str = "deepseek_v3"
    torch_dtype: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise E2EError(f"hidden_act {self.hidden_act!r} not supported (DeepSeek uses silu)")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            if int(getattr(self, name)) < 1:
                raise E2EError(f"config {name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise E2EError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.is_moe_model:
            for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, name) is None:
                    raise E2EError(f"a mixture-of-experts config needs {name}")
            if self.scoring_func not in ("sigmoid", "softmax"):
                raise E2EError(f"scoring_func {self.scoring_func!r} not supported")
            if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
                raise E2EError(f"topk_method {self.topk_method!r} not supported")

    # -- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_moe_model(self) -> bool:
        return bool(self.n_routed_experts) and self.first_k_dense_replace < self.num_hidden_layers

    def is_moe_layer(self, i: int) -> bool:
        """Every layer from `first_k_dense_replace` on, as transformers' `DeepseekV3DecoderLayer`
        builds it (`if layer_idx >= config.first_k_dense_replace: self.mlp =
        DeepseekV3MoE(config)`): `moe_layer_freq` is not read there (it is not a
        `DeepseekV3Config` argument). DeepSeek's remote code also requires
        `layer_idx % moe_layer_freq == 0`; such a checkpoint (dense MLPs between MoE layers)
        is refused on load, naming moe_layer_freq (checkpoint.load_model)."""
        return self.is_moe_model and i >= self.first_k_dense_replace

    @property
    def mla_dims(self) -> MLADims:
        """The model's MLA dims for mlacheck cases (their softmax scale is the model's)."""
        rs = self.rope_scaling
        return MLADims(
            qk_nope=self.qk_nope_head_dim,
            qk_rope=self.qk_rope_head_dim,
            v_head=self.v_head_dim,
            kv_lora_rank=self.kv_lora_rank,
            rope_factor=rs.factor if rs is not None else 1.0,
            mscale_all_dim=rs.mscale_all_dim if rs is not None else 0.0,
        )

    @property
    def softmax_scale(self) -> float:
        return softmax_scale(self.mla_dims)

    def num_parameters(self) -> int:
        """Parameter count of the model this config describes (lm_head counted once if tied)."""
        h, heads = self.hidden_size, self.num_attention_heads
        if self.q_lora_rank is None:
            q = h * heads * self.qk_head_dim
        else:
            q = (
                h * self.q_lora_rank
                + self.q_lora_rank
                + self.q_lora_rank * heads * self.qk_head_dim
            )
        attn = (
            q
            + h * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            + heads * self.v_head_dim * h
        )
        total = 0
        for i in range(self.num_hidden_layers):
            if self.is_moe_layer(i):
                assert self.n_routed_experts and self.moe_intermediate_size
                mi = self.moe_intermediate_size
                mlp = self.n_routed_experts * (3 * h * mi + h)  # experts + router rows
                mlp += 3 * h * mi * (self.n_shared_experts or 0)
            else:
                mlp = 3 * h * self.intermediate_size
            total += attn + mlp + 2 * h
        emb = self.vocab_size * h
        return total + emb + (0 if self.tie_word_embeddings else emb) + h

    # -- (de)serialisation
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        d = dict(raw)
        model_type = str(d.get("model_type", "deepseek_v3"))
        if model_type not in MODEL_TYPES:
            raise E2EError(
                f"model_type {model_type!r} is not a DeepSeek-V2/V3 (MLA) architecture "
                f"(known: {', '.join(MODEL_TYPES)})"
            )
        rope_theta, scaling = _rope_from(d, d.get("max_position_embeddings"))
        names = {f.name for f in fields(cls)} - {"rope_scaling", "rope_theta", "extra"}
        kwargs: dict[str, Any] = {k: d.pop(k) for k in list(d) if k in names}
        for k in ("rope_scaling", "rope_parameters", "rope_theta"):
            d.pop(k, None)
        # written by to_dict, implied by the rest: MLA's one latent KV head serves all heads
        d.pop("num_key_value_heads", None)
        if d.get("architectures") == DEFAULT_ARCHITECTURES:
            d.pop("architectures")
        eos = kwargs.get("eos_token_id")
        if isinstance(eos, list):  # several EOS ids: the first is the one generation stops on
            kwargs["eos_token_id"] = eos[0] if eos else None
            d["eos_token_ids"] = eos
        if kwargs.get("first_k_dense_replace") is None:
            kwargs["first_k_dense_replace"] = 0
        for key, default in (
            ("routed_scaling_factor", 1.0),
            ("moe_layer_freq", 1),
            ("norm_topk_prob", True),
        ):
            if kwargs.get(key) is None:
                kwargs[key] = default
        if kwargs.get("v_head_dim") is None:
            kwargs["v_head_dim"] = kwargs.get("qk_nope_head_dim")
        if kwargs.get("rope_interleave") is None:
            kwargs.pop("rope_interleave", None)
        missing = [
            n
            for n in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
            )
            if kwargs.get(n) is None
        ]
        if missing:
            raise E2EError(f"config lacks {', '.join(missing)}")
        if model_type == "deepseek_v2":  # V2 / V2-Lite: softmax gate, no score bias
            kwargs.setdefault("scoring_func", "softmax")
            kwargs.setdefault("topk_method", "greedy")
        try:
            return cls(rope_theta=rope_theta, rope_scaling=scaling, extra=d, **kwargs)
        except TypeError as e:
            raise E2EError(f"bad model config: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """config.json content in DeepSeek's own (hub) spelling."""
        out: dict[str, Any] = {"architectures": list(DEFAULT_ARCHITECTURES)}
        out.update(self.extra)
        keep_none = ("q_lora_rank", "bos_token_id", "eos_token_id", "pad_token_id")
        for f in fields(self):
            if f.name in ("extra", "rope_scaling"):
                continue
            value = getattr(self, f.name)
            if value is not None or f.name in keep_none:  # None MoE sizes: an all-dense model
                out[f.name] = value
        out["num_key_value_heads"] = self.num_attention_heads
        out["rope_scaling"] = self.rope_scaling.to_dict() if self.rope_scaling else None
        out.pop("eos_token_ids", None)
        return out

    @classmethod
    def load(cls, path: Path | str) -> ModelConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise E2EError(f"cannot read {p}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise E2EError(f"{p} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise E2EError(f"{p} must hold a JSON object")
        return cls.from_dict(raw)

    def save(self, path: Path | str) -> None:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        p.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _rope_from(
    d: Mapping[str, Any], max_position_embeddings: Any
) -> tuple[float, RopeScaling | None]:
    params = d.get("rope_parameters")
    legacy = d.get("rope_scaling")
    theta = d.get("rope_theta")
    spec: Mapping[str, Any] | None
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        spec = params
    else:
        spec = legacy if isinstance(legacy, Mapping) else None
    theta_f = float(theta) if theta is not None else 10000.0
    if spec is None:
        return theta_f, None
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind in ("default", None):
        return theta_f, None
    if kind != "yarn":
        raise E2EError(f"rope scaling {kind!r} not supported (DeepSeek models use yarn)")
    # transformers' `standardize_rope_params` (modeling_rope_utils.py), for yarn:
    # `self.rope_parameters.setdefault("original_max_position_embeddings",
    # self.max_position_embeddings)`; DeepseekV3Config's max_position_embeddings defaults to
    # 4096. (DeepSeek's remote code defaults original_max_position_embeddings to 4096.)
    max_pos = int(max_position_embeddings) if max_position_embeddings is not None else 4096
    orig = spec.get("original_max_position_embeddings")
    orig_i = int(orig) if orig is not None else max_pos
    if orig_i < 1:
        raise E2EError(f"bad YaRN original_max_position_embeddings {orig}")
    # `_compute_yarn_parameters`: `if factor is None: factor = config.max_position_embeddings /
    # original_max_position_embeddings`
    raw_factor = spec.get("factor")
    factor = float(raw_factor) if raw_factor is not None else max_pos / orig_i
    if not math.isfinite(factor) or factor <= 0:
        raise E2EError(f"bad YaRN factor {factor}")
    # `truncate` (transformers: floor/ceil the correction range unless False) is not modelled:
    # rope.yarn_inv_freq always truncates, as DeepSeek's code does.
    if not spec.get("truncate", True):  # transformers: `if truncate:` (a null is falsy too)
        raise E2EError("rope scaling truncate=false not supported (YaRN ramp is truncated)")

    def num(key: str, default: float) -> float:
        # transformers: `rope_parameters_dict.get("beta_fast") or 32` (likewise beta_slow or 1):
        # a missing, null or zero value takes the default
        v = spec.get(key)  # type: ignore[union-attr]
        return float(v) if v else default

    af = spec.get("attention_factor")
    ms = spec.get("mscale")
    msad = spec.get("mscale_all_dim")
    return theta_f, RopeScaling(
        factor=factor,
        original_max_position_embeddings=orig_i,
        beta_fast=num("beta_fast", 32.0),
        beta_slow=num("beta_slow", 1.0),
        mscale=float(ms) if ms is not None else None,
        mscale_all_dim=float(msad) if msad is not None else 0.0,
        attention_factor=float(af) if af is not None else None,
    )


# DeepSeek-V3 / R1's own rope scaling (config.json on the hub).
DEEPSEEK_V3_ROPE_SCALING = RopeScaling(
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)
