"""The real MLA kernel bug classes the suite must catch, numbered as matrices cite them.

Collected from public bug reports against production MLA kernels (vLLM, SGLang, AITER).
A matrix group names the classes it targets (`covers:`, checked by the matrix loader) and
each planted fault in mlacheck/backends/faults names the class it reproduces (checked when
the catalogue is built). That every class here is covered is a test, not a command:
tests/unit/matrices/test_matrix_coverage.py (premerge claims every class) and
tests/unit/faults/test_faults.py (every class has a fault). `mlacheck list --coverage` shows
the boundary classes of mlacheck/boundaries.py instead.
"""

from __future__ import annotations

BUG_CLASSES: dict[int, str] = {
    1: "decode path sliced to all tokens (prefill + decode) instead of the decode tokens: "
       "prefill positions read uninitialised index buffers and out-of-range block-table rows",
    2: "sparse index buffer written ragged (cu_seqlens[token] + i) but read row-major "
       "(token * topk + i): identical only when every sparse length equals topk",
    3: "persistent buffers sized for the sparse layout but filled with the dense one",
    4: "FP8 ASM prefill wrong or faulting on multi-segment varlen batches (chunked prefill)",
    5: "head counts below 16 not padded, or padded wrongly (16 // 12 == 1)",
    6: "32-bit offsets wrapping in KV pools over 2 GB / 4 GB, and buffer descriptors whose "
       "range extends past the live page",
    7: "unit-scale FP8 casts: saturation / NaN on overflow; accuracy loss",
    8: "wrong LSE from a non-causal prefill kernel used for context chunks (merged output "
       "wrong only with chunked prefill over context)",
    9: "multi-token (MTP) decode with metadata sized for q_len 1",
    10: "persistent buffers reused across calls with a different batch shape",
    11: "page size > 1 on a path only ever tested with page size 1",
    12: "missing or wrong head padding / unpadding of the output; stray attributes on rarely "
        "taken paths (crash on first call)",
}
