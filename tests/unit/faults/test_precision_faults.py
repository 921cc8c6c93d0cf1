"""The small systematic faults (mlacheck/backends/faults/precision.py): each passes where its
mechanism cannot act, and the narrow-precision numerics they use reduce to the correct ones
in fp32. (That each is caught on its selftest groups, on a check its spec expects, is
tests/unit/faults/test_faults.py's selftest test.)"""

from __future__ import annotations

import pytest
import torch

from mlacheck.backends import numerics as nu
from mlacheck.backends.faults import FAULTS, make
from mlacheck.harness import run_case
from mlacheck.matrices import load
from mlacheck.spec import DecodeCase, Quant, Request
from mlacheck.verdict import FAIL, PASS

PRECISION = [n for n, s in FAULTS.items() if s.factory.startswith("mlacheck.backends.faults.precision:")]
SELFTEST = load("selftest").cases
FP16 = Quant("fp16", "fp16")


def test_every_class_of_the_issue_has_several_variants() -> None:
    families = {"tiles": ("pv-bf16-tiles", "qk-bf16-tiles", "qk-rope-bf16",
                          "narrow-accumulation-fp16", "split-lse-bf16"),
                "part scale": ("q-rope-scale", "k-rope-scale", "q-nope-scale", "k-nope-scale"),
                "log2e": ("log2e-bf16", "log2e-truncated", "log2e-1.45"),
                "softmax scale": ("sm-scale-bf16", "sm-scale-log2e-bf16", "sm-scale-base-bf16"),
                "mask edge": ("mask-edge-8192", "mask-edge-every-8192", "mask-edge-tiles-8192")}
    assert sorted(n for f in families.values() for n in f) == sorted(PRECISION)
    assert all(len(f) >= 3 for f in families.values())


@pytest.mark.parametrize("name", ["pv-bf16-tiles", "qk-bf16-tiles"])
def test_tile_faults_need_a_second_tile(name: str) -> None:
    """Every other 64-key tile is narrowed: kv within one tile is untouched (bitwise)."""
    one_tile = DecodeCase(requests=(Request(1, 64), Request(1, 40)), num_heads=16,
                          page_size=16, quant=FP16)
    assert run_case(one_tile, make(name)).status == PASS
    two_tiles = DecodeCase(requests=(Request(1, 300), Request(1, 2500)), num_heads=16,
                           page_size=16, quant=FP16)
    assert run_case(two_tiles, make(name)).status == FAIL


def test_split_lse_needs_a_merge() -> None:
    single_key = DecodeCase(requests=(Request(1, 1), Request(1, 1)), num_heads=16,
                            page_size=16, quant=FP16)
    assert run_case(single_key, make("split-lse-bf16")).status == PASS


@pytest.mark.parametrize("name", [n for n in PRECISION if n.startswith("mask-edge")])
def test_mask_edge_faults_pass_up_to_8192_keys(name: str) -> None:
    (contrast,) = [mc.case for mc in SELFTEST if mc.group == "decode-8k-contrast"]
    assert max(r.kv_len for r in contrast.requests) == 8192
    assert run_case(contrast, make(name)).status == PASS


@pytest.mark.parametrize("field", ["pv_tile_format", "score_tile_format", "rope_score_format"])
def test_narrowed_numerics_in_fp32_are_the_correct_ones(field: str) -> None:
    """The per-tile product and the split score product, kept in fp32, give the default
    numerics' result (fp32 reassociation only): the faults differ by the narrowing alone."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 576, generator=gen)
    k = torch.randn(300, 1, 576, generator=gen)
    v = k[..., :512]
    ref, ref_lse = nu.flash_attend(q, k, v, 0.05, True, "bf16")
    got, got_lse = nu.flash_attend(q, k, v, 0.05, True, "bf16", nu.Numerics(**{field: "fp32"}))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_lse, ref_lse, rtol=1e-6, atol=1e-6)
