"""Each axis (formats, KV layouts) has one in-package definition that the rest reads."""

from __future__ import annotations

import pytest
import torch

from mlacheck import formats, fp8, layouts, strategies
from mlacheck.backends.aiter import adapter
from mlacheck.spec import Paging, PrefillCase, Quant, Segment


def test_torch_format_table_covers_exactly_the_formats() -> None:
    assert set(fp8.FORMATS) == set(formats.FORMATS)
    for name, f in fp8.FORMATS.items():
        assert f.dtype.itemsize == formats.FORMAT_BYTES[name], name


def test_every_reader_of_layouts_sees_the_registry() -> None:
    assert strategies.LAYOUTS == layouts.NAMES
    caps = adapter.model_factory().capabilities()
    assert tuple(caps["paged_prefill"].layouts) == layouts.NAMES


@pytest.mark.parametrize("layout", layouts.NAMES)
@pytest.mark.parametrize("kind", ["latent", "k", "v"])
def test_a_layout_stores_pages_in_its_page_shape_and_reads_them_back(layout: str, kind: str) -> None:
    lay = layouts.get(layout)
    lin = torch.randn(3, 16, 2, 64).to(torch.bfloat16)
    stored = lay.store(lin, "bf16", kind)
    assert tuple(stored.shape[1:]) == lay.page_shape(16, 2, 64, "bf16", kind)
    assert torch.equal(lay.load(stored, kind), lin)


def test_unknown_layout_and_bad_page_size_are_named() -> None:
    with pytest.raises(ValueError, match="layout must be one of linear, vectorized, not 'tiled'"):
        layouts.get("tiled")
    seg = (Segment(q_len=4, context_len=0),)
    with pytest.raises(ValueError, match="vectorized layout needs page_size % 16 == 0"):
        PrefillCase(seg, 16, quant=Quant("fp8_e4m3fn", "fp8_e4m3fn", "unit"),
                    paging=Paging(8, "vectorized"))


def test_case_markers_are_registered_from_the_one_definition(pytestconfig: pytest.Config) -> None:
    from mlacheck.markers import KNOWN_MARKERS, MARKERS

    registered = {line.split(":", 1)[0] for line in pytestconfig.getini("markers")}
    assert set(MARKERS) <= registered and tuple(MARKERS) == KNOWN_MARKERS
