"""Validator of persistent-schedule metadata in AITER's format (MLA decode and FP8 prefill).

A persistent kernel runs a fixed grid of work groups ("CUs"); AITER's planner hands each one
a list of work items and tells a reduce kernel how to merge the fp32 partial results of
split work. A wrong schedule silently drops or double-counts KV, writes the wrong output
rows, or reads another batch's pages (bug classes (mlacheck/bugclasses.py) 3, 9, 10). This module checks
the six buffers against the batch they are meant for, as pure functions of CPU tensors, and
returns precise messages ("work 17 on CU 3 covers kv pages 40-55 of request 2, which has 48
pages"); an empty list means the schedule is consistent. It works on real AITER metadata and
on mlacheck's model of AITER (`mlacheck.backends.aiter_model`, which also provides the
reference scheduler).

Format (AITER main, csrc/include/mla.h): work_indptr [CUs + 1] (works of CU c are
work_indptr[c] .. work_indptr[c+1]); work_info_set rows [batch, partial_qo_loc, qo_start,
qo_end, kv_start, kv_end, kv_offset, pad]; reduce_indptr / reduce_final_map /
reduce_partial_map: CSR over query tiles, each listing the partial rows merged into the
tile's output rows. kv_start / kv_end index kv_indices (pages when page_size > 1) relative to
kv_indptr[0]; with top-k (sparse) every query token is its own pseudo-batch whose entries
are kv_indices[t*topk : t*topk + min(kv_len, topk)]. Heads AITER does not take natively are
folded into groups of 16: kernel query rows are then [token][group] (q_len 1) or
[request][group][token] (uniform q_len), and batch_idx is request * fold + group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlacheck.backends.aiter import rules
from mlacheck.verdict import ranges

WORK_FIELDS = 8  # int32 per work row
BATCH, PARTIAL, QO_START, QO_END, KV_START, KV_END, KV_OFFSET, EXTRA = range(WORK_FIELDS)
NO_PARTIAL = -1
MAX_MESSAGES = 40  # problems named one by one; the rest are counted in a last message
BUFFER_NAMES = ("work_metadata_ptrs", "work_indptr", "work_info_set", "reduce_indptr",
                "reduce_final_map", "reduce_partial_map")
PS_HEAD_BITS, PS_HEAD_MASK = 16, 0xFFFF  # PS work rows: [7] = (head_end << 16) | head_start


# --------------------------------------------------------------------------- shared helpers


class _Report:
    """Collects messages; identical problems over consecutive rows become one message."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self._row_problems: dict[tuple[Any, ...], list[int]] = defaultdict(list)

    def add(self, message: str) -> None:
        self.messages.append(message)

    def row_problem(self, key: tuple[Any, ...], row: int) -> None:
        """key = (format string with {rows}, *format args); rows are gathered into ranges."""
        self._row_problems[key].append(row)

    def result(self) -> list[str]:
        for (fmt, *args), rows in self._row_problems.items():
            self.messages.append(fmt.format(*args, rows=_ranges(rows)))
        if len(self.messages) > MAX_MESSAGES:
            extra = len(self.messages) - MAX_MESSAGES
            return self.messages[:MAX_MESSAGES] + [f"... and {extra} more problems"]
        return self.messages


def _ranges(xs: Iterable[int]) -> str:
    """[0,1,2,5] -> '0-2, 5' (every run)."""
    xs = list(xs)
    return ranges(xs, limit=len(xs) + 1, sep=", ")


def _span(lo: int, hi: int) -> str:
    """Half-open [lo, hi) as an inclusive 'lo-hi' range."""
    if hi - lo == 1:
        return f"{lo}"
    return f"{lo}-{hi - 1}" if hi > lo else f"{lo}-{hi - 1} (empty)"


def _ints(t: torch.Tensor | None) -> list[int]:
    return [] if t is None else [int(x) for x in t.detach().cpu().reshape(-1).tolist()]


def _shape(shape: Any) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)


def _check_sizes(rep: _Report, buffers: dict[str, torch.Tensor | None],
                 info_sizes: Sequence[tuple[Any, torch.dtype]] | None, source: str) -> None:
    """Each buffer against the (shape, dtype) the info function returned: the kernels read
    work_indptr's length as the grid size, so it must match; the others may be larger."""
    if info_sizes is None:
        return
    for name, (shape, dtype) in zip(BUFFER_NAMES, info_sizes, strict=True):
        buf = buffers.get(name)
        if buf is None:
            continue
        want, have = _shape(shape), tuple(buf.shape)
        if buf.dtype != dtype:
            rep.add(f"{name} is {buf.dtype} but {source} asks for {dtype}")
        if name == "work_indptr" and have != want:
            rep.add(f"work_indptr has {have[0]} entries but {source} gives {want[0]}: the kernel "
                    f"launches one work group per entry minus one")
        elif len(have) != len(want) or any(h < w for h, w in zip(have, want, strict=False)):
            rep.add(f"{name} has shape {have}, smaller than {source}'s {want}")


def _check_work_indptr(rep: _Report, indptr: list[int], capacity: int, source: str) -> int:
    """Monotone from 0, ending at the work count; returns the count of works to read."""
    if not indptr:
        rep.add("work_indptr is empty")
        return 0
    if indptr[0] != 0:
        rep.add(f"work_indptr[0] is {indptr[0]}, not 0")
    for c in range(len(indptr) - 1):
        if indptr[c + 1] < indptr[c]:
            rep.add(f"work_indptr decreases at CU {c}: {indptr[c]} -> {indptr[c + 1]} "
                    "(unwritten or stale entries?)")
            break
    total = indptr[-1]
    if total > capacity:
        rep.add(f"work_indptr ends at {total} works but work_info_set holds {capacity} rows "
                f"({source} sized it for fewer works)")
    return max(0, min(total, capacity))


def _cu_of(indptr: list[int], n_works: int) -> list[int]:
    cu = [-1] * n_works
    for c in range(len(indptr) - 1):
        for w in range(max(indptr[c], 0), min(indptr[c + 1], n_works)):
            cu[w] = c
    return cu


@dataclass
class _Coverage:
    """KV intervals per kernel query row (and head, for PS), with the works that cover them."""

    spans: dict[tuple[int, int], list[tuple[int, int, int]]] = field(
        default_factory=lambda: defaultdict(list))

    def add(self, row: int, head: int, lo: int, hi: int, work: int) -> None:
        self.spans[(row, head)].append((lo, hi, work))


def _coverage_problems(rep: _Report, cov: _Coverage, rows_heads: Iterable[tuple[int, int]],
                       need: Any, name: Any, unit: str) -> None:
    """Each (row, head) must cover its required KV [lo, hi) exactly once (and nothing
    twice). need(row) -> (lo, hi_required, hi_allowed); name(row, head) -> description.
    Positions in messages count from the row's first kv entry (request-relative)."""
    for row, head in rows_heads:
        lo, hi_req, _ = need(row)
        spans = sorted(cov.spans.get((row, head), []))
        if not spans:
            if hi_req > lo:
                rep.row_problem(("query rows {rows} ({}) are covered by no work", name(row, head)),
                                row)
            continue
        pos = lo
        for s_lo, s_hi, w in spans:
            if s_lo < pos:
                other = [x[2] for x in spans if x[0] < s_hi and s_lo < x[1] and x[2] != w]
                rep.row_problem(("query rows {rows} ({}): kv {} {} covered more than once "
                                 "(works {})", name(row, head), unit,
                                 _span(s_lo - lo, min(pos, s_hi) - lo),
                                 ", ".join(str(x) for x in sorted({w, *other}))), row)
            elif s_lo > pos and pos < hi_req:
                rep.row_problem(("query rows {rows} ({}): kv {} {} covered by no work",
                                 name(row, head), unit, _span(pos - lo, min(s_lo, hi_req) - lo)),
                                row)
            pos = max(pos, s_hi)
        if pos < hi_req:
            rep.row_problem(("query rows {rows} ({}): kv {} {} covered by no work",
                             name(row, head), unit, _span(pos - lo, hi_req - lo)), row)


# --------------------------------------------------------------------------- decode


@dataclass
class _Rows:
    """Kernel query rows: which request / token / head group each belongs to."""

    request: list[int]
    token: list[int]  # global token index (qo_indptr space)
    group: list[int]  # head group (0 when unfolded)
    fold: int
    heads_per_group: int

    def name(self, row: int, qo: list[int]) -> str:
        r, t = self.request[row], self.token[row]
        s = f"request {r} token {t - qo[r]}"
        if self.fold > 1:
            g = self.group[row]
            s += f", heads {g * self.heads_per_group}-{(g + 1) * self.heads_per_group - 1}"
        return s


def _kernel_rows(qo: list[int], fold: int, sparse: bool, heads: int) -> _Rows | str:
    """Row geometry after head folding; a string explains why it cannot be built."""
    n_req = len(qo) - 1
    lens = [qo[r + 1] - qo[r] for r in range(n_req)]
    owner = [r for r in range(n_req) for _ in range(lens[r])]
    tokens = list(range(qo[-1] - qo[0])) if n_req else []
    tokens = [t + qo[0] for t in tokens]
    group_size = rules.FOLD_HEADS if fold > 1 else heads
    if fold == 1:
        return _Rows(owner, tokens, [0] * len(tokens), 1, group_size)
    if sparse or (lens and all(n == 1 for n in lens)):  # q_len 1: row = token * fold + group
        return _Rows([owner[t] for t in range(len(tokens)) for _ in range(fold)],
                     [tokens[t] for t in range(len(tokens)) for _ in range(fold)],
                     [g for _ in tokens for g in range(fold)], fold, group_size)
    if len(set(lens)) != 1:
        return (f"heads are folded x{fold} (groups of 16) but q lengths differ "
                f"({min(lens)}..{max(lens)}): AITER folds only uniform q lengths")
    s = lens[0]  # row = ((request * fold) + group) * s + token
    req, tok, grp = [], [], []
    for r in range(n_req):
        for g in range(fold):
            for i in range(s):
                req.append(r)
                tok.append(qo[r] + i)
                grp.append(g)
    return _Rows(req, tok, grp, fold, group_size)


def validate_mla_metadata(
    work_indptr: torch.Tensor,
    work_info_set: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    page_size: int,
    num_heads: int,
    max_seqlen_qo: int,
    *,
    work_metadata_ptrs: torch.Tensor | None = None,
    topk: int | None = None,
    is_causal: bool = True,
    info_sizes: Sequence[tuple[Any, torch.dtype]] | None = None,
    kv_indices_len: int | None = None,
    kv_granularity: int | None = None,
    uni_seqlen_qo: int | None = None,
    head_fold: int | None = None,
    gfx: str | None = None,
    q_dtype: torch.dtype | None = None,
    kv_dtype: torch.dtype | None = None,
    num_heads_k: int = 1,
    experimental: bool = False,
    partial_rows: int | None = None,
    reduce_single_partials: bool = False,
    **_unused: Any,
) -> list[str]:
    """Problems of a persistent MLA decode schedule (get_mla_metadata_v1's six buffers) for
    the batch described by qo_indptr / kv_indptr (pages) / kv_last_page_lens; [] if none.

    topk: None or < 0 for dense, else the sparse top-k. head_fold: AITER's pseudo-batches
    per request; None derives it from gfx / q_dtype / kv_dtype (AITER's rule) when given,
    else 1. info_sizes: what get_mla_metadata_info_v1 returned for the buffers. partial_rows:
    rows of the fp32 partial buffer (default: reduce_partial_map size x max_seqlen_qo, what
    mla_decode_fwd allocates). reduce_single_partials: True when mla_reduce_v1 merges
    one-partial tiles (ROCm/aiter#3606); AITER main skips them.
    """
    rep = _Report()
    source = "get_mla_metadata_info_v1"
    buffers = {"work_metadata_ptrs": work_metadata_ptrs, "work_indptr": work_indptr,
               "work_info_set": work_info_set, "reduce_indptr": reduce_indptr,
               "reduce_final_map": reduce_final_map, "reduce_partial_map": reduce_partial_map}
    _check_sizes(rep, buffers, info_sizes, source)
    if work_info_set.dim() != 2 or work_info_set.shape[1] != WORK_FIELDS:
        rep.add(f"work_info_set has shape {tuple(work_info_set.shape)}, not [works, 8]")
        return rep.result()

    qo, kv, last = _ints(qo_indptr), _ints(kv_indptr), _ints(kv_last_page_lens)
    n_req = len(qo) - 1
    sparse = topk is not None and topk >= 0
    heads = num_heads * num_heads_k
    if len(kv) != n_req + 1 or len(last) < n_req:
        rep.add(f"batch description is inconsistent: {n_req} requests in qo_indptr, "
                f"{len(kv) - 1} in kv_indptr, {len(last)} kv_last_page_lens")
        return rep.result()
    q_lens = [qo[r + 1] - qo[r] for r in range(n_req)]
    if q_lens and max(q_lens) > max_seqlen_qo and not sparse:
        r = q_lens.index(max(q_lens))
        rep.add(f"request {r} has {q_lens[r]} query tokens but the metadata was built for "
                f"max_seqlen_qo {max_seqlen_qo} (metadata sized for a shorter q_len?)")
    if uni_seqlen_qo is not None and uni_seqlen_qo > 0 and not sparse:
        odd = [r for r in range(n_req) if q_lens[r] != uni_seqlen_qo]
        if odd:
            rep.add(f"uni_seqlen_qo={uni_seqlen_qo} but request {odd[0]} has {q_lens[odd[0]]} "
                    "query tokens: the planner then ignores qo_indptr and assumes "
                    f"{uni_seqlen_qo} per request")
    if head_fold is None:
        head_fold = 1
        if gfx is not None and q_dtype is not None and kv_dtype is not None:
            # sparse metadata is built (and decoded) with one query token per pseudo-batch
            head_fold = rules.head_fold(gfx, heads, 1 if sparse else max_seqlen_qo,
                                         _is_fp8(q_dtype), _is_fp8(kv_dtype), experimental)
    rows = _kernel_rows(qo, head_fold, sparse, heads)
    if isinstance(rows, str):
        rep.add(rows)
        return rep.result()

    indptr = _ints(work_indptr)
    work_rows = work_info_set.detach().cpu().tolist()
    n_works = _check_work_indptr(rep, indptr, len(work_rows), source)
    cu = _cu_of(indptr, n_works)
    pmap = _ints(reduce_partial_map)
    if partial_rows is None:
        partial_rows = len(pmap) * max(max_seqlen_qo, 1)
    ps = page_size
    unit = "pages" if ps > 1 else "tokens"
    base = kv[0] if kv else 0
    topk_units = -(-topk // ps) if sparse and topk is not None else 0
    n_rows = len(rows.request)

    def kv_range(row: int) -> tuple[int, int, int]:
        """(lo, end of required kv, end of allowed kv) of a kernel row, in kv_indices units."""
        r = rows.request[row]
        n = kv[r + 1] - kv[r]
        if sparse:
            t = rows.token[row] - qo[0]
            lo = t * topk_units
            return lo, lo + min(n, topk_units), lo + min(n, topk_units)
        lo, hi = kv[r] - base, kv[r + 1] - base
        if not is_causal:
            return lo, hi, hi
        kv_len = (n - 1) * ps + last[r] if n > 0 else 0
        visible = kv_len - q_lens[r] + (rows.token[row] - qo[r]) + 1
        return lo, lo + min(n, max(0, -(-visible // ps))), hi

    cov = _Coverage()
    direct_rows: dict[int, list[int]] = defaultdict(list)
    partial_of: dict[int, int] = {}  # partial start row -> work
    partial_owner: dict[int, int] = {}  # partial row -> work
    split_works: list[int] = []
    for w in range(n_works):
        row = work_rows[w]
        where = f"work {w} on CU {cu[w]}"
        bi, loc, qs, qe, ks, ke, koff = row[:7]
        if not 0 <= qs < qe <= n_rows:
            rep.add(f"{where} covers query rows {_span(qs, qe)}, outside the {n_rows} kernel "
                    "rows" + (f" ({n_req} requests x {head_fold} head groups)"
                              if head_fold > 1 else ""))
            continue
        req = rows.request[qs]
        owners = {rows.request[x] for x in range(qs, qe)}
        want_batch = req if sparse else req * head_fold + rows.group[qs]
        if bi != want_batch:
            rep.add(f"{where} has batch_idx {bi} but its query rows {_span(qs, qe)} belong to "
                    + (f"request {req} (pseudo-batch {want_batch})" if head_fold > 1 or sparse
                       else f"request {req}"))
        if len(owners) > 1:
            rep.add(f"{where} covers query rows {_span(qs, qe)}, which span requests "
                    f"{_ranges(owners)}")
        elif len({rows.group[x] for x in range(qs, qe)}) > 1:
            rep.add(f"{where} covers query rows {_span(qs, qe)}, which span head groups "
                    f"{_ranges({rows.group[x] for x in range(qs, qe)})}")
        if sparse and qe - qs != 1:
            rep.add(f"{where} covers {qe - qs} query rows ({_span(qs, qe)}); with top-k every "
                    "query token is its own pseudo-batch (dense metadata in sparse buffers? "
                    "topk not passed to get_mla_metadata_v1?)")
        lo, hi_req, hi_ok = kv_range(qs)
        if ke < ks:
            rep.add(f"{where} has kv_end {ke} < kv_start {ks}")
            continue
        if ks < lo or ke > hi_ok:
            if sparse:
                t = rows.token[qs] - qo[0]
                rep.add(f"{where} covers kv entries {_span(ks, ke)}, outside token {t}'s top-k "
                        f"entries {_span(lo, hi_ok)} (request {req})")
            else:
                rep.add(f"{where} covers kv {unit} {_span(ks - lo, ke - lo)} of request {req}, "
                        f"which has {hi_ok - lo} {unit}")
        if kv_indices_len is not None and ke > kv_indices_len:
            rep.add(f"{where} reads kv_indices[{ks}:{ke}] past its {kv_indices_len} entries")
        if kv_granularity and (ks - lo) % kv_granularity:
            rep.add(f"{where} starts at kv {unit[:-1]} {ks - lo} of its batch, not a multiple "
                    f"of kv_granularity {kv_granularity}")
        want_off = _decode_kv_offset(ke, hi_ok, ps, last[req], sparse, head_fold,
                                     rows.token[qs] - qo[req], q_lens[req])
        if koff != want_off:
            rep.add(f"{where} has kv_offset {koff}, expected {want_off} (tokens of request "
                    f"{req} after this work's kv_end)")
        for x in range(qs, qe):
            cov.add(x, 0, ks, ke, w)
        if loc == NO_PARTIAL:
            for x in range(qs, qe):
                direct_rows[x].append(w)
            continue
        if loc < 0 or loc + (qe - qs) > partial_rows:
            rep.add(f"{where} writes partial rows {_span(loc, loc + qe - qs)}, outside the "
                    f"{partial_rows}-row partial buffer")
        for p in range(loc, loc + qe - qs):
            if p in partial_owner:
                rep.add(f"partial row {p} is written by work {partial_owner[p]} and {where}")
            partial_owner[p] = w
        partial_of.setdefault(loc, w)
        split_works.append(w)

    if info_sizes is not None:
        _check_usage(rep, info_sizes, work_rows[:n_works], _ints(reduce_indptr), partial_owner,
                     max(max_seqlen_qo, 1), source)
    _coverage_problems(rep, cov, ((x, 0) for x in range(n_rows)), kv_range,
                       lambda x, _h: rows.name(x, qo), unit)
    _check_reduce(rep, work_rows, direct_rows, partial_of, split_works, reduce_indptr,
                  reduce_final_map, pmap, n_rows, lambda x: rows.name(x, qo),
                  reduce_single_partials, cov)
    return rep.result()


def _check_usage(rep: _Report, info_sizes: Sequence[tuple[Any, torch.dtype]],
                 works: list[list[int]], rptr: list[int], partial_owner: dict[int, int],
                 rows_per_partial: int, source: str) -> None:
    """What the schedule uses against what the info function sized (the buffers may be
    larger, e.g. reused from a bigger batch, and still be too small for AITER's sizing)."""
    sizes = {n: _shape(s) for n, (s, _) in zip(BUFFER_NAMES, info_sizes, strict=True)}
    hint = "buffers sized for another batch shape, q length or head count"
    if len(works) > sizes["work_info_set"][0]:
        rep.add(f"the schedule has {len(works)} works but {source} sizes work_info_set for "
                f"{sizes['work_info_set'][0]}: {hint}")
    tiles = len({(w[QO_START], w[QO_END]) for w in works})
    if tiles + 1 > sizes["reduce_indptr"][0]:
        rep.add(f"the schedule has {tiles} query tiles but {source} sizes reduce_indptr for "
                f"{sizes['reduce_indptr'][0]} entries: {hint}")
    used = rptr[-1] if rptr else 0
    if used > sizes["reduce_partial_map"][0]:
        rep.add(f"the reduce merges {used} partials but {source} sizes reduce_partial_map for "
                f"{sizes['reduce_partial_map'][0]}: {hint}")
    rows = max(partial_owner, default=-1) + 1
    if rows > sizes["reduce_partial_map"][0] * rows_per_partial:
        rep.add(f"partial rows up to {rows - 1} are written but the partial buffer sized from "
                f"{source} has {sizes['reduce_partial_map'][0] * rows_per_partial} rows: {hint}")


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _decode_kv_offset(kv_end: int, batch_end: int, page_size: int, last: int, sparse: bool,
                      fold: int, local: int, q_len: int) -> int:
    """What AITER's planner stores as kv_offset: tokens of the batch after kv_end."""
    if page_size == 1:
        off = batch_end - kv_end
        if sparse and fold == 1:
            off += q_len - 1 - local
        return off
    return 0 if kv_end == batch_end else (batch_end - kv_end - 1) * page_size + last


def _check_reduce(rep: _Report, work_rows: list[list[int]], direct_rows: dict[int, list[int]],
                  partial_of: dict[int, int], split_works: list[int],
                  reduce_indptr: torch.Tensor, reduce_final_map: torch.Tensor,
                  pmap: list[int], n_rows: int, row_name: Any, single_ok: bool,
                  cov: _Coverage) -> None:
    """Reduce maps: CSR sane; every split work merged exactly once into its own rows; every
    (row, head) written exactly once (by a direct work or one reduce tile)."""
    rptr = _ints(reduce_indptr)
    fmap = reduce_final_map.detach().cpu().reshape(-1, 2).tolist() if reduce_final_map.numel() \
        else []
    if not rptr or rptr[0] != 0:
        rep.add(f"reduce_indptr[0] is {rptr[0] if rptr else 'missing'}, not 0")
    for t in range(len(rptr) - 1):
        if rptr[t + 1] < rptr[t]:
            rep.add(f"reduce_indptr decreases at tile {t}: {rptr[t]} -> {rptr[t + 1]}")
            return
    if rptr and rptr[-1] > len(pmap):
        rep.add(f"reduce_indptr ends at {rptr[-1]} partials but reduce_partial_map holds "
                f"{len(pmap)}")
        return
    need = 1 if single_ok else 2
    merged_by: dict[int, int] = {}
    writers: dict[int, list[str]] = defaultdict(list)  # row -> who writes its final output
    for x, ws in direct_rows.items():
        writers[x] += [f"work {w}" for w in ws]
    for t in range(len(rptr) - 1):
        lo, hi = rptr[t], rptr[t + 1]
        if hi == lo:
            continue
        if t >= len(fmap):
            rep.add(f"reduce tile {t} has partials but reduce_final_map has {len(fmap)} rows")
            continue
        qs, qe = int(fmap[t][0]), int(fmap[t][1])
        starts = pmap[lo:hi]
        if not 0 <= qs < qe <= n_rows:
            rep.add(f"reduce tile {t} writes rows {_span(qs, qe)}, outside the {n_rows} kernel "
                    "rows")
            continue
        if hi - lo < need:
            rep.add(f"reduce tile {t} lists a single partial (row {starts[0]}): mla_reduce_v1 "
                    f"at AITER main skips such tiles, so query rows {_span(qs, qe)} "
                    f"({row_name(qs)}) are never written")
        else:
            for x in range(qs, qe):
                writers[x].append(f"reduce tile {t}")
        seen: set[int] = set()
        for p in starts:
            if p in seen:
                rep.add(f"reduce tile {t} lists partial row {p} twice")
                continue
            seen.add(p)
            if p in merged_by:
                rep.add(f"partial row {p} is merged by reduce tiles {merged_by[p]} and {t}")
            merged_by[p] = t
            w = partial_of.get(p)
            if w is None:
                rep.add(f"reduce tile {t} merges partial row {p}, which no work writes "
                        "(stale buffer?)")
                continue
            ws, we = work_rows[w][QO_START], work_rows[w][QO_END]
            if (ws, we) != (qs, qe):
                rep.add(f"reduce tile {t} merges partial row {p} of work {w} (query rows "
                        f"{_span(ws, we)}) into rows {_span(qs, qe)}")
    for w in split_works:
        p = work_rows[w][PARTIAL]
        if p not in merged_by:
            qs, qe = work_rows[w][QO_START], work_rows[w][QO_END]
            rep.add(f"work {w} writes partial rows {_span(p, p + qe - qs)} that no reduce tile "
                    f"merges: query rows {_span(qs, qe)} lose that KV")
    for x in range(n_rows):
        ws = writers.get(x, [])
        if len(ws) > 1:
            rep.row_problem(("query rows {rows} ({}) are written {} times (by {})",
                             row_name(x), len(ws), ", ".join(ws)), x)
        mixed = direct_rows.get(x)
        if mixed:
            others = {s[2] for s in cov.spans.get((x, 0), [])} - set(mixed)
            if others:
                rep.row_problem(("query rows {rows} ({}) are written directly by work {} "
                                 "(partial_qo_loc -1) but works {} also cover them: their KV "
                                 "is lost", row_name(x), mixed[0],
                                 ", ".join(map(str, sorted(others)))), x)


# --------------------------------------------------------------------------- PS prefill


def validate_ps_metadata(
    work_indptr: torch.Tensor,
    reduce_indptr: torch.Tensor,
    reduce_final_map: torch.Tensor,
    reduce_partial_map: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    context_lens: torch.Tensor,
    num_heads_k: int,
    *,
    work_info_set: torch.Tensor | None = None,
    work_info: torch.Tensor | None = None,
    work_metadata_ptrs: torch.Tensor | None = None,
    gqa_ratio: int = 1,
    qhead_granularity: int = 1,
    qlen_granularity: int = 256,
    block_size: int = 1,
    is_causal: bool = True,
    info_sizes: Sequence[tuple[Any, torch.dtype]] | None = None,
    kv_page_indices_len: int | None = None,
    partial_rows: int | None = None,
    reduce_single_partials: bool = False,
    **_unused: Any,
) -> list[str]:
    """Problems of an FP8 persistent prefill schedule (get_ps_metadata_v1's buffers; work rows
    carry (head_end << 16) | head_start in column 7); [] if none. kv_indptr counts pages of
    block_size tokens; partial rows default to reduce_partial_map size x qlen_granularity
    (what mla_prefill_ps_fwd allocates); reduce_single_partials: ROCm/aiter#3606 semantics."""
    rep = _Report()
    source = "get_ps_metadata_info_v1"
    works_t = work_info_set if work_info_set is not None else work_info
    if works_t is None:
        return ["validate_ps_metadata needs work_info_set (or work_info)"]
    buffers = {"work_metadata_ptrs": work_metadata_ptrs, "work_indptr": work_indptr,
               "work_info_set": works_t, "reduce_indptr": reduce_indptr,
               "reduce_final_map": reduce_final_map, "reduce_partial_map": reduce_partial_map}
    _check_sizes(rep, buffers, info_sizes, source)
    if works_t.dim() != 2 or works_t.shape[1] != WORK_FIELDS:
        rep.add(f"work_info has shape {tuple(works_t.shape)}, not [works, 8]")
        return rep.result()
    qo, kv, ctx = _ints(qo_indptr), _ints(kv_indptr), _ints(context_lens)
    n_req = len(qo) - 1
    heads = num_heads_k * gqa_ratio
    n_rows = qo[-1] if qo else 0
    owner = [r for r in range(n_req) for _ in range(qo[r + 1] - qo[r])]
    pmap = _ints(reduce_partial_map)
    if partial_rows is None:
        partial_rows = len(pmap) * qlen_granularity
    indptr = _ints(work_indptr)
    work_rows = works_t.detach().cpu().tolist()
    n_works = _check_work_indptr(rep, indptr, len(work_rows), source)
    cu = _cu_of(indptr, n_works)

    def need(row: int) -> tuple[int, int, int]:
        r = owner[row]
        lo, hi = kv[r], kv[r + 1]
        if not is_causal:
            return lo, hi, hi
        visible = ctx[r] - (qo[r + 1] - qo[r]) + (row - qo[r]) + 1
        return lo, lo + min(hi - lo, max(0, -(-visible // block_size))), hi

    def name(row: int, head: int) -> str:
        r = owner[row]
        return f"segment {r} token {row - qo[r]}, head {head}"

    cov = _Coverage()
    direct: dict[tuple[int, int], list[int]] = defaultdict(list)
    partial_heads: dict[int, dict[int, int]] = defaultdict(dict)  # loc -> head -> work
    written: dict[tuple[int, int], int] = {}
    for w in range(n_works):
        row = work_rows[w]
        where = f"work {w} on CU {cu[w]}"
        b, loc, qs, qe, ks, ke = row[:6]
        packed = row[EXTRA] & 0xFFFFFFFF
        h0, h1 = packed & PS_HEAD_MASK, (packed >> PS_HEAD_BITS) & PS_HEAD_MASK
        if not 0 <= h0 < h1 <= heads:
            rep.add(f"{where} has q heads {_span(h0, h1)}, outside the {heads} heads")
            continue
        if not 0 <= qs < qe <= n_rows:
            rep.add(f"{where} covers query rows {_span(qs, qe)}, outside the {n_rows} rows")
            continue
        if not 0 <= b < n_req or any(owner[x] != b for x in range(qs, qe)):
            rep.add(f"{where} has batch {b} but covers query rows {_span(qs, qe)} of segments "
                    f"{_ranges({owner[x] for x in range(qs, qe)})}")
            continue
        if ke < ks or ks < kv[b] or ke > kv[b + 1]:
            rep.add(f"{where} covers kv pages {_span(ks - kv[b], ke - kv[b])} of segment {b}, "
                    f"which has {kv[b + 1] - kv[b]} pages")
        if kv_page_indices_len is not None and ke > kv_page_indices_len:
            rep.add(f"{where} reads kv_page_indices[{ks}:{ke}] past its {kv_page_indices_len} "
                    "entries")
        for x in range(qs, qe):
            for h in range(h0, h1):
                cov.add(x, h, ks, ke, w)
                if loc == NO_PARTIAL:
                    direct[(x, h)].append(w)
        if loc == NO_PARTIAL:
            continue
        if loc < 0 or loc + (qe - qs) > partial_rows:
            rep.add(f"{where} writes partial rows {_span(loc, loc + qe - qs)}, outside the "
                    f"{partial_rows}-row partial buffer")
        for h in range(h0, h1):
            for p in range(loc, loc + qe - qs):
                if (p, h) in written:
                    rep.add(f"partial row {p} head {h} is written by work {written[(p, h)]} "
                            f"and {where}")
                    break
                written[(p, h)] = w
            partial_heads[loc].setdefault(h, w)

    _coverage_problems(rep, cov, ((x, h) for x in range(n_rows) for h in range(heads)), need,
                       name, "pages")
    _check_ps_reduce(rep, work_rows, direct, partial_heads, reduce_indptr, reduce_final_map,
                     pmap, n_rows, heads, name, reduce_single_partials)
    return rep.result()


def _check_ps_reduce(rep: _Report, work_rows: list[list[int]],
                     direct: dict[tuple[int, int], list[int]],
                     partial_heads: dict[int, dict[int, int]], reduce_indptr: torch.Tensor,
                     reduce_final_map: torch.Tensor, pmap: list[int], n_rows: int, heads: int,
                     name: Any, single_ok: bool) -> None:
    """Every partial (loc, head) merged once into its own rows, all heads present; every
    (row, head) of the output written exactly once."""
    rptr = _ints(reduce_indptr)
    fmap = reduce_final_map.detach().cpu().reshape(-1, 2).tolist() if reduce_final_map.numel() \
        else []
    for t in range(len(rptr) - 1):
        if rptr[t + 1] < rptr[t]:
            rep.add(f"reduce_indptr decreases at tile {t}: {rptr[t]} -> {rptr[t + 1]}")
            return
    if rptr and rptr[-1] > len(pmap):
        rep.add(f"reduce_indptr ends at {rptr[-1]} partials but reduce_partial_map holds "
                f"{len(pmap)}")
        return
    need = 1 if single_ok else 2
    merged: dict[int, int] = {}
    writers: dict[tuple[int, int], int] = defaultdict(int)
    for key, ws in direct.items():
        writers[key] += len(ws)
    work_tile = {}  # loc -> (qs, qe)
    for loc, per_head in partial_heads.items():
        w = next(iter(per_head.values()))
        work_tile[loc] = (work_rows[w][QO_START], work_rows[w][QO_END])
    for t in range(len(rptr) - 1):
        lo, hi = rptr[t], rptr[t + 1]
        if hi == lo:
            continue
        if t >= len(fmap):
            rep.add(f"reduce tile {t} has partials but reduce_final_map has {len(fmap)} rows")
            continue
        qs, qe = int(fmap[t][0]), int(fmap[t][1])
        if not 0 <= qs < qe <= n_rows:
            rep.add(f"reduce tile {t} writes rows {_span(qs, qe)}, outside the {n_rows} rows")
            continue
        starts = pmap[lo:hi]
        if hi - lo < need:
            rep.add(f"reduce tile {t} lists a single partial (row {starts[0]}): mla_reduce_v1 "
                    f"at AITER main skips such tiles, so rows {_span(qs, qe)} are never written")
        else:
            for x in range(qs, qe):
                for h in range(heads):
                    writers[(x, h)] += 1
        seen: set[int] = set()
        for p in starts:
            if p in seen:
                rep.add(f"reduce tile {t} lists partial row {p} twice")
                continue
            seen.add(p)
            if p in merged:
                rep.add(f"partial row {p} is merged by reduce tiles {merged[p]} and {t}")
            merged[p] = t
            if p not in partial_heads:
                rep.add(f"reduce tile {t} merges partial row {p}, which no work writes")
                continue
            if work_tile[p] != (qs, qe):
                rep.add(f"reduce tile {t} merges partial row {p} (query rows "
                        f"{_span(*work_tile[p])}) into rows {_span(qs, qe)}")
            absent = [h for h in range(heads) if h not in partial_heads[p]]
            if absent:
                rep.add(f"reduce tile {t} merges partial row {p} for all heads but no work "
                        f"writes it for heads {_ranges(absent)}")
    for loc in partial_heads:
        if loc not in merged:
            qs, qe = work_tile[loc]
            rep.add(f"partial row {loc} (query rows {_span(qs, qe)}) is merged by no reduce "
                    "tile: that KV is lost")
    for x in range(n_rows):
        for h in range(heads):
            n = writers.get((x, h), 0)
            if n > 1:
                rep.row_problem(("output rows {rows} ({}) are written {} times", name(x, h), n), x)
