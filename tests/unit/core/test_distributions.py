"""mlacheck.distributions: per-tensor input distributions that differ as a real layer's do,
drawn the same on every device, named by the case without changing existing ids."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from mlacheck import distributions, inputs, rng
from mlacheck.spec import (
    DISTRIBUTIONS,
    DecodeCase,
    PrefillCase,
    Quant,
    Request,
    Segment,
    SparseDecodeCase,
    case_from_json,
)

FP8_AMAX = Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax")
PREFILL = PrefillCase(segments=(Segment(48, 0), Segment(33, 17)), quant=FP8_AMAX)
DECODE = DecodeCase(requests=(Request(1, 300), Request(2, 700)), quant=FP8_AMAX)
# The least factor between two per-tensor amax scales of one case (a scale mix-up then costs
# at least 40 %, far above any FP8 row bound).
MIN_SPREAD = 1.4


def test_the_default_leaves_ids_and_slugs_alone() -> None:
    for case in (PREFILL, DECODE, SparseDecodeCase()):
        assert case.distribution == "gaussian"
        assert "distribution" not in case.identity_json()
        other = dataclasses.replace(case, distribution="layer")
        assert other.id != case.id and other.slug == case.slug + "-layer"
        assert case_from_json(other.to_json()) == other


def test_an_unknown_distribution_is_refused() -> None:
    with pytest.raises(ValueError, match="distribution must be one of"):
        DecodeCase(distribution="uniform")  # type: ignore[arg-type]


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_per_tensor_scales_differ(dist: str) -> None:
    """The point of the module: q, k, v (prefill) and q, kv (decode) get amax scales that
    differ by a factor, whatever the distribution."""
    p = inputs.build(dataclasses.replace(PREFILL, distribution=dist))
    scales = [float(t.scale) for t in (p.q, p.k, p.v)]
    d = inputs.build(dataclasses.replace(DECODE, distribution=dist))
    scales_d = [float(d.q.scale), float(d.kv[0].scale)]
    for a, b in [*itertools.combinations(scales, 2), scales_d]:
        assert max(a, b) / min(a, b) >= MIN_SPREAD, (dist, scales, scales_d)


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("role", distributions.ROLES)
def test_the_torch_path_gives_the_numpy_path_bits(dist: str, role: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit-identical on every device: the draw through torch's integer kernels (what a GPU
    runs) equals the CPU's numpy draw."""
    shape = (37, 3, 192)
    a = distributions.draw_from(11, dist, role, shape)
    real = rng.normal_
    monkeypatch.setattr(rng, "normal_", lambda out, key, std=1.0, impl="auto":
                        real(out, key, std, impl="torch"))
    b = distributions.draw_from(11, dist, role, shape)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_layer_has_a_trained_layers_structure() -> None:
    """Rope parts wider than the rest, massive low-frequency rope channels with the same sign
    in q and k, none in V, k_pe shared by the heads, token norms that vary."""
    case = dataclasses.replace(PREFILL, distribution="layer")
    q = distributions.draw(case, "q", (400, 8, 192))
    k = distributions.draw(case, "k", (400, 8, 192))
    v = distributions.draw(case, "v", (400, 8, 128))
    k_nope, k_pe = k[..., :128], k[..., 128:]
    assert k_pe.std() > 3 * k_nope.std()  # the rope part dominates the key's range
    assert torch.equal(k_pe, k_pe[:, :1].expand_as(k_pe))  # one k_pe per token
    q_mean, k_mean = q[..., -4:].mean((0, 1)), k[..., -4:].mean((0, 1))
    assert (q_mean > 0.5).all() and (k_mean > 1.0).all()  # massive, consistent, aligned
    assert v.mean((0, 1)).abs().max() < 0.1 * v.std()  # none in V
    norms = q.norm(dim=-1).flatten()
    assert norms.quantile(0.95) / norms.quantile(0.05) > 1.5
    kv = distributions.draw(dataclasses.replace(DECODE, distribution="layer"), "kv_latent",
                            (2000, 1, 576))
    latent_ch = kv[:, 0, :512].std(0)
    assert latent_ch.max() / latent_ch.median() > 2  # heavy channels in the latent


def test_ties_repeat_a_few_keys() -> None:
    case = dataclasses.replace(DECODE, distribution="ties")
    kv = distributions.draw(case, "kv_latent", (500, 1, 576))
    rows = kv.view(500, 576)
    apart = (rows[:, None, :] - rows[None, :, :]).abs().amax(-1)  # L-inf distance of rows
    clusters: list[int] = []  # greedy: a row joins the first cluster within 0.05
    for i in range(500):
        if not any(apart[i, c] < 0.05 for c in clusters):
            clusters.append(i)
    assert len(clusters) == 8  # the codes; within a code rows differ by the jitter only
    q = distributions.draw(case, "q_latent", (4, 2, 576))
    s = q.view(-1, 576) @ kv.view(500, 576).T
    top = s.max(-1, keepdim=True).values
    assert ((top - s) < 1e-2 * top.abs()).sum(-1).min() > 10  # many near-ties at the max


def test_a_new_op_draws_its_tensors_by_role() -> None:
    """What an op added later (the V3.2 indexer) calls: a role and a shape."""
    case = dataclasses.replace(DECODE, distribution="layer")
    keys = distributions.draw(case, "index_k", (1000, 1, 128))
    qs = distributions.draw(case, "index_q", (8, 64, 128))
    assert keys.shape == (1000, 1, 128) and qs.shape == (8, 64, 128)
    assert torch.isfinite(keys).all() and torch.isfinite(qs).all()
    with pytest.raises(ValueError, match="no role"):
        distributions.draw(case, "index_v", (4, 4))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


@needs_cuda
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_distributions_on_the_gpu_are_the_cpu_draws(dist: str) -> None:
    for role in distributions.ROLES:
        shape = (70000, 2, 192)  # past one CPU chunk of the stream: every path taken
        a = distributions.draw_from(5, dist, role, shape, "cpu")
        b = distributions.draw_from(5, dist, role, shape, "cuda").cpu()
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (dist, role)
