"""The kernel-precision numerics (mlacheck.backends.numerics): the vectorised online softmax
forms P with the tile loop's bits and differs from it by fp32 reassociation only."""

from __future__ import annotations

import pytest
import torch

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
