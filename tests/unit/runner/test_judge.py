"""The judge catches planted defects, names where they are, and passes correct variants."""

from __future__ import annotations

import math

import pytest
import torch

from mlacheck import harness, spec
from mlacheck.backends.base import Output
from mlacheck.backends.torch_ref import TorchBackend, reverse_factory, split_factory
from mlacheck.judge import FAIL, PASS

DECODE = spec.DecodeCase(
    requests=(spec.Request(1, 90), spec.Request(2, 200), spec.Request(1, 33)),
    num_heads=16, page_size=16,
)
PREFILL = spec.PrefillCase(segments=(spec.Segment(20, 10), spec.Segment(30, 0)), num_heads=8)


class Planted(TorchBackend):
    """The torch backend with a post-hoc edit of its output or LSE."""

    def __init__(self, edit) -> None:  # noqa: ANN001
        super().__init__(name="planted")
        self.edit = edit

    def run(self, case, inputs):  # noqa: ANN001, ANN201
        res = super().run(case, inputs)
        self.edit(res, inputs)
        return res


def run(backend, case=DECODE):  # noqa: ANN001, ANN201
    return harness.run_case(case, backend)


def test_correct_variants_pass() -> None:
    for b in (TorchBackend(), split_factory(), reverse_factory()):
        for case in (DECODE, PREFILL):
            v = run(b, case)
            assert v.status == PASS, v.summary()


def test_one_request_perturbed_is_named() -> None:
    def edit(res: Output, inputs) -> None:  # noqa: ANN001
        res.out[1:3] = (res.out[1:3].float() * 1.03).to(res.out.dtype)  # request 1 = rows 1..2

    v = run(Planted(edit))
    assert v.status == FAIL
    rows = [w for w in v.where if w.check == "row_error"]
    assert [w.request for w in rows] == [1]
    assert rows[0].request_tokens == (0, 1) and rows[0].heads == list(range(16))
    assert rows[0].pages == v_pages(1)
    assert "request 1 (kv 200) tokens 0-1" in v.summary()
    # the first line names the axis: all rows of request 1, and what it alone has (MTP rows)
    assert "request 1 of 3 (all their rows)" in v.summary().splitlines()[0]


def v_pages(r: int) -> list[int]:
    from mlacheck import inputs as inp

    return inp.build(DECODE).pool.table.pages_of(r).tolist()


def test_one_row_one_head_is_named() -> None:
    def edit(res: Output, inputs) -> None:  # noqa: ANN001
        res.out[3, 5] = (res.out[3, 5].float() * 1.02).to(res.out.dtype)  # request 2, head 5

    v = run(Planted(edit))
    assert v.status == FAIL
    (w,) = [w for w in v.where if w.check == "row_error"]
    assert (w.request, w.heads, w.tokens) == (2, [5], (3, 3))
    assert w.region == "below 2^31"


def test_nan_row_fails_nonfinite() -> None:
    def edit(res: Output, inputs) -> None:  # noqa: ANN001
        res.out[0, 0, 7] = float("nan")

    v = run(Planted(edit))
    assert v.status == FAIL and "nonfinite" in v.reason


def test_write_past_the_end_hits_guard() -> None:
    def edit(res: Output, inputs) -> None:  # noqa: ANN001
        inputs.out.full[-1, 0, 0] = 1.0  # the last guard row

    v = run(Planted(edit))
    assert v.status == FAIL and "guards" in v.reason


def test_base2_lse_fails() -> None:
    def edit(res: Output, inputs) -> None:  # noqa: ANN001
        res.lse = res.lse / math.log(2)

    v = run(Planted(edit))
    assert v.status == FAIL and v.reason == "lse"


def test_wrong_shape_fails_cleanly() -> None:
    def edit(res: Output, inputs) -> None:  # noqa: ANN001
        res.out = res.out[:, :8]

    v = run(Planted(edit))
    assert v.status == FAIL and v.checks[0].name == "shape"


def test_exception_is_crash_with_reason() -> None:
    class Boom(TorchBackend):
        def run(self, case, inputs):  # noqa: ANN001, ANN201
            raise RuntimeError("kernel launch failed: no kernel for head count")

    v = run(Boom(name="boom"))
    assert v.status == "CRASH" and "no kernel for head count" in v.reason


@pytest.mark.parametrize("case", [DECODE, PREFILL])
def test_verdict_json_round_trip(case) -> None:  # noqa: ANN001
    from mlacheck.judge import Verdict

    def edit(res: Output, inputs) -> None:  # noqa: ANN001
        res.out[0] = res.out[0] * 2

    v = run(Planted(edit), case)
    import json

    back = Verdict.from_dict(json.loads(v.to_json()))
    assert back.summary() == v.summary()
    assert torch.tensor(back.metrics["heatmap"]).shape[1] == case.num_heads
