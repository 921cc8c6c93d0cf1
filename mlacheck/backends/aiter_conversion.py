"""AITER's request-local top-k positions -> global KV slots (the `index_conversion` op), for
both AITER adapters: `aiter-triton` and the ASM `aiter` (real AITER or mlacheck's model of
it). One piece of launch code; each adapter only says how it imports AITER's modules.

What AITER has for it depends on its version (ROCm/aiter, read with git):

- The public entry point `compute_global_topk_ragged_indices_and_indptr(topk_indices,
  token_to_req_indices, block_table, block_size, is_valid_token)` -> `(global_topk_ragged,
  topk_indptr, topk_lens)`, ENTRY_SOURCE. It came with b50066a (#3833) and is in the tags
  v0.1.18 .. v0.1.19.post2; 8fbed79 (#4576) deleted that file ("It had no in-repo callers"),
  so v0.1.20 and main at e4048607a5 (the ASM adapter's TARGET_COMMIT) lack it. Called BY
  KEYWORD after an `inspect.signature` check, every token valid.
- Its two kernels, still at e4048607a5 (KERNEL_SOURCE): `_compute_topk_lens_kernel` (each
  token's count of entries >= 0) and `_pack_global_topk_ragged_kernel` (the first `count`
  entries of each row -> `block_table[req, p // block_size] * block_size + p % block_size`,
  written ragged at the token's indptr). Where the entry point is missing they are launched by
  keyword as it launches them: the counts, their cumulative sum as the indptr, the packing.

`find` picks the entry point where the installed AITER has one that fits, else the kernels,
else gives the SKIP reason naming both and where they are. Only the ragged layout: AITER has
no row-major conversion (ROW_MAJOR_CONVERSION_REASON). Nothing here has run on ROCm hardware.

Importing this module imports neither triton nor aiter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mlacheck import sparse_index
from mlacheck.backends.toolkit import signature_problem
from mlacheck.spec import Case

# Modules under the `aiter` package (or the API module standing for it).
ENTRY_MODULE = "ops.triton.attention.sparse_attention_dsv4"
KERNEL_MODULE = "ops.triton._triton_kernels.attention.sparse_attention_dsv4"
ENTRY = "compute_global_topk_ragged_indices_and_indptr"
ENTRY_SOURCE = ("aiter/ops/triton/attention/sparse_attention_dsv4.py:159-206 at ROCm/aiter "
                "70e9b02 / v0.1.19.post2, deleted by 8fbed79 (#4576)")
KERNEL_SOURCE = ("aiter/ops/triton/_triton_kernels/attention/sparse_attention_dsv4.py:64-129 at "
                 "ROCm/aiter e4048607a5")
KERNELS = ("_compute_topk_lens_kernel", "_pack_global_topk_ragged_kernel")

# The keywords passed (a kernel's: its Python parameters, `JITFunction.fn`).
CALLED_PARAMETERS: dict[str, tuple[str, ...]] = {
    ENTRY: ("topk_indices", "token_to_req_indices", "block_table", "block_size",  # (not an op)
            "is_valid_token"),
    "_compute_topk_lens_kernel": (
        "topk_lens_ptr", "topk_indices_ptr", "topk_indices_stride", "topk", "is_valid_token_ptr",
        "TRITON_BLOCK_SIZE"),
    "_pack_global_topk_ragged_kernel": (
        "global_topk_ragged_ptr", "topk_indptr_ptr", "topk_indices_ptr", "topk_indices_stride",
        "token_to_req_indices_ptr", "block_table_ptr", "block_table_stride", "block_size", "topk",
        "BLOCK_SIZE"),
}
CONVERSION_BLOCK = 128  # the packing kernel's BLOCK_SIZE in AITER's entry point (:193)
CONVERSION_LENS_BLOCK = 1024  # the count kernel's TRITON_BLOCK_SIZE there (:183)

ROW_MAJOR_CONVERSION_REASON = (
    "row-major slots: AITER's only positions -> slots conversion writes the ragged layout "
    "(_pack_global_topk_ragged_kernel, _triton_kernels/attention/sparse_attention_dsv4.py:"
    "90-129, e4048607a5; compute_global_topk_ragged_indices_and_indptr returns it too, "
    "attention/sparse_attention_dsv4.py:159-206 at 70e9b02); nothing else in its Triton tree "
    "(aiter/ops/triton) converts positions, its sparse attention takes global slots "
    "('topk_indices index the KV cache, not block_table', "
    "attention/unified_attention_sparse_mla.py:22)")

KERNELS_HOW = ("_compute_topk_lens_kernel -> indptr (cumsum) -> _pack_global_topk_ragged_kernel "
               "(AITER's DeepSeek-V4 kernels, launched as its "
               "compute_global_topk_ragged_indices_and_indptr launches them)")
ENTRY_HOW = f"{ENTRY} (AITER's entry point, by keyword; every token valid)"


def conversion_layout_rule(case: Case) -> str | None:
    if getattr(case, "index_layout", "ragged") != "ragged":
        return ROW_MAJOR_CONVERSION_REASON
    return None


@dataclass(frozen=True)
class Found:
    """What the installed AITER converts with: its entry point, else the module holding the
    two kernels, else `problem` (the SKIP reason)."""

    entry: Callable[..., Any] | None = None
    kernels: Any = None
    problem: str | None = None
    no_entry: str | None = None  # with `kernels`: why the entry point was not used


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def find(import_module: Callable[[str], Any], version: str) -> Found:
    """The installed conversion. `import_module(rel)` imports ENTRY_MODULE / KERNEL_MODULE
    under the adapter's AITER package (raising when it cannot)."""
    imported = ""
    try:
        entry = getattr(import_module(ENTRY_MODULE), ENTRY, None)
    except Exception as e:  # noqa: BLE001 - absent (AITER main) or broken: the kernels may serve
        entry, imported = None, f"; importing {ENTRY_MODULE}: {_first_line(e)}"
    missing = (f"installed aiter {version} has no {ENTRY} ({ENTRY_SOURCE}){imported}"
               if entry is None else signature_problem(entry, ENTRY, CALLED_PARAMETERS[ENTRY]))
    if missing is None:
        return Found(entry=entry)
    try:
        kernels = import_module(KERNEL_MODULE)
    except Exception as e:  # noqa: BLE001 - its reason is the SKIP's
        return Found(problem=f"{missing}; nor its kernels {' / '.join(KERNELS)} "
                             f"({KERNEL_SOURCE}; importing them: {_first_line(e)})")
    for name in KERNELS:
        kernel = getattr(kernels, name, None)
        why = (f"nor {name} ({KERNEL_SOURCE})" if kernel is None
               else signature_problem(getattr(kernel, "fn", kernel), name,
                                      CALLED_PARAMETERS[name]))
        if why:
            return Found(problem=f"{missing}; {why}")
    return Found(kernels=kernels, no_entry=missing)


def convert(found: Found, local: torch.Tensor, qo_indptr: torch.Tensor,
            block_table: torch.Tensor, page_size: int, out: torch.Tensor
            ) -> tuple[torch.Tensor, str]:
    """Positions `local` [T, topk] (each row's valid ones first, -1 after) -> the ragged global
    slots written into `out` (flat, capacity T * topk); returns (indptr [T + 1] int32, how)."""
    local = local.contiguous()
    t, k = local.shape
    dev = local.device
    indptr = torch.zeros(t + 1, dtype=torch.int32, device=dev)
    if not t:
        return indptr, _how(found)
    token_req = sparse_index.token_requests(qo_indptr.cpu()).to(dev, torch.int32)
    table = block_table.to(torch.int32).contiguous()
    valid = torch.ones(t, dtype=torch.bool, device=dev)
    if found.entry is not None:
        ragged, indptr, _ = found.entry(topk_indices=local, token_to_req_indices=token_req,
                                        block_table=table, block_size=page_size,
                                        is_valid_token=valid)
        n = int(indptr[-1])
        out[:n] = ragged[:n].to(out.dtype)
        return indptr, ENTRY_HOW
    lens = torch.zeros(t, dtype=torch.int32, device=dev)
    found.kernels._compute_topk_lens_kernel[(t,)](
        topk_lens_ptr=lens, topk_indices_ptr=local, topk_indices_stride=local.stride(0), topk=k,
        is_valid_token_ptr=valid, TRITON_BLOCK_SIZE=CONVERSION_LENS_BLOCK)
    torch.cumsum(lens, dim=0, out=indptr[1:])
    found.kernels._pack_global_topk_ragged_kernel[(t, -(-k // CONVERSION_BLOCK))](
        global_topk_ragged_ptr=out, topk_indptr_ptr=indptr, topk_indices_ptr=local,
        topk_indices_stride=local.stride(0), token_to_req_indices_ptr=token_req,
        block_table_ptr=table, block_table_stride=table.stride(0), block_size=page_size,
        topk=k, BLOCK_SIZE=CONVERSION_BLOCK)
    return indptr, _how(found)


def _how(found: Found) -> str:
    """What converted, for the verdict's `implementation`; with the kernels, why not the entry
    point (absent from this AITER, or present but not importable / of another signature)."""
    if found.entry is not None:
        return ENTRY_HOW
    return KERNELS_HOW + (f"; not the entry point: {found.no_entry}" if found.no_entry else "")
