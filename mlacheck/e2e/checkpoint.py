"""Loading and saving models in the Hugging Face DeepSeek layout: a directory with
`config.json` and `model.safetensors` (or sharded `model-0000N-of-0000M.safetensors` with
`model.safetensors.index.json`), parameter names as in transformers' `DeepseekV3ForCausalLM`.

* `lm_head.weight` may be absent when `tie_word_embeddings` is set (tied to the embedding).
* DeepSeek's own FP8 checkpoints (`quantization_config.quant_method == "fp8"`) store
  block-quantised weights with a `<name>_scale_inv` tensor per weight; they are dequantised
  on load (`weight_block_size`, default 128 x 128).
* Layers past `num_hidden_layers` (DeepSeek-V3's multi-token-prediction layer 61) are skipped.
* transformers' fused routed-expert layout (`mlp.experts.gate_up_proj` [E, 2I, H] and
  `mlp.experts.down_proj` [E, H, I], what `DeepseekV3NaiveMoe` holds) is split on load into
  the per-expert `mlp.experts.N.{gate,up,down}_proj.weight` the model uses.
* `model.pt` (a torch state dict) is read when there is no safetensors file.

`safetensors` is imported only when a safetensors file is read or written.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from mlacheck.e2e.config import E2EError, ModelConfig
from mlacheck.e2e.model import MLAModel

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_STATE = "model.pt"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# transformers' fused experts (modeling_deepseek_v3.py, DeepseekV3NaiveMoe):
#     self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
#     self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
_FUSED_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# a dense MLP's weights (what DeepSeek's moe_layer_freq puts between MoE layers)
_DENSE_MLP_RE = re.compile(r"^model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight$")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
DEFAULT_FP8_BLOCK = (128, 128)


def weight_files(directory: Path) -> list[Path]:
    """The files holding a checkpoint's weights, in load order."""
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        try:
            wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise E2EError(f"{index} is not a safetensors index: {e}") from None
        return [directory / f for f in sorted(set(wmap.values()))]
    if (directory / SAFETENSORS).is_file():
        return [directory / SAFETENSORS]
    if (directory / TORCH_STATE).is_file():
        return [directory / TORCH_STATE]
    raise E2EError(
        f"{directory} has no weights ({SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_STATE})"
    )


def _iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    if path.suffix == ".pt":
        state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()
        return
    try:
        from safetensors import safe_open
    except ImportError:
        raise E2EError(f"reading {path.name} needs the safetensors package") from None
    if not path.is_file():
        raise E2EError(f"missing weight file {path}")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield name, f.get_tensor(name)


def _block_size(cfg: ModelConfig) -> tuple[int, int] | None:
    q = cfg.extra.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return None
    bs = q.get("weight_block_size") or list(DEFAULT_FP8_BLOCK)
    return int(bs[0]), int(bs[1])


def dequant_block_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """DeepSeek FP8 weight [out, in] with per-block dequantisation factors -> fp32."""
    out_f, in_f = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)
    return w.float() * s[:, :in_f]


def split_fused_experts(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """transformers' fused `<prefix>.gate_up_proj` [E, 2I, H] / `<prefix>.down_proj` [E, H, I]
    -> the per-expert `<prefix>.N.{gate,up,down}_proj.weight` ([I, H], [I, H], [H, I]).

    The layout is transformers': its checkpoint conversion for deepseek_v3 (conversion_mapping.py,
    `mapping["deepseek_v3"] = mapping["qwen2_moe"]`) builds gate_up_proj from
    `mlp.experts.*.gate_proj.weight`, `mlp.experts.*.up_proj.weight` with
    `[MergeModulelist(dim=0), Concatenate(dim=1)]` (gate rows first), and the experts use it as
    `gate, up = nn.functional.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)`
    and `nn.functional.linear(current_hidden_states, self.down_proj[expert_idx])`."""
    m = _FUSED_RE.match(name)
    assert m is not None
    prefix, kind = m.groups()
    if t.dim() != 3:
        raise E2EError(
            f"{name}: fused experts must be 3-D [experts, out, in], got {tuple(t.shape)}"
        )
    out: list[tuple[str, torch.Tensor]] = []
    if kind == "down_proj":
        for e in range(t.shape[0]):
            out.append((f"{prefix}.{e}.down_proj.weight", t[e]))
        return out
    if t.shape[1] % 2:
        raise E2EError(
            f"{name}: gate_up_proj rows must be 2 x moe_intermediate_size, got {t.shape[1]}"
        )
    inter = t.shape[1] // 2
    for e in range(t.shape[0]):
        out.append((f"{prefix}.{e}.gate_proj.weight", t[e, :inter]))
        out.append((f"{prefix}.{e}.up_proj.weight", t[e, inter:]))
    return out


def load_model(
    directory: Path | str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> MLAModel:
    """A model from a checkpoint directory, weights cast to `dtype` on `device`, eval mode."""
    d = Path(directory)
    cfg = ModelConfig.load(d)
    with torch.device("meta"):
        model = MLAModel(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    unexpected: list[str] = []
    block = _block_size(cfg)
    pending: dict[str, torch.Tensor] = {}  # fp8 weights waiting for their scale (or vice versa)

    def put(name: str, t: torch.Tensor) -> None:
        p = params[name]
        if tuple(t.shape) != tuple(p.shape):
            raise E2EError(
                f"{name}: checkpoint shape {tuple(t.shape)}, model needs {tuple(p.shape)}"
            )
        with torch.no_grad():
            p.copy_(t.to(device=p.device, dtype=p.dtype))
        seen.add(name)

    for path in weight_files(d):
        for name, t in _iter_tensors(path):
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                continue  # multi-token-prediction layers
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name.endswith("_scale_inv") or t.dtype in _FP8:
                base = name.removesuffix("_scale_inv")
                if _FUSED_RE.match(base):  # per-expert FP8 blocks of a 3-D tensor: not modelled
                    raise E2EError(f"{name}: FP8 fused expert tensors are not supported")
                other = name + "_scale_inv" if base == name else base
                if other in pending:
                    w, s = (t, pending.pop(other)) if base == name else (pending.pop(other), t)
                    if base in params:
                        put(base, dequant_block_fp8(w, s, block or DEFAULT_FP8_BLOCK))
                    else:
                        unexpected.append(base)
                else:
                    pending[name] = t
                continue
            if _FUSED_RE.match(name):
                n_exp = cfg.n_routed_experts or 0
                if t.dim() == 3 and t.shape[0] != n_exp:
                    raise E2EError(f"{name}: {t.shape[0]} experts, config has {n_exp}")
                for part, pt in split_fused_experts(name, t):
                    if part in params:
                        put(part, pt)
                    else:
                        unexpected.append(part)
                continue
            if name in params:
                put(name, t)
            else:
                unexpected.append(name)
    if pending:
        raise E2EError(
            f"FP8 weights without scales (or scales without weights): {sorted(pending)[:4]}"
        )
    dense_in_moe = [n for n in unexpected if _DENSE_MLP_RE.match(n)]
    if dense_in_moe and cfg.moe_layer_freq != 1:
        raise E2EError(
            f"moe_layer_freq {cfg.moe_layer_freq} not supported: the checkpoint has dense MLPs in "
            f"MoE layers (e.g. {sorted(dense_in_moe)[0]}); transformers' DeepseekV3 ignores "
            f"moe_layer_freq and makes every layer >= first_k_dense_replace MoE"
        )
    if unexpected:
        raise E2EError(
            f"{len(unexpected)} checkpoint tensors the model does not have, e.g. "
            f"{', '.join(sorted(unexpected)[:4])}"
        )
    missing = sorted(set(params) - seen)
    if cfg.tie_word_embeddings and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")  # tied: the embedding is the head
        if "model.embed_tokens.weight" not in seen:
            missing.append("model.embed_tokens.weight")
    if missing:
        raise E2EError(
            f"checkpoint lacks {len(missing)} model tensors, e.g. {', '.join(missing[:4])}"
        )
    model.tie_weights()
    return model.eval()


def save_model(model: MLAModel, directory: Path | str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json and model.safetensors (model.pt if safetensors is not installed).

    A tied lm_head is not written (it is the embedding). Returns the weights file."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model.config.save(d / "config.json")
    state = {
        k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
        for k, v in model.state_dict().items()
    }
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    try:
        from safetensors.torch import save_file
    except ImportError:
        path = d / TORCH_STATE
        torch.save(state, path)
        return path
    path = d / SAFETENSORS
    save_file(state, str(path), metadata={"format": "pt"})
    stale = d / TORCH_STATE
    if stale.exists():
        stale.unlink()
    return path
