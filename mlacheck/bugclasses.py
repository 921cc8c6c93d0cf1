"""The one catalogue of the classes a fault or a matrix group cites: the real MLA kernel bug
classes the suite must catch (numbered), and the boundary classes (by name).

The numbered classes are collected from public bug reports against production MLA kernels
(vLLM, SGLang, AITER); the boundary classes are the case shapes of mlacheck/boundaries.py,
which also holds the predicate that says whether a case has the shape. A matrix group names
the classes it targets (`covers:`, checked by the matrix loader) and each planted fault in
mlacheck/backends/faults names the class it reproduces (checked when the fault catalogue is
built), both through `is_class` / `describe` here. That every numbered class is covered is a
test, not a command: tests/unit/matrices/test_matrix_coverage.py (premerge claims every
class) and tests/unit/faults/test_faults.py (every class has a fault). `mlacheck list
--coverage` shows the boundary classes each matrix covers. Importing this imports no torch.
"""

from __future__ import annotations

ClassRef = int | str  # a numbered bug class, or a boundary class's name

# A planted fault that reproduces a generic mistake rather than one class (faults only).
GENERIC = "generic"

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
    # The DeepSeek-V3.2 sparse path before the attention: a wrong indexer or top-k does not
    # crash, it silently attends to the wrong tokens.
    13: "sparse indexer logits wrong: a per-token key scale ignored or read from the "
        "neighbouring token, the q scale folded into the weights twice, ReLU dropped, the "
        "causal window end off by one, page tails read past the context length",
    14: "top-k selection wrong: masked positions chosen for rows that see fewer than k, "
        "prefill positions not made relative to the row's window start",
    15: "top-k positions turned into KV slots wrongly: -1 padding converted to a slot or read "
        "as slot 0, a slot base that assumes contiguous pages, the conversion skipped",
}


def boundary_classes() -> dict[str, str]:
    """The boundary classes by name, with why each matters (mlacheck/boundaries.py)."""
    from mlacheck.boundaries import CLASSES

    return {c.name: c.why for c in CLASSES}


def is_class(ref: object, generic: bool = False) -> bool:
    """`ref` names a class of the catalogue (`generic`: "generic" counts, as for faults)."""
    if isinstance(ref, bool):
        return False
    if isinstance(ref, int):
        return ref in BUG_CLASSES
    return ref in boundary_classes() or (generic and ref == GENERIC)


def describe(ref: ClassRef) -> str:
    """What a class is, in one line."""
    if isinstance(ref, int):
        return BUG_CLASSES[ref]
    return GENERIC if ref == GENERIC else boundary_classes()[ref]


def what_may_be_cited(joiner: str = "or") -> str:
    """For a message: the numbered range and the boundary class names."""
    return (f"a bug class of mlacheck/bugclasses.py ({min(BUG_CLASSES)}..{max(BUG_CLASSES)}) "
            f"{joiner} a boundary class ({', '.join(boundary_classes())})")
