"""Probes: the same data in another arrangement, to tell where a failure comes from.

When a whole batch fails, the row pattern alone cannot say whether each request is wrong or
the batch is (an empty request shifting its neighbours, segments run as one). When a request
with pages far into the pool fails, it cannot say whether the pages' position matters. A
probe rebuilds the inputs around the very same tensors:

- `one_unit`: request / segment u alone, same q rows, same pages (its own page table);
- `relocated`: every live page copied to the bottom of a compact pool (ids 0..n-1, bytes
  below 2^31), same tokens in the same order.

The golden of a probe is the original golden's rows (same data, same attention), so the
judge compares the kernel's probe output with rows it already has. The judge asks for probes
only on a FAIL whose axis they can sharpen (`collect`, through the harness's `Rerun`: the
kernel on other inputs) and reads them (judge.refine_diagnosis).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mlacheck import fp8, kvcache
from mlacheck.backends.base import Output
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs, Quantised, cu_seqlens
from mlacheck.kvcache import KVPool, PageTable
from mlacheck.spec import Case

# Requests probed alone (the first failing ones): enough to tell "each fails alone" from
# "they only fail together" without re-running a large batch request by request.
MAX_UNITS_ALONE = 3
# Pools whose live pages reach past these are worth relocating: narrow page-id types (2^15)
# and 32-bit byte offsets (2^31, or the signed wrap of the case's offset model).
RELOCATE_PAGE_ID = 1 << 15


def _rows(t: Quantised, a: int, b: int) -> Quantised:
    per_row = t.scale.dim() > 0 and t.scale.shape[0] == t.stored.shape[0]
    return Quantised(t.stored[a:b], t.scale[a:b] if per_row else t.scale, t.fmt, t.ideal[a:b])


def _sub_pool(pool: KVPool, u: int) -> KVPool:
    t = pool.table
    pages = t.pages_of(u)
    table = PageTable(t.page_size, torch.tensor([0, pages.numel()]), pages.clone(),
                      t.kv_lens[u : u + 1].clone())
    return KVPool(pool.data, pool.fmt, pool.scale, table, pool.layout, pool.kind)


def one_unit(inputs: Inputs, u: int) -> tuple[Case, Inputs]:
    """Request (decode) / segment (prefill) u alone, on the same memory."""
    case = inputs.case
    sub = case.with_units((case.units[u],))
    out_rows = inputs.out.out
    if isinstance(inputs, DecodeInputs):
        qo = inputs.qo_indptr.tolist()
        a, b = qo[u], qo[u + 1]
        view = dataclasses.replace(
            inputs, case=sub, q=_rows(inputs.q, a, b), kv=[inputs.kv[u]],
            pool=_sub_pool(inputs.pool, u), qo_indptr=cu_seqlens([b - a]).to(inputs.device),
            out=kvcache.guarded_empty((b - a, *out_rows.shape[1:]), out_rows.dtype,
                                      out_rows.device),
            topk_indices=None if inputs.topk_indices is None else inputs.topk_indices[a:b])
        return sub, view
    assert isinstance(inputs, PrefillInputs)
    qc, kc = inputs.cu_seqlens_q.tolist(), inputs.cu_seqlens_k.tolist()
    a, b = qc[u], qc[u + 1]
    seg = case.units[u]
    view = dataclasses.replace(
        inputs, case=sub, q=_rows(inputs.q, a, b), k=_rows(inputs.k, kc[u], kc[u + 1]),
        v=_rows(inputs.v, kc[u], kc[u + 1]),
        cu_seqlens_q=cu_seqlens([seg.q_len]).to(inputs.device),
        cu_seqlens_k=cu_seqlens([seg.kv_len]).to(inputs.device),
        out=kvcache.guarded_empty((b - a, *out_rows.shape[1:]), out_rows.dtype, out_rows.device),
        k_pool=None if inputs.k_pool is None else _sub_pool(inputs.k_pool, u),
        v_pool=None if inputs.v_pool is None else _sub_pool(inputs.v_pool, u))
    return sub, view


def _compact(pool: KVPool) -> KVPool:
    """The live pages copied to ids 0..n-1 of a fresh pool (fp8 copied as bits)."""
    bits = fp8.fmt(pool.fmt).bits_dtype
    ids = pool.table.indices.to(pool.data.device)
    data = pool.data.view(bits)[ids].view(pool.data.dtype)
    table = PageTable(pool.table.page_size, pool.table.indptr.clone(),
                      torch.arange(pool.table.indices.numel()), pool.table.kv_lens.clone())
    return KVPool(data, pool.fmt, pool.scale, table, pool.layout, pool.kind)


def worth_relocating(inputs: Inputs) -> bool:
    pool = inputs.paged_pool
    if pool is None or pool.table.indices.numel() == 0:
        return False
    top = int(pool.table.indices.max())
    signed_wrap = inputs.case.placement.wraps[0]
    return top >= RELOCATE_PAGE_ID or (top + 1) * pool.page_bytes > signed_wrap


def relocated(inputs: Inputs) -> Inputs:
    """The same tokens on a compact pool: page ids 0..n-1, bytes from 0."""
    out_rows = inputs.out.out
    fresh = kvcache.guarded_empty(tuple(out_rows.shape), out_rows.dtype, out_rows.device)
    if isinstance(inputs, DecodeInputs):
        return dataclasses.replace(inputs, pool=_compact(inputs.pool), out=fresh)
    assert inputs.k_pool is not None and inputs.v_pool is not None
    return dataclasses.replace(inputs, k_pool=_compact(inputs.k_pool),
                               v_pool=_compact(inputs.v_pool), out=fresh)


def units_worth_isolating(case: Case) -> bool:
    """A batch of several units with rows (sparse cases have their own pseudo-batches)."""
    return not case.sparse and sum(q > 0 for q in case.q_lengths) > 1


# The kernel under test on other inputs (the harness gives the judge one): None when it
# refuses the case or raises (a probe that fails says nothing).
Rerun = Callable[[Case, Inputs], "Output | None"]


@dataclass
class Probes:
    """Kernel outputs on rearranged copies of the inputs."""

    alone: dict[int, Output] = field(default_factory=dict)  # unit -> its output run alone
    relocated: Output | None = None  # all units, live pages moved to the pool's bottom


def collect(inputs: Inputs, rerun: Rerun, alone: bool = True) -> Probes:
    """Re-run the kernel on the same data arranged otherwise: units alone (when `alone`),
    pages relocated; a probe the kernel refuses or crashes on is left out."""
    found = Probes()
    if alone and units_worth_isolating(inputs.case):
        cuts = inputs.row_bounds
        with_rows = [u for u in range(len(cuts) - 1) if cuts[u + 1] > cuts[u]]
        for u in with_rows[:MAX_UNITS_ALONE]:
            with contextlib.suppress(Exception):
                out = rerun(*one_unit(inputs, u))
                if out is not None:
                    found.alone[u] = out
    if worth_relocating(inputs):
        with contextlib.suppress(Exception):
            found.relocated = rerun(inputs.case, relocated(inputs))
    return found
