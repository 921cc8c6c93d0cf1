"""The golden's in-place softmax and its LSE shortcut against torch's own softmax/logsumexp,
on every device present (the CUDA kernels are separate code: they run where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from mlacheck.golden import core

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA/HIP device: the GPU softmax kernels are not exercised"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cols", [7, 1024, 1500, 70000])  # warp, block and shared-memory paths
def test_in_place_softmax_and_lse_match_torch(device: str, dtype: torch.dtype, cols: int) -> None:
    g = torch.Generator().manual_seed(cols)
    s = (torch.randn(2, 3, cols, generator=g, dtype=dtype) * 8).to(device)
    s[0, 1, : cols // 2] = float("-inf")  # a masked prefix
    s[1, 2] = float("-inf")  # a row that sees nothing
    s[1, 0, cols // 3] = float("nan")  # a poisoned row
    v = torch.randn(cols, 5, generator=g, dtype=dtype).to(device)
    want_p = torch.softmax(s, -1)
    want_lse = torch.logsumexp(s, -1)
    o, lse = core.softmax_v(s.clone(), v, None, 0)
    live = torch.ones(2, 3, dtype=torch.bool)
    live[1, 2] = live[1, 0] = False
    torch.testing.assert_close(o[live.to(device)], (want_p @ v)[live.to(device)])
    torch.testing.assert_close(lse[live.to(device)], want_lse[live.to(device)])
    assert lse[1, 2] == float("-inf") and bool((o[1, 2] == 0).all())  # blind row: 0 and -inf
    assert bool(o[1, 0].isnan().all()) and bool(lse[1, 0].isnan())  # NaN stays NaN
    p = s.clone()
    core._softmax_in_place(p)
    torch.testing.assert_close(p[live.to(device)], want_p[live.to(device)])


def test_in_place_softmax_refuses_a_strided_block() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        core._softmax_in_place(torch.zeros(4, 8)[:, :6])


def test_latent_v_as_width_equals_explicit_v() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 8, 40, generator=g)
    kv = torch.randn(50, 1, 40, generator=g).to(torch.bfloat16)
    a = core.attend(core.Operand(q), core.Operand(kv, 0.5), 32, 0.2, causal=True)
    b = core.attend(core.Operand(q), core.Operand(kv, 0.5), core.Operand(kv[..., :32], 0.5),
                    0.2, causal=True)
    assert torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)


def _count_careful(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    calls: list[bool] = []
    real = core._attend_one

    def spy(*a, careful: bool, **k):  # noqa: ANN002, ANN003
        calls.append(careful)
        return real(*a, careful=careful, **k)

    monkeypatch.setattr(core, "_attend_one", spy)
    return calls


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple:
    """Bottom-right causal attention in fp64, one softmax per row, no blocking."""
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    sq, sk = q.shape[0], k.shape[0]
    mask = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
    s = s.masked_fill(mask, float("-inf"))
    return (torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v.double()),
            torch.logsumexp(s, -1).T)


def test_fast_pass_serves_ordinary_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(700, 2, n, generator=g) for n in (16, 16, 8))
    calls = _count_careful(monkeypatch)
    res = core.attend(q, k, v, 0.25, causal=True)
    assert calls == [False]  # no redo: the anchor and the output were fine
    out, lse = _exact(q, k, v, 0.25)
    torch.testing.assert_close(res.out.double(), out, rtol=0, atol=2e-6)
    torch.testing.assert_close(res.lse.double(), lse, rtol=0, atol=2e-6)


def test_anchor_far_below_the_max_is_redone_with_the_true_max(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys past the anchor columns score ~60 above them: p at the anchor is ~e^-60, outside
    what the fp32 shortcut may use; the careful pass gives the exact LSE instead."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 2, 16, generator=g)
    q[..., 0] = 1.0
    k = torch.randn(900, 2, 16, generator=g)
    k[core.ANCHOR_COLUMNS + 50 :, :, 0] += 60.0  # scores ~60 higher past the anchor window
    v = torch.randn(900, 2, 8, generator=g)
    calls = _count_careful(monkeypatch)
    res = core.attend(q, k, v, 1.0, causal=True)
    assert calls == [False, True]
    out, lse = _exact(q, k, v, 1.0)
    torch.testing.assert_close(res.out.double(), out, rtol=0, atol=5e-5)  # |s| ~ 60 in fp32
    torch.testing.assert_close(res.lse.double(), lse, rtol=1e-6, atol=1e-5)


def test_one_request_redone_leaves_the_others_to_the_fast_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(4)
    reqs = [tuple(torch.randn(n, 2, d, generator=g) for d in (16, 16, 8)) for n in (40, 50, 60)]
    reqs[1][2][5, 0, 3] = float("nan")  # V NaN in request 1 at a position every row sees
    calls = _count_careful(monkeypatch)
    res = core.attend_each(reqs, 0.3, causal=True)
    assert calls == [False, False, False, True]
    assert bool(res[1].out[:, 0].isnan().any()) and not bool(res[1].out[:, 1].isnan().any())
    for r, (q, k, v) in zip(res, reqs, strict=True):
        if r is res[1]:
            continue
        out, _ = _exact(q, k, v, 0.3)
        torch.testing.assert_close(r.out.double(), out, rtol=0, atol=2e-6)
