"""A DeepSeek-V3-architecture decoder in plain PyTorch, laid out like transformers'
`DeepseekV3ForCausalLM` (parameter names and shapes), so that a DeepSeek checkpoint's
`model.safetensors` loads into it as is.

The attention is split into the pieces both MLA views (MHA and absorbed, mlacheck/spec.py) need:

* `queries(x)`: `q_nope [.., H, nope]` and roped `q_pe [.., H, rope]`;
* `latents(x)`: what a serving engine caches per token, `c_kv [.., rank]` (after
  `kv_a_layernorm`) and roped `k_pe [.., rope]`;
* `expand(c_kv)`: the MHA view, `k_nope, v = kv_b_proj(c_kv)` per head;
* `absorption()`: `W_UK [H, nope, rank]` and `W_UV [H, rank, v]` (views of `kv_b_proj`) for the
  absorbed view `q' = [q_nope · W_UK ‖ q_pe]`, `out = o_latent · W_UV`.

`MLAModel.forward` is the dense MHA-form forward (torch SDPA, the model's softmax scale) used
for training and as a reference; `mlacheck.e2e.runner` runs the same weights with attention
through any mlacheck backend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlacheck.e2e.config import ModelConfig
from mlacheck.e2e.rope import Rotary, apply_rope
from mlacheck.inputs import Weights

# (q [B,H,T,Dqk], k [B,H,T,Dqk], v [B,H,T,Dv], scale, mask) -> [B,H,T,Dv]. mask: None for
# causal, else a boolean [B,1,T,T] (True = may attend).
DenseAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], torch.Tensor
]


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention in fp32, written out (a reference for tests)."""
    t, s = q.shape[-2], k.shape[-2]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is None:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def padded_mask(pad: torch.Tensor) -> torch.Tensor:
    """Causal mask [B,1,T,T] for left-padded rows (pad [B,T] True at padding): real queries
    see real keys up to themselves; padding queries see only themselves (no empty rows)."""
    t = pad.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=pad.device).tril()
    mask = causal[None] & ~pad[:, None, :]
    mask |= torch.eye(t, dtype=torch.bool, device=pad.device)[None]
    return mask[:, None]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """DeepSeek's expert gate: V3 `noaux_tc` (sigmoid + correction bias, grouped top-k),
    V2 `greedy` / `group_limited_greedy` (softmax)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.n_routed_experts and cfg.num_experts_per_tok
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.n_routed_experts), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, k] fp32, expert ids [N, k])."""
        cfg = self.cfg
        k = int(cfg.num_experts_per_tok or 1)
        n_exp = int(cfg.n_routed_experts or 1)
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        groups = max(1, int(cfg.n_group or 1))
        top_groups = max(1, int(cfg.topk_group or groups))
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
            group_scores = (
                choice.view(-1, groups, n_exp // groups)
                .topk(min(2, n_exp // groups), dim=-1)[0]
                .sum(-1)
            )
        elif cfg.topk_method == "group_limited_greedy":
            choice = scores
            group_scores = choice.view(-1, groups, n_exp // groups).amax(dim=-1)
        else:
            choice = scores
            group_scores = None
        if group_scores is not None and groups > 1:
            gidx = group_scores.topk(top_groups, dim=-1, sorted=False)[1]
            gmask = torch.zeros_like(group_scores).scatter_(1, gidx, 1.0).bool()
            emask = gmask[:, :, None].expand(-1, groups, n_exp // groups).reshape(-1, n_exp)
            choice = choice.masked_fill(~emask, float("-inf"))
        idx = choice.topk(k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if cfg.model_type == "deepseek_v2":
            # DeepSeek-V2's remote MoEGate: `if self.top_k > 1 and self.norm_topk_prob:`
            # normalise, else scale by routed_scaling_factor (unchanged; V2 is not compared
            # with transformers here)
            normalised = k > 1 and cfg.norm_topk_prob
        else:
            # transformers' DeepseekV3MoE.route_tokens_to_experts (modeling_deepseek_v3.py):
            #     if self.norm_topk_prob:
            #         denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            #         topk_weights /= denominator
            #     topk_weights = topk_weights * self.routed_scaling_factor
            # for every top-k, 1 included (DeepSeek's remote code: only when top_k > 1)
            normalised = cfg.norm_topk_prob
        if normalised:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.model_type != "deepseek_v2" or not normalised:
            w = w * cfg.routed_scaling_factor
        return w, idx


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.n_routed_experts and cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        n_shared = cfg.n_shared_experts or 0
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared) if n_shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, idx = self.gate(flat)
        out = torch.zeros_like(flat)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            y = self.experts[e](flat[tok]) * w[tok, slot, None].to(flat.dtype)
            out.index_add_(0, tok, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        bias = cfg.attention_bias
        self.num_heads = heads
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=bias)

    # -- the pieces both views use
    def queries(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden]; cos/sin [..., rope/2] (x's leading dims). -> q_nope, roped q_pe."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*x.shape[:-1], self.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        return q_nope, apply_rope(q_pe, cos[..., None, :], sin[..., None, :], cfg.rope_interleave)

    def latents(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached latent of each token: c_kv [..., rank] (normed), roped k_pe [..., rope]."""
        cfg = self.cfg
        c, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        return self.kv_a_layernorm(c), apply_rope(k_pe, cos, sin, cfg.rope_interleave)

    def expand(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA view from latents: k_nope [..., H, nope], v [..., H, v]."""
        cfg = self.cfg
        kv = self.kv_b_proj(c_kv).view(*c_kv.shape[:-1], self.num_heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        return k_nope, v

    def absorption(self, dtype: torch.dtype = torch.float32) -> Weights:
        """W_UK [H, nope, rank] and W_UV [H, rank, v] from kv_b_proj (weight [H*(nope+v), rank])."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.detach().to(dtype).view(self.num_heads, -1, cfg.kv_lora_rank)
        w_uk = w[:, : cfg.qk_nope_head_dim]
        w_uv = w[:, cfg.qk_nope_head_dim :].transpose(1, 2)
        return Weights(w_uk.contiguous(), w_uv.contiguous())

    def forward_dense(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: DenseAttention,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MHA form over whole sequences: x [B, T, hidden] -> [B, T, hidden] (causal, or the
        boolean mask [B, 1, T, T])."""
        cfg = self.cfg
        q_nope, q_pe = self.queries(x, cos, sin)
        c_kv, k_pe = self.latents(x, cos, sin)
        k_nope, v = self.expand(c_kv)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe[..., None, :].expand(*k_nope.shape[:-1], -1)], dim=-1)
        o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cfg.softmax_scale, mask)
        return self.o_proj(o.transpose(1, 2).reshape(*x.shape[:-1], -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg.hidden_size, cfg.intermediate_size)
        )


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MLAModel(nn.Module):
    """`DeepseekV3ForCausalLM`'s parameter layout: `model.embed_tokens`, `model.layers.N.*`,
    `model.norm`, `lm_head` (tied to the embedding when `tie_word_embeddings`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = Rotary(cfg)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        self.rotary.to(self.model.embed_tokens.weight.device)
        return out

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init (training from scratch): normal(0, std) matrices, unit norms; output
        projections scaled by 1/sqrt(2 * layers) (GPT-2 style)."""
        gen = torch.Generator().manual_seed(seed)
        n_layers = self.config.num_hidden_layers
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias") or "e_score_correction_bias" in name:
                nn.init.zeros_(p)
            else:
                s = (
                    std / (2 * n_layers) ** 0.5
                    if name.endswith(("o_proj.weight", "down_proj.weight"))
                    else std
                )
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * s)

    def forward(
        self,
        input_ids: torch.Tensor,
        attend: DenseAttention = sdpa_attention,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Dense MHA-form forward: input_ids [B, T] -> logits [B, T, V]. Positions default to
        0..T-1 (else [B, T] or [T]); mask: None (causal) or boolean [B, 1, T, T]."""
        t = input_ids.shape[-1]
        if positions is None:
            positions = torch.arange(t, device=input_ids.device)
        cos, sin = self.rotary.cos_sin(positions)
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            h = h + layer.self_attn.forward_dense(layer.input_layernorm(h), cos, sin, attend, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.model.norm(h))

    @torch.no_grad()
    def dense_generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        eos_token_id: int | None,
        pad_token_id: int = 0,
        attend: DenseAttention = sdpa_attention,
    ) -> list[list[int]]:
        """Greedy generation by full recomputation (no cache, no mlacheck backend): a fast
        dense reference for training-time evaluation. Left-padded batch."""
        dev = self.device
        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), pad_token_id, dtype=torch.long, device=dev)
        pad = torch.ones((n, width), dtype=torch.bool, device=dev)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, device=dev)
            pad[i, width - len(p) :] = False
        out: list[list[int]] = [[] for _ in prompts]
        done = torch.zeros(n, dtype=torch.bool, device=dev)
        for _ in range(max_new_tokens):
            positions = (~pad).long().cumsum(1) - 1
            logits = self(ids, attend, positions.clamp(min=0), padded_mask(pad))[:, -1]
            nxt = logits.argmax(-1)
            if eos_token_id is not None:
                done |= nxt == eos_token_id
            for i, (t, d) in enumerate(zip(nxt.tolist(), done.tolist(), strict=True)):
                if not d:
                    out[i].append(int(t))
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            pad = torch.cat([pad, torch.zeros((n, 1), dtype=torch.bool, device=dev)], dim=1)
        return out
