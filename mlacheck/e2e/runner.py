"""Greedy batch generation with the model's attention running through an mlacheck backend.

Every attention call of every layer is one mlacheck case, built from the model's real
tensors and run by `backend.run(case, inputs)`:

* **prefill** (all prompts of a batch at once, ragged): op `mla_prefill` in the MHA form.
  A `PrefillCase` with one `Segment` per prompt, the model's `MLADims` (so the case's softmax
  scale is the model's) and head count, and `PrefillInputs` from the real q/k/v quantised per
  the case's `Quant`;
* **decode** (one token per running sequence and step): op `mla_decode` in the absorbed form.
  A `DecodeCase` with one `Request(1, kv_len)` per sequence; queries absorbed through W_UK,
  the backend's latent output mapped through W_UV; the pool is a paged latent cache.

The paged latent cache is a serving engine's: one pool per layer holding each token's
`[c_kv ‖ k_pe]` (after `kv_a_layernorm` and rotary) in the case's KV format, all layers
sharing one page table. Each sequence reserves pages for prompt + max new tokens when the
batch starts (`kvcache.assign_pages` with the configured placement: shuffled pages among
poisoned free ones by default), the prompt latents are written by `kvcache.build_pool` (so
unwritten slots hold NaN poison), and every decode step writes the new token into its slot
and hands the backend a `PageTable` of the pages in use. With an FP8 KV format the per-layer
dequantisation scale is fixed at prefill (amax of the prompt latents, or 1 with unit scales):
later tokens are quantised with it, as a cache with a calibrated scale does, and what it does
not cover saturates, as a serving engine's cache write does (`fp8.quantize_cache_write`; a
plain torch cast gave NaN on CUDA, and every FP8 run answered nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mlacheck import fp8, kvcache, layouts
from mlacheck.backends.base import Backend, Output, skip_reason
from mlacheck.e2e.config import E2EError
from mlacheck.e2e.model import DecoderLayer, MLAAttention, MLAModel
from mlacheck.inputs import (
    Inputs,
    Weights,
    absorb_q,
    decode_inputs_from_tensors,
    prefill_inputs_from_tensors,
    unabsorb_out,
)
from mlacheck.kvcache import KVPool, PageTable
from mlacheck.spec import Case, DecodeCase, Op, Placement, PrefillCase, Quant, Request, Segment

DEFAULT_PAGE_SIZE = 16
DEFAULT_PLACEMENT = Placement(kind="shuffled", spare_pages=8)

# (case, inputs, output) of every backend call, e.g. to check each one against the golden
Observer = Callable[[Case, Inputs, Output], None]
# (batch index, tokens generated so far) -> stop now?
StopFn = Callable[[int, list[int]], bool]


@dataclass(frozen=True)
class AttentionConfig:
    """How the model's attention is handed to the backend."""

    quant: Quant = Quant()
    page_size: int = DEFAULT_PAGE_SIZE
    placement: Placement = DEFAULT_PLACEMENT
    seed: int = 0  # seeds page placement (and is the cases' seed field)

    def __post_init__(self) -> None:
        if self.quant.per_token and fp8.fmt(self.quant.kv).is_fp8:
            raise E2EError("per-token FP8 KV scales are not modelled for the paged latent cache")


@dataclass
class CallCounts:
    prefill: int = 0
    decode: int = 0
    tokens: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


class PagedLatentCache:
    """Per-layer paged pools of `[c_kv ‖ k_pe]`, one page table for all layers."""

    def __init__(
        self,
        n_layers: int,
        reserved: Sequence[int],
        latent: int,
        att: AttentionConfig,
        device: torch.device,
        gen: torch.Generator,
    ) -> None:
        self.fmt = att.quant.kv
        self.att = att
        self.latent = latent
        self.device = device
        ps = att.page_size
        page_bytes = ps * latent * fp8.fmt(self.fmt).itemsize
        self.table, self.num_pages = kvcache.assign_pages(
            list(reserved), ps, page_bytes, att.placement, gen
        )
        self.pages = [self.table.pages_of(r) for r in range(len(reserved))]
        cap = max(reserved)
        self.pools: list[KVPool | None] = [None] * n_layers
        self.scales: list[torch.Tensor] = [torch.ones(())] * n_layers
        # the unquantised latents (the "ideal" copy the inputs carry), [B, capacity, latent]
        self.ideal = [
            torch.zeros((len(reserved), cap, latent), device=device) for _ in range(n_layers)
        ]

    def fill(self, layer: int, per_request: Sequence[torch.Tensor]) -> None:
        """Write the prompts' latents ([len_r, latent] each) of one layer; fixes its scale."""
        q = self.att.quant
        allv = torch.cat([t.float() for t in per_request])
        scale = fp8.pick_scale(allv, self.fmt, q.scale, False)
        stored = [fp8.quantize_cache_write(t.float(), self.fmt, scale)[:, None, :]
                  for t in per_request]
        pool = kvcache.build_pool(
            stored,
            self.table,
            self.num_pages,
            self.fmt,
            scale,
            self.device,
            layouts.LINEAR.name,  # append() writes token slots: the cache is linear
            "latent",
            self.att.placement.tail_poison,
        )
        self.pools[layer], self.scales[layer] = pool, pool.scale
        for r, t in enumerate(per_request):
            self.ideal[layer][r, : t.shape[0]] = t.float()

    def append(
        self, layer: int, rows: Sequence[int], positions: Sequence[int], lat: torch.Tensor
    ) -> None:
        """Write one new token per sequence: rows[i] at position positions[i] gets lat[i]."""
        pool = self.pools[layer]
        assert pool is not None, "fill() a layer before appending to it"
        ps = self.att.page_size
        slots = torch.tensor(
            [
                int(self.pages[r][p // ps]) * ps + p % ps
                for r, p in zip(rows, positions, strict=True)
            ],
            device=self.device,
        )
        stored = fp8.quantize_cache_write(lat.float(), self.fmt, self.scales[layer])
        bits = fp8.int_dtype(stored.dtype)
        pool.data.view(bits).view(-1, self.latent).index_copy_(0, slots, stored.view(bits))
        idx_r = torch.tensor(list(rows), device=self.device)
        idx_p = torch.tensor(list(positions), device=self.device)
        self.ideal[layer][idx_r, idx_p] = lat.float()

    def step_table(self, rows: Sequence[int], kv_lens: Sequence[int]) -> PageTable:
        """The page table of the given sequences at the given lengths (pages in use only)."""
        ps = self.att.page_size
        counts = [(n + ps - 1) // ps for n in kv_lens]
        indptr = torch.zeros(len(rows) + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
        indices = torch.cat([self.pages[r][:c] for r, c in zip(rows, counts, strict=True)])
        return PageTable(ps, indptr, indices, torch.tensor(list(kv_lens), dtype=torch.int64))

    def pool_view(self, layer: int, table: PageTable) -> KVPool:
        pool = self.pools[layer]
        assert pool is not None
        return KVPool(pool.data, pool.fmt, pool.scale, table, layouts.LINEAR.name, "latent")


class MLARunner:
    """Runs an `MLAModel` with its attention through `backend` (see the module docstring).

    `backend` serves decode and, unless `prefill_backend` is given, prefill too: a decode-only
    kernel (FlashMLA) runs beside another one's prefill, and a kernel is tested in one op with
    the reference in the other."""

    def __init__(
        self,
        model: MLAModel,
        backend: Backend,
        attention: AttentionConfig = AttentionConfig(),
        observer: Observer | None = None,
        prefill_backend: Backend | None = None,
    ) -> None:
        self.backend = backend
        self.prefill_backend = backend if prefill_backend is None else prefill_backend
        for be in dict.fromkeys((self.backend, self.prefill_backend)):
            why = be.unavailable()
            if why:
                raise E2EError(f"backend {be.name} unavailable: {why}")
        # before the model loads and the first question runs, not mid-run
        for be, op, flag in ((self.backend, Op.DECODE, "--backend"),
                             (self.prefill_backend, Op.PREFILL, "--prefill-backend")):
            if op not in be.capabilities():
                raise E2EError(f"backend {be.name} does not provide {op}, which the model's "
                               f"attention needs; choose one that does with {flag}")
        self.model = model.eval()
        self.attention = attention
        self.observer = observer
        self.config = model.config
        self.dims = model.config.mla_dims
        self.counts = CallCounts()
        self._batches = 0
        self._weights: list[Weights] = [
            self._attn(layer).absorption(torch.float32) for layer in model.model.layers
        ]

    @property
    def device(self) -> torch.device:
        return self.model.device

    @staticmethod
    def _attn(layer: torch.nn.Module) -> MLAAttention:
        assert isinstance(layer, DecoderLayer)
        return layer.self_attn

    @property
    def backend_label(self) -> str:
        """`name`, or `decode NAME / prefill NAME` when the two ops run on different backends."""
        if self.prefill_backend is self.backend or self.prefill_backend.name == self.backend.name:
            return self.backend.name
        return f"decode {self.backend.name} / prefill {self.prefill_backend.name}"

    def backend_for(self, case: Case) -> Backend:
        return self.prefill_backend if isinstance(case, PrefillCase) else self.backend

    def _run(self, case: Case, inputs: Inputs) -> torch.Tensor:
        backend = self.backend_for(case)
        why = skip_reason(backend, case, self.device.type)
        if why:
            raise E2EError(f"cannot run the model's attention: {backend.name} {case.op}: {why}")
        res = backend.run(case, inputs)
        if self.observer is not None:
            self.observer(case, inputs, res)
        self.counts.by_op[case.op] = self.counts.by_op.get(case.op, 0) + 1
        return res.out

    # -- generation
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        stop: StopFn | None = None,
    ) -> list[list[int]]:
        """Greedy continuation of each prompt (token ids), all decoded together.

        A sequence ends at `eos_token_id` (not included), when `stop(i, tokens)` says so, or
        after `max_new_tokens` tokens."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise E2EError("empty prompt (encode with a BOS token)")
        if max_new_tokens < 1:
            return [[] for _ in prompts]
        lens = [len(p) for p in prompts]
        gen = torch.Generator().manual_seed(self.attention.seed * 1_000_003 + self._batches)
        self._batches += 1
        cache = PagedLatentCache(
            len(self.model.model.layers),
            [n + max_new_tokens for n in lens],
            self.dims.latent,
            self.attention,
            self.device,
            gen,
        )
        logits = self._prefill(prompts, cache)
        out: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        while True:
            nxt = logits.argmax(-1).tolist()
            still = []
            for r, t in zip(active, nxt, strict=True):
                if eos_token_id is not None and t == eos_token_id:
                    continue
                out[r].append(int(t))
                if len(out[r]) >= max_new_tokens or (stop is not None and stop(r, out[r])):
                    continue
                still.append(r)
            active = still
            if not active:
                return out
            tokens = [out[r][-1] for r in active]
            positions = [lens[r] + len(out[r]) - 1 for r in active]
            logits = self._decode(active, tokens, positions, cache)

    def _prefill(self, prompts: Sequence[Sequence[int]], cache: PagedLatentCache) -> torch.Tensor:
        dev, cfg, att = self.device, self.config, self.attention
        lens = [len(p) for p in prompts]
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
        cos, sin = self.model.rotary.cos_sin(positions)
        case = PrefillCase(
            segments=tuple(Segment(n) for n in lens),
            num_heads=cfg.num_attention_heads,
            causal=True,
            quant=att.quant,
            return_lse=False,
            dims=self.dims,
            seed=att.seed,
        )
        cuts = [0]
        for n in lens:
            cuts.append(cuts[-1] + n)
        x = self.model.model.embed_tokens(tokens)
        for li, layer in enumerate(self.model.model.layers):
            assert isinstance(layer, DecoderLayer)
            attn = layer.self_attn
            a = layer.input_layernorm(x)
            q_nope, q_pe = attn.queries(a, cos, sin)
            c_kv, k_pe = attn.latents(a, cos, sin)
            k_nope, v = attn.expand(c_kv)
            q = torch.cat([q_nope, q_pe], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, attn.num_heads, -1)], dim=-1)
            inputs = prefill_inputs_from_tensors(case, q, k, v, dev)
            o = self._run(case, inputs)
            lat = torch.cat([c_kv, k_pe], dim=-1)
            cache.fill(li, [lat[a0:b0] for a0, b0 in zip(cuts[:-1], cuts[1:], strict=True)])
            x = x + attn.o_proj(o.reshape(o.shape[0], -1).to(x.dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.counts.prefill += 1
        self.counts.tokens += len(tokens)
        last = torch.tensor([c - 1 for c in cuts[1:]], device=dev)
        return self.model.lm_head(self.model.model.norm(x[last])).float()

    def _decode(
        self, rows: list[int], tokens: list[int], positions: list[int], cache: PagedLatentCache
    ) -> torch.Tensor:
        dev, cfg, att = self.device, self.config, self.attention
        kv_lens = [p + 1 for p in positions]
        case = DecodeCase(
            requests=tuple(Request(1, n) for n in kv_lens),
            num_heads=cfg.num_attention_heads,
            page_size=att.page_size,
            quant=att.quant,
            placement=att.placement,
            dims=self.dims,
            seed=att.seed,
        )
        table = cache.step_table(rows, kv_lens)
        cos, sin = self.model.rotary.cos_sin(torch.tensor(positions, device=dev))
        x = self.model.model.embed_tokens(torch.tensor(tokens, device=dev))
        for li, layer in enumerate(self.model.model.layers):
            assert isinstance(layer, DecoderLayer)
            attn = layer.self_attn
            w = self._weights[li]
            a = layer.input_layernorm(x)
            q_nope, q_pe = attn.queries(a, cos, sin)
            c_kv, k_pe = attn.latents(a, cos, sin)
            cache.append(li, rows, positions, torch.cat([c_kv, k_pe], dim=-1))
            kv = [cache.ideal[li][r, :n] for r, n in zip(rows, kv_lens, strict=True)]
            inputs = decode_inputs_from_tensors(
                case,
                absorb_q(q_nope.float(), q_pe.float(), w),
                kv,
                dev,
                pool=cache.pool_view(li, table),
            )
            o = unabsorb_out(self._run(case, inputs).float(), w)
            x = x + attn.o_proj(o.reshape(o.shape[0], -1).to(x.dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.counts.decode += 1
        self.counts.tokens += len(tokens)
        return self.model.lm_head(self.model.model.norm(x)).float()
