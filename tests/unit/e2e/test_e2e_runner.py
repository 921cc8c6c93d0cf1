"""The runner: attention through a backend as real mlacheck cases, over a real paged cache."""

from __future__ import annotations

import pytest
import torch
from _e2e_helpers import tiny_model

from mlacheck import fp8
from mlacheck.backends.base import Capability
from mlacheck.backends.torch_ref import TorchBackend
from mlacheck.e2e.config import E2EError
from mlacheck.e2e.model import math_attention
from mlacheck.e2e.runner import AttentionConfig, MLARunner, PagedLatentCache
from mlacheck.golden import decode as golden_decode
from mlacheck.golden import prefill as golden_prefill
from mlacheck.inputs import DecodeInputs, PrefillInputs, decode_inputs_from_tensors
from mlacheck.kvcache import free_pages
from mlacheck.spec import DecodeCase, Placement, PrefillCase, Quant, Request

FP32 = Quant(q="fp32", kv="fp32")
PROMPTS = [[1, 5, 7, 9, 11, 13, 40], [1, 3], [1, *range(20, 60)], [1, 8, 8, 8]]
NEW = 9


def _dense_greedy(model, prompts, n):  # noqa: ANN001, ANN202
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq]), math_attention)[0, -1].argmax()))
            out.append(seq[len(p) :])
    return out


def test_runner_generates_what_the_dense_model_generates() -> None:
    model = tiny_model()
    ref = _dense_greedy(model, PROMPTS, NEW)
    for att in (
        AttentionConfig(quant=FP32),
        AttentionConfig(quant=FP32, page_size=1),
        AttentionConfig(quant=FP32, page_size=7, placement=Placement("packed", spare_pages=0)),
    ):
        runner = MLARunner(model, TorchBackend(), att)
        assert runner.generate(PROMPTS, NEW) == ref, att
        n_layers = model.config.num_hidden_layers
        assert runner.counts.by_op == {"mla_prefill": n_layers, "mla_decode": n_layers * (NEW - 1)}
    assert model.dense_generate([list(p) for p in PROMPTS], NEW, None) == ref


def test_every_backend_call_is_a_real_case_checked_against_the_golden() -> None:
    model = tiny_model()
    cfg = model.config
    seen: dict[str, int] = {"prefill": 0, "decode": 0}

    def observe(case, inputs, res) -> None:  # noqa: ANN001
        assert case.dims == cfg.mla_dims and case.num_heads == cfg.num_attention_heads
        assert case.softmax_scale == pytest.approx(cfg.softmax_scale)
        if isinstance(case, PrefillCase):
            assert isinstance(inputs, PrefillInputs) and case.op == "mla_prefill"
            assert [s.q_len for s in case.segments] == [len(p) for p in PROMPTS]
            ref = golden_prefill.reference(inputs)
            seen["prefill"] += 1
        else:
            assert isinstance(case, DecodeCase) and isinstance(inputs, DecodeInputs)
            assert all(r.q_len == 1 for r in case.requests)
            pool = inputs.pool
            # the pool holds the real cached latents, reached through a real page table
            for r, kv in enumerate(inputs.kv):
                torch.testing.assert_close(pool.gather(r), kv.dequant(), rtol=0, atol=0)
                torch.testing.assert_close(kv.dequant(), kv.ideal, rtol=0, atol=0)  # fp32
            free = free_pages(pool)
            assert len(free) > 0 and bool(torch.isnan(pool.data[free]).all())
            pages = pool.table.indices
            assert not torch.equal(pages, torch.arange(len(pages)))  # shuffled placement
            ref = golden_decode.reference(inputs)
            seen["decode"] += 1
        torch.testing.assert_close(res.out.float(), ref.out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res.lse, ref.lse, rtol=1e-4, atol=1e-5)

    runner = MLARunner(model, TorchBackend(), AttentionConfig(quant=FP32, page_size=4), observe)
    runner.generate(PROMPTS, 5)
    assert seen == {"prefill": 2, "decode": 2 * 4}


def test_latents_written_at_decode_land_in_their_slots() -> None:
    """The decode-step token of request r is in the pool at its position (and the tail is
    still poison), with an FP8 cache under the scale fixed at prefill."""
    model = tiny_model()
    quant = Quant(q="fp8_e4m3fn", kv="fp8_e4m3fn", scale="amax")
    checked = []

    def observe(case, inputs, res) -> None:  # noqa: ANN001
        if isinstance(case, DecodeCase):
            pool = inputs.pool
            assert pool.data.dtype == torch.float8_e4m3fn
            for r, req in enumerate(case.requests):
                got = pool.gather(r)
                assert got.shape[0] == req.kv_len and bool(torch.isfinite(got).all())
                torch.testing.assert_close(got, inputs.kv[r].dequant(), rtol=0, atol=0)
                # the slot after the last token (same page) is still poisoned
                ps = pool.table.page_size
                if req.kv_len % ps:
                    page = int(pool.table.pages_of(r)[-1])
                    assert bool(torch.isnan(pool.data[page, req.kv_len % ps].float()).all())
            assert bool(torch.isfinite(res.out.float()).all())
            checked.append(case.id)

    runner = MLARunner(model, TorchBackend(), AttentionConfig(quant=quant, page_size=4), observe)
    out = runner.generate(PROMPTS, 4)
    assert len(checked) == 2 * 3 and all(len(o) == 4 for o in out)


def test_a_decode_token_beyond_the_prefill_scale_saturates_in_the_fp8_cache(monkeypatch) -> None:  # noqa: ANN001
    """The FP8 cache's scale is fixed at prefill; a later token larger than the prompts' amax
    is stored saturated (a serving engine's cache write), in the pool and in the inputs the
    golden reads, whatever torch's own cast does. Here torch's cast is made to do what the
    H100's (torch 2.11, CUDA) did: NaN above the range, which took every FP8 e2e run to 0%."""
    real = fp8.quantize

    def cuda_cast(x, name, scale=1.0, policy="torch"):  # noqa: ANN001, ANN202
        return real(x, name, scale, "nan" if policy == "torch" else policy)

    monkeypatch.setattr(fp8, "quantize", cuda_cast)
    model = tiny_model()
    dims, heads = model.config.mla_dims, model.config.num_attention_heads
    quant = Quant(q="bf16", kv="fp8_e4m3fn", scale="amax")
    att = AttentionConfig(quant=quant, page_size=4)
    cache = PagedLatentCache(1, [3, 6], dims.latent, att, torch.device("cpu"),
                             torch.Generator().manual_seed(0))
    cache.fill(0, [torch.ones(2, dims.latent), -torch.ones(3, dims.latent)])  # amax 1
    big = torch.full((2, dims.latent), 3.0)
    big[1] = -3.0
    cache.append(0, [0, 1], [2, 3], big)  # 3x what the scale covers
    kv_lens = [3, 4]
    pool = cache.pool_view(0, cache.step_table([0, 1], kv_lens))
    for r, sign in ((0, 1.0), (1, -1.0)):
        got = pool.gather(r)
        assert bool(torch.isfinite(got).all()), "the cache write overflowed to NaN"
        torch.testing.assert_close(got[-1], torch.full_like(got[-1], sign), rtol=0, atol=0)
    case = DecodeCase(requests=tuple(Request(1, n) for n in kv_lens), num_heads=heads,
                      page_size=4, quant=quant, placement=att.placement, dims=dims)
    q = torch.zeros(2, heads, dims.latent)
    kv = [cache.ideal[0][r, :n] for r, n in enumerate(kv_lens)]
    inputs = decode_inputs_from_tensors(case, q, kv, "cpu", pool=pool)
    for r in range(2):  # the golden reads exactly what the kernel reads
        torch.testing.assert_close(inputs.kv[r].dequant(), pool.gather(r), rtol=0, atol=0)


def test_eos_and_stop_end_sequences() -> None:
    model = tiny_model()
    ref = _dense_greedy(model, PROMPTS, NEW)
    runner = MLARunner(model, TorchBackend(), AttentionConfig(quant=FP32))
    eos = ref[0][3]
    out = runner.generate(PROMPTS, NEW, eos_token_id=eos)
    for o, r in zip(out, ref, strict=True):
        assert o == (r[: r.index(eos)] if eos in r else r)
    out = runner.generate(PROMPTS, NEW, stop=lambda i, toks: i == 1 and len(toks) == 2)
    assert out[1] == ref[1][:2] and out[0] == ref[0]


class _NoDecode(TorchBackend):
    def capabilities(self) -> dict[str, Capability]:
        caps = super().capabilities()
        caps.pop("mla_decode")
        return caps


class _Unavailable(TorchBackend):
    def unavailable(self) -> str | None:
        return "no such device"


def test_backends_that_cannot_run_the_model_say_why() -> None:
    model = tiny_model()
    # refused when the runner is built, before a model loads or a question runs
    with pytest.raises(E2EError, match="no-decode does not provide mla_decode.*--backend"):
        MLARunner(model, _NoDecode(name="no-decode"))
    with pytest.raises(E2EError, match="unavailable: no such device"):
        MLARunner(model, _Unavailable(name="gone"))
    with pytest.raises(E2EError, match="per-token"):
        AttentionConfig(quant=Quant(q="fp8_e4m3fn", kv="fp8_e4m3fn", per_token=True))


class _Counting(TorchBackend):
    def __init__(self, name: str, ops: tuple[str, ...]) -> None:
        super().__init__(name=name)
        self.ops = ops
        self.calls: list[str] = []

    def capabilities(self) -> dict[str, Capability]:
        return {op: c for op, c in super().capabilities().items() if op in self.ops}

    def run(self, case, inputs):  # noqa: ANN001, ANN201
        self.calls.append(case.op)
        return super().run(case, inputs)


def test_decode_and_prefill_run_on_their_own_backends() -> None:
    """A decode-only kernel (FlashMLA) serves decode beside another backend's prefill; the
    tokens are the same as with one backend for both."""
    model = tiny_model()
    ref = MLARunner(model, TorchBackend(), AttentionConfig(quant=FP32)).generate(PROMPTS, NEW)
    decode = _Counting("decode-only", ("mla_decode",))
    prefill = _Counting("prefill-only", ("mla_prefill",))
    runner = MLARunner(model, decode, AttentionConfig(quant=FP32), prefill_backend=prefill)
    assert runner.generate(PROMPTS, NEW) == ref
    n_layers = model.config.num_hidden_layers
    assert prefill.calls == ["mla_prefill"] * n_layers
    assert decode.calls == ["mla_decode"] * n_layers * (NEW - 1)
    assert runner.backend_label == "decode decode-only / prefill prefill-only"
    assert MLARunner(model, TorchBackend()).backend_label == "torch"
    # one backend for both: it must provide both ops, and the missing one is named
    with pytest.raises(E2EError, match="decode-only does not provide mla_prefill.*--prefill-b"):
        MLARunner(model, decode)
    with pytest.raises(E2EError, match="unavailable: no such device"):
        MLARunner(model, TorchBackend(), prefill_backend=_Unavailable(name="gone"))
