"""Index layouts of the DeepSeek-V3.2 sparse pipeline, and the conversions between them.

The indexer's top-k names, per query token, positions in that token's own request
(`local`, 0 .. kv_len-1, -1 = none). Sparse attention kernels read GLOBAL slots of the
paged pool, `page * page_size + offset` (FlashMLA, AITER; `local` goes through the
request's block table). Two buffer layouts carry them:

- row-major [T, topk]: token t's entries at t * topk + i, -1 padded;
- ragged: token t's valid entries at indptr[t] .. indptr[t+1] of one flat buffer
  (vLLM's ROCm sparse backend builds it with `fetch_id_to_ragged`), no padding.

They agree only when every token has exactly topk valid entries (bug class 2: a buffer
written ragged and read row-major). These functions are the definitions the golden and the
adapters share; pure, on whatever device the inputs live (CPU for the golden).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_requests(qo_indptr: torch.Tensor) -> torch.Tensor:
    """[T] request id of every query token, from qo_indptr [B+1] (empty requests own none)."""
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens)


def to_global_slots(local: torch.Tensor, token_request: torch.Tensor, block_table: torch.Tensor,
                    page_size: int, kv_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Request-local positions [T, K] -> global slots [T, K] (int64), -1 kept.

    block_table [B, W]: vLLM's per-request physical page ids. A position that is negative,
    past its request's kv_len (when `kv_lens` is given) or past the block table's width is
    not a slot of the request: -1 (never a clamped, plausible-looking slot).
    """
    idx = local.long()
    req = token_request.long().to(idx.device)
    table = block_table.long().to(idx.device)
    valid = idx >= 0
    if kv_lens is not None:
        valid &= idx < kv_lens.long().to(idx.device)[req][:, None]
    page = torch.where(valid, idx // page_size, torch.zeros_like(idx))
    valid &= page < table.shape[1]
    page = torch.where(valid, page, torch.zeros_like(page))
    slots = table[req[:, None], page] * page_size + idx.remainder(page_size)
    return torch.where(valid, slots, torch.full_like(slots, -1))


@dataclass(frozen=True)
class Ragged:
    """A ragged index buffer: token t's entries are flat[indptr[t]:indptr[t+1]]."""

    flat: torch.Tensor  # [N]
    indptr: torch.Tensor  # [T+1], indptr[0] == 0

    @property
    def tokens(self) -> int:
        return self.indptr.numel() - 1

    def row(self, t: int) -> torch.Tensor:
        return self.flat[int(self.indptr[t]):int(self.indptr[t + 1])]


def to_ragged(rows: torch.Tensor) -> Ragged:
    """Row-major [T, K] (-1 padded) -> ragged: each row's valid (>= 0) entries in row order."""
    valid = rows >= 0
    counts = valid.sum(dim=1)
    indptr = torch.zeros(rows.shape[0] + 1, dtype=torch.int64, device=rows.device)
    indptr[1:] = torch.cumsum(counts, 0)
    return Ragged(rows[valid], indptr)


def from_ragged(ragged: Ragged, topk: int) -> torch.Tensor:
    """Ragged -> row-major [T, topk], -1 padded (each row's entries first, in order)."""
    counts = ragged.indptr[1:] - ragged.indptr[:-1]
    if ragged.tokens and int(counts.max()) > topk:
        raise ValueError(f"a token has {int(counts.max())} entries, more than topk {topk}")
    rows = torch.full((ragged.tokens, topk), -1, dtype=ragged.flat.dtype,
                      device=ragged.flat.device)
    col = torch.arange(topk, device=rows.device)[None, :]
    fill = col < counts[:, None]
    rows[fill] = ragged.flat
    return rows


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] bool: row t of a and of b (row-major, -1 padded) hold the same valid entries
    with the same multiplicities (order free: attention does not depend on it)."""
    big = torch.iinfo(torch.int64).max
    sa = torch.where(a >= 0, a.long(), torch.full_like(a, big, dtype=torch.int64)).sort(1).values
    sb = torch.where(b >= 0, b.long(), torch.full_like(b, big, dtype=torch.int64)).sort(1).values
    width = max(sa.shape[1], sb.shape[1])
    sa = torch.nn.functional.pad(sa, (0, width - sa.shape[1]), value=big)
    sb = torch.nn.functional.pad(sb, (0, width - sb.shape[1]), value=big)
    return (sa == sb).all(dim=1)
