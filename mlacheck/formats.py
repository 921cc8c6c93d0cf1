"""The element formats a case can store q, KV and output in: names and byte widths, without
torch (the case spec and layouts read them). Their torch dtypes, ranges and NaN encodings are
in `mlacheck.fp8`, keyed by these names (it checks that it covers exactly these)."""

from __future__ import annotations

FORMATS: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8_e4m3fn", "fp8_e4m3fnuz")
FORMAT_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3fn": 1, "fp8_e4m3fnuz": 1}
# CK's vectorized KV layout packs 16 bytes per vector: vec = 16 // element size.
VECTOR_BYTES = 16


def vector_width(fmt: str) -> int:
    return VECTOR_BYTES // FORMAT_BYTES[fmt]


# A page of the paged FP8 indexer-key cache (mlacheck.indexer_cache): its tokens' FP8 values,
# then one FP32 scale per token. Here, without torch: the run's controller sizes cases by it
# (mlacheck.footprint) and imports no torch.
INDEXER_SCALE_BYTES = 4


def indexer_page_bytes(page_size: int, dim: int) -> int:
    return page_size * (dim + INDEXER_SCALE_BYTES)
