"""Finding 2's rule (folded_kv_offsets_wrong) plans what the adapter's persistent decode hands
AITER's planner: case_planner_args, which the rule plans with, equals the keywords the adapter
passes to get_mla_metadata_v1 for the same case on the same chip. A copy of those arguments in
the rule drifted once (the adapter left empty requests out of its calls, the rule planned them
all) and a nightly run went red on an unlabelled FAIL (c79006e)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _aiter_cases import model_adapter, require_model  # noqa: I001

from mlacheck.backends.aiter import AiterAdapter, AiterApi, MetadataBuffers
from mlacheck.backends.aiter.adapter import case_planner_args
from mlacheck.backends.aiter.api import AITER_ENV_CONTROLS, MODEL_GFX_ENV, pinned_environment
from mlacheck.backends.base import skip_reason
from mlacheck.inputs import build
from mlacheck.matrices import load
from mlacheck.spec import DecodeCase, Op, Quant, Request

pytestmark = pytest.mark.usefixtures("_model_present")

FN = Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax")
FNUZ = Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz", "amax")
A16W8 = {"gfx942": Quant("bf16", "fp8_e4m3fnuz", "amax"),
         "gfx950": Quant("bf16", "fp8_e4m3fn", "amax")}
FP8_OF = {"gfx942": FNUZ, "gfx950": FN}
# the nightly case whose FAIL went unlabelled when the rule planned every request (c79006e)
NIGHTLY_RED = "dec-b6-kv0-4161-empty2-h48-p64-bf16-shuffled-sentinel"


@pytest.fixture
def _model_present() -> None:
    require_model()


class _Planned(Exception):
    """Raised where the kernel would run: the planner's arguments are all this test needs."""


class _PlannerSpy(AiterAdapter):
    fill_args: dict[str, Any] | None = None

    def fill_metadata(self, api: AiterApi, cache: MetadataBuffers,
                      bufs: dict[str, torch.Tensor], grew: bool,
                      fill_args: dict[str, Any]) -> None:
        self.fill_args = dict(fill_args)
        super().fill_metadata(api, cache, bufs, grew, fill_args)

    def _decode_call(self, api: AiterApi, kwargs: dict[str, Any], meta: dict[str, Any]) -> Any:
        raise _Planned


def _adapter_planner_args(case: DecodeCase, gfx: str) -> dict[str, Any] | None:
    """What the adapter hands get_mla_metadata_v1 for `case` on `gfx`; None where it SKIPs."""
    spy = model_adapter(True, cls=_PlannerSpy, env={**AITER_ENV_CONTROLS, MODEL_GFX_ENV: gfx})
    if skip_reason(spy, case, "cpu"):
        return None
    with pytest.raises(_Planned):
        spy.run(case, build(case, "cpu"))
    assert isinstance(spy, _PlannerSpy) and spy.fill_args is not None
    return spy.fill_args


def _rule_planner_args(case: DecodeCase, gfx: str) -> dict[str, Any]:
    """What folded_kv_offsets_wrong plans with (its chip pinned the same way)."""
    from mlacheck.backends.aiter_model import chip_info

    with pinned_environment({MODEL_GFX_ENV: gfx}):
        return case_planner_args(case, chip_info.get_cu_num())


def _same(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    diff = []
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            if not (isinstance(g, torch.Tensor) and g.dtype == w.dtype and torch.equal(g, w)):
                diff.append(f"{k}: rule {g}, adapter {w}")
        elif g != w or type(g) is not type(w):
            diff.append(f"{k}: rule {g!r}, adapter {w!r}")
    return diff


def _cases(gfx: str) -> list[DecodeCase]:
    """Every branch of the arguments: empty requests (first, middle, last; with and without
    K/V), folded and native heads, head padding, MTP, mixed q lengths, page sizes 1 / 16 / 64
    (granularity the page), the FP8 pair at 64 heads (granularity 32), a16w8, 128 heads (the
    split cap from the CUs)."""
    return [
        DecodeCase(requests=(Request(1, 700), Request(1, 900)), num_heads=32, page_size=16),
        DecodeCase(requests=(Request(1, 17), Request(0, 0), Request(1, 300), Request(1, 17)),
                   num_heads=48, page_size=16),
        DecodeCase(requests=(Request(0, 200), Request(2, 40), Request(2, 129), Request(0, 5)),
                   num_heads=32, page_size=64),
        DecodeCase(requests=(Request(1, 40), Request(3, 300), Request(0, 7)), num_heads=16,
                   page_size=16),
        DecodeCase(requests=(Request(1, 300),), num_heads=12, page_size=64),
        DecodeCase(requests=(Request(1, 33), Request(1, 260), Request(1, 1)), num_heads=128,
                   page_size=16),
        DecodeCase(requests=(Request(1, 100), Request(0, 0), Request(1, 65)), num_heads=64,
                   page_size=16, quant=FP8_OF[gfx]),
        DecodeCase(requests=(Request(1, 70), Request(1, 90)), num_heads=24, page_size=16,
                   quant=A16W8[gfx]),
        DecodeCase(requests=(Request(1, 50), Request(0, 3), Request(1, 9)), num_heads=16,
                   page_size=1),
    ]


@pytest.mark.parametrize("gfx", ["gfx942", "gfx950"])
def test_the_rule_plans_the_arguments_the_adapter_hands_the_planner(gfx: str) -> None:
    for case in _cases(gfx):
        adapter = _adapter_planner_args(case, gfx)
        assert adapter is not None, (case.id, gfx)  # every case here runs
        diff = _same(_rule_planner_args(case, gfx), adapter)
        assert not diff, (case.id, gfx, diff)


def test_the_rule_plans_the_adapters_arguments_on_the_nightly_cases_with_empty_requests() -> None:
    """The drift's own cases: the nightly bf16 decode cases with empty requests and small pools,
    among them the one that FAILed unlabelled on gfx942."""
    cases = [mc.case for mc in load("nightly").cases
             if mc.case.op == Op.DECODE and 0 in mc.case.q_lengths
             and mc.case.quant.q == "bf16" and mc.case.quant.kv == "bf16"
             and sum(mc.case.kv_lengths) <= 6_000]
    compared = []
    for case in cases:
        for gfx in ("gfx942", "gfx950"):
            adapter = _adapter_planner_args(case, gfx)
            if adapter is None:
                continue
            diff = _same(_rule_planner_args(case, gfx), adapter)
            assert not diff, (case.id, gfx, diff)
            compared.append((case.id, gfx))
    assert len(compared) >= 10, compared
    assert any(c.startswith(NIGHTLY_RED) and g == "gfx942" for c, g in compared), compared


def test_the_rule_plans_in_the_environment_the_adapter_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    """AITER's controls as the model's adapters pin them for their calls, whatever the process
    environment says (AITER_ENABLE_EXPERIMENTAL=1 there changes the planner's head folding)."""
    import os

    from mlacheck.backends import aiter_model
    from mlacheck.backends.aiter import folded_kv_offsets_wrong
    from mlacheck.backends.aiter.api import AITER_ENV_CONTROLS

    seen: list[dict[str, str | None]] = []
    planner = aiter_model.plan_decode_metadata

    def recording(*args: object, **kwargs: object) -> object:
        seen.append({k: os.environ.get(k) for k in AITER_ENV_CONTROLS})
        return planner(*args, **kwargs)

    monkeypatch.setattr(aiter_model, "plan_decode_metadata", recording)
    monkeypatch.setenv("AITER_ENABLE_EXPERIMENTAL", "1")
    case = next(mc.case for mc in load("nightly").cases if mc.case.id.startswith(NIGHTLY_RED))
    assert folded_kv_offsets_wrong(case, "gfx942")  # planned (the case finding 2 labels)
    assert seen and all(s == AITER_ENV_CONTROLS for s in seen)
    assert os.environ["AITER_ENABLE_EXPERIMENTAL"] == "1"  # restored afterwards
