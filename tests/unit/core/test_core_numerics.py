"""The kernel-precision numerics (mlacheck.backends.numerics): the vectorised online softmax
forms P with the tile loop's bits and differs from it by fp32 reassociation only."""

from __future__ import annotations

import pytest
import torch

from mlacheck import fp8
from mlacheck.backends import numerics as nu

SHAPES = [
    # sq, heads, kv heads, kv len, d, dv, causal, P format, numerics, masked keys
    (1, 16, 1, 3000, 576, 512, False, "bf16", nu.Numerics(), False),
    (4, 16, 1, 1000, 576, 512, True, "bf16", nu.Numerics(), False),
    (4, 16, 1, 1000, 576, 512, True, "fp8_e4m3fn", nu.Numerics(kv_block=16, reverse=True), False),
    (37, 4, 4, 100, 192, 128, True, "bf16", nu.Numerics(), True),
    (300, 8, 8, 300, 192, 128, True, "fp16", nu.Numerics(), False),
    (3, 2, 2, 65, 192, 128, False, "fp32", nu.Numerics(), True),
    (5, 2, 2, 0, 192, 128, True, "bf16", nu.Numerics(), False),
    (0, 2, 2, 7, 192, 128, True, "bf16", nu.Numerics(), False),
]


def _data(sq, h, hk, sk, d, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    def r(*s):
        return torch.randn(*s, generator=g).to(torch.bfloat16).float()
    return r(sq, h, d), r(sk, hk, d), r(sk, hk, dv)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"sq{s[0]}-h{s[1]}-kv{s[3]}-{s[7]}")
def test_vectorised_online_softmax_matches_the_tile_loop(shape) -> None:
    sq, h, hk, sk, d, dv, causal, pf, nm, masked = shape
    q, k, v = _data(sq, h, hk, sk, d, dv)
    valid = torch.arange(sk) % 3 != 1 if masked else None
    pos = torch.arange(sq) + (sk - sq)
    with nu.exact_matmuls():
        want = nu._online_sequential(q, k, v, 0, sk, 0.1, causal, pf, nm, 0.0, valid, pos)
        got = nu._online(q, k, v, 0, sk, 0.1, causal, pf, nm, 0.0, valid, pos)
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=4e-6)


def test_query_chunks_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    # small integers: every score is exact whatever the GEMM's blocking, so P has the same
    # bits in both runs (a real score can round differently with another row count, and a
    # bf16 P then flips by an ulp)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randint(-2, 3, s, generator=g).float()
               for s in ((50, 4, 192), (200, 4, 192), (200, 4, 128)))
    pos = torch.arange(50) + 150
    args = (q, k, v, 0, 200, 0.1, True, "bf16", nu.Numerics(), 0.0, None, pos)
    whole = nu._online(*args)
    monkeypatch.setattr(nu, "_BLOCK_ELEMENTS", 4 * 256 * 7)  # 7 rows per chunk
    chunked = nu._online(*args)
    torch.testing.assert_close(chunked[0], whole[0], rtol=2e-6, atol=2e-6)  # BLAS blocking only
    torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=4e-6)


def test_narrow_accumulation_keeps_the_tile_loop() -> None:
    """acc_format rounds the running output between tiles: only the loop can do that."""
    q, k, v = _data(2, 4, 1, 4096, 576, 512, seed=1)
    pos = torch.arange(2) + 4094
    narrow = nu.Numerics(acc_format="bf16")
    got = nu._online(q, k, v, 0, 4096, 0.1, False, "bf16", narrow, 0.0, None, pos)
    want = nu._online_sequential(q, k, v, 0, 4096, 0.1, False, "bf16", narrow, 0.0, None, pos)
    assert torch.equal(got[0], want[0])
    wide = nu._online(q, k, v, 0, 4096, 0.1, False, "bf16", nu.Numerics(), 0.0, None, pos)
    assert not torch.allclose(got[0], wide[0], rtol=1e-3, atol=1e-4)  # the bug stays visible


@pytest.mark.parametrize("nm", [nu.Numerics(lazy_rescale=7.0), nu.Numerics(lazy_rescale=1.0),
                                nu.Numerics(p_normalised=True)], ids=["lazy7", "lazy1", "norm"])
@pytest.mark.parametrize("causal", [True, False])
def test_other_p_rounding_families_are_exact_in_real_arithmetic(nm: nu.Numerics,
                                                               causal: bool) -> None:
    """A lazily rescaled running max and P rounded after normalisation change only where P
    is rounded: with an fp32 P they are the default numerics to fp32 reassociation, and their
    P stays below the FP8 formats' max (a lazy P reaches 2^lazy_rescale at most)."""
    q, k, v = _data(6, 4, 4, 700, 192, 128, seed=5)
    q = q * 3  # peaked rows: the running max jumps between tiles
    pos = torch.arange(6) + 694
    with nu.exact_matmuls():
        want = nu._online(q, k, v, 0, 700, 0.2, causal, "fp32", nu.Numerics(), 0.0, None, pos)
        got = nu._online(q, k, v, 0, 700, 0.2, causal, "fp32", nm, 0.0, None, pos)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    with nu.exact_matmuls():  # and rounded to e4m3fnuz (max 240): no overflow, a few % off
        fp8 = nu._online(q, k, v, 0, 700, 0.2, causal, "fp8_e4m3fnuz", nm, 0.0, None, pos)
    assert torch.isfinite(fp8[0]).all()
    assert float((fp8[0] - want[0]).norm() / want[0].norm()) < 0.1


@pytest.mark.parametrize("nm", [nu.Numerics(lazy_rescale=7.0), nu.Numerics(p_normalised=True)],
                         ids=["lazy7", "norm"])
@pytest.mark.parametrize("sq, sk", [(0, 7), (3, 0)])
def test_other_p_rounding_families_take_empty_rows(nm: nu.Numerics, sq: int, sk: int) -> None:
    """No query (an empty request) or no key (a row that sees nothing): shapes, 0 and -inf."""
    q, k, v = _data(sq, 2, 2, sk, 192, 128)
    pos = torch.arange(sq) + (sk - sq)
    out, lse = nu._online(q, k, v, 0, sk, 0.1, True, "fp8_e4m3fn", nm, 0.0, None, pos)
    assert out.shape == (sq, 2, 128) and lse.shape == (sq, 2)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("p_format", ["fp8_e4m3fn", "fp8_e4m3fnuz"])
def test_peak_rounding_moves_only_the_largest_weight_by_one_roundoff(p_format: str) -> None:
    """The peak-rounded baseline (the judge's FP8 allowance, tolerances.PEAK_ROUNDOFFS): one
    visible key gives that key's V times (1 + 2^-4), an e4m3 unit roundoff; with the tile
    loop and the vectorised pass alike; every other weight is rounded as the eager one's,
    except near ties of the largest (next test)."""
    q, k, v = _data(1, 2, 2, 1, 192, 128)
    pos = torch.arange(1)
    peak = nu.Numerics(peak_rounding=1.0)
    with nu.exact_matmuls():
        one = nu._online(q, k, v, 0, 1, 0.1, True, p_format, peak, 0.0, None, pos)[0]
        loop = nu._online_sequential(q, k, v, 0, 1, 0.1, True, p_format, peak, 0.0, None, pos)[0]
    torch.testing.assert_close(one[0], v[0] * (1 + 2.0**-4), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loop, one, rtol=1e-6, atol=1e-6)
    q, k, v = _data(6, 4, 4, 700, 192, 128, seed=5)
    pos = torch.arange(6) + 694
    with nu.exact_matmuls():
        eager = nu._online(q, k, v, 0, 700, 0.2, True, p_format, nu.Numerics(), 0.0, None, pos)
        moved = nu._online(q, k, v, 0, 700, 0.2, True, p_format, peak, 0.0, None, pos)
    diff = (moved[0] - eager[0]).norm(dim=-1) / eager[0].norm(dim=-1)
    assert bool((diff > 0).all()) and float(diff.max()) <= 2.0**-4 * 1.01
    assert torch.equal(moved[1], eager[1])  # the LSE is formed before P is rounded


@pytest.mark.parametrize("p_format", ["fp8_e4m3fn", "fp8_e4m3fnuz"])
def test_peak_rounding_moves_the_near_ties_of_the_largest_weight_with_it(p_format: str) -> None:
    """A weight the eager rounding puts at the peak's value (P = exp(-0.01), rounded to 1)
    moves with the largest, to its exact value times (1 + 2^-4): a kernel that scales P
    otherwise rounds near-equal weights alike; one further off (P = exp(-0.1), rounded to
    0.875 or 0.9375) keeps the eager rounding."""
    k = torch.zeros(3, 1, 8)
    k[:, 0, 0] = torch.tensor([0.0, -0.01, -0.1])
    q = torch.zeros(1, 1, 8)
    q[0, 0, 0] = 1.0
    v = torch.eye(3, 8).reshape(3, 1, 8)
    pos = torch.tensor([2])
    with nu.exact_matmuls():
        out, _ = nu._online(q, k, v, 0, 3, 1.0, False, p_format, nu.Numerics(peak_rounding=1.0),
                            0.0, None, pos)
    p = torch.exp(k[:, 0, 0])
    rounded = fp8.round_trip(p, p_format)
    assert rounded[1] == 1 and rounded[2] != 1
    want = torch.stack([p[0] * (1 + 2.0**-4), p[1] * (1 + 2.0**-4), rounded[2]]) / p.sum()
    torch.testing.assert_close(out[0, 0, :3], want, rtol=1e-6, atol=1e-7)
