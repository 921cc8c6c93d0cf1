"""The MHA (prefill) view and the absorbed MQA (decode) view of MLA are the same attention.

MHA: k_nope, v = kv_b_proj(c_kv) per head, q/k 192 wide, v 128. Absorbed: q' = [q_nope·W_UK ‖
q_pe] (576), one shared latent K (576) and V = c_kv (512), output mapped back through W_UV.
Both views use the SAME softmax scale: 1/sqrt(192) * mscale² (DeepSeek-V3: 0.135234).

Bound (FP32): the views differ only in how the 128x512 (W_UK) and 512x128 (W_UV)
contractions are associated. A length-n fp32 dot product has a typical relative error of
u·sqrt(n) (u = 2^-24) of its terms' rms: ~1.4e-6 for n = 512; a score error δ moves a softmax
output by ~δ·|v| and the LSE by ~δ. We allow 2e-5 relative to max|out| and 2e-5 absolute on
the LSE (~15x that estimate); measured ~2e-6 (out) and <= 3e-6 (LSE) over several seeds.
In FP64 the two views agree to 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch

from mlacheck import inputs, spec
from mlacheck.golden.core import attend
from mlacheck.spec import DEEPSEEK_V3, NO_YARN, DecodeCase, MLADims, PrefillCase

FP32_OUT_REL = 2e-5
FP32_LSE_ABS = 2e-5


def test_softmax_scales() -> None:
    assert round(spec.softmax_scale(DEEPSEEK_V3), 6) == 0.135234
    # by formula: (0.1 * ln 40 + 1)^2 / sqrt(192)
    assert spec.softmax_scale(DEEPSEEK_V3) == pytest.approx(
        (0.1 * math.log(40) + 1) ** 2 / math.sqrt(192), rel=1e-15
    )
    assert spec.softmax_scale(NO_YARN) == pytest.approx(1 / math.sqrt(192), rel=1e-15)
    for dims in (DEEPSEEK_V3, NO_YARN):
        # the same scale for a prefill (MHA) case and a decode (absorbed) case: never 1/sqrt(576)
        pf, dec = PrefillCase(dims=dims), DecodeCase(dims=dims)
        assert pf.softmax_scale == dec.softmax_scale == dims.softmax_scale
        assert dec.softmax_scale != pytest.approx(1 / math.sqrt(576))


def _views(dims: MLADims, dtype: torch.dtype, scale: float, seed: int = 0, causal: bool = True):
    """(MHA result, absorbed result mapped through W_UV, absorbed raw result)."""
    g = torch.Generator().manual_seed(seed)
    h, tq, tk = 8, 6, 300
    w = inputs.make_weights(dims, h, g)
    c_kv = torch.randn(tk, dims.kv_lora_rank, generator=g)
    k_pe = torch.randn(tk, dims.qk_rope, generator=g)
    q_nope = torch.randn(tq, h, dims.qk_nope, generator=g)
    q_pe = torch.randn(tq, h, dims.qk_rope, generator=g)
    w = inputs.Weights(w.w_uk.to(dtype), w.w_uv.to(dtype))
    c_kv, k_pe, q_nope, q_pe = (t.to(dtype) for t in (c_kv, k_pe, q_nope, q_pe))

    k, v = inputs.mha_from_latent(c_kv, k_pe, w)
    assert k.shape == (tk, h, dims.qk_head) and v.shape == (tk, h, dims.v_head)
    mha = attend(torch.cat([q_nope, q_pe], dim=-1), k, v, scale, causal)

    qa = inputs.absorb_q(q_nope, q_pe, w)
    kv = torch.cat([c_kv, k_pe], dim=-1)[:, None, :]  # [Tk, 1, 576]: one latent "head"
    assert qa.shape == (tq, h, dims.latent) and kv.shape == (tk, 1, dims.latent)
    absorbed = attend(qa, kv, kv[..., : dims.kv_lora_rank], scale, causal)
    assert absorbed.out.shape == (tq, h, dims.kv_lora_rank)
    return mha, inputs.unabsorb_out(absorbed.out, w), absorbed


@pytest.mark.parametrize("dims", [DEEPSEEK_V3, NO_YARN], ids=["v3-yarn", "no-yarn"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_mha_and_absorbed_views_agree(dims: MLADims, causal: bool) -> None:
    scale = DecodeCase(dims=dims).softmax_scale  # the case's scale, shared by both views
    mha, out_abs, absorbed = _views(dims, torch.float64, scale, causal=causal)
    torch.testing.assert_close(out_abs, mha.out, rtol=0, atol=1e-12 * float(mha.out.abs().max()))
    torch.testing.assert_close(absorbed.lse, mha.lse, rtol=0, atol=1e-12)

    for seed in range(2):
        mha, out_abs, absorbed = _views(dims, torch.float32, scale, seed=seed, causal=causal)
        rel = float((out_abs - mha.out).abs().max() / mha.out.abs().max())
        lse_err = float((absorbed.lse - mha.lse).abs().max())
        print(f"\n[views fp32 {dims.rope_factor=} {causal=} seed {seed}] out rel {rel:.2e}, "
              f"lse abs {lse_err:.2e}")
        assert rel < FP32_OUT_REL
        assert lse_err < FP32_LSE_ABS


def test_absorbed_view_with_library_default_scale_disagrees() -> None:
    """Negative control: 1/sqrt(576) (AITER/FlashMLA decode default) in the absorbed view is a
    different attention: the comparison above would catch a wrong scale."""
    good = DEEPSEEK_V3.softmax_scale
    mha, _, _ = _views(DEEPSEEK_V3, torch.float64, good)
    _, out_bad, absorbed_bad = _views(DEEPSEEK_V3, torch.float64, 1 / math.sqrt(576))
    assert float((out_bad - mha.out).abs().max() / mha.out.abs().max()) > 1e-2
    assert float((absorbed_bad.lse - mha.lse).abs().max()) > 1e-1
