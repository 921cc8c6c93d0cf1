"""One run split across N CI runners: `mlacheck run --shard K/N`, then `mlacheck merge`.

Every runner computes the same partition from the same selection (the matrix's items after
-k / -m, before --resume leaves any out), so no coordination is needed: a case with all its
backends is one unit (its inputs and references serve them all), units are taken longest
first by estimated cost (mlacheck.cost), ties by case id, and each goes to the shard with the
least cost so far (LPT). Deterministic, every item in exactly one shard, and balanced: no
shard exceeds the others by more than its largest unit.

A shard's run header names its shard and the run it belongs to (`run_key`: matrix, seed,
backends, -k / -m, N), so `mlacheck merge` can tell a missing or foreign shard.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


class ShardError(ValueError):
    """A --shard value that is not K/N with 1 <= K <= N."""


@dataclass(frozen=True)
class Shard:
    index: int  # K, 1-based
    count: int  # N

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse(text: str) -> Shard:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m:
        raise ShardError(f"--shard {text!r}: expected K/N, e.g. 2/4 (the 2nd of 4 shards)")
    k, n = int(m.group(1)), int(m.group(2))
    if not 1 <= k <= n:
        raise ShardError(f"--shard {text}: K must be in 1..N")
    return Shard(k, n)


def partition(costs: Mapping[str, float], count: int) -> list[list[str]]:
    """Units (id -> estimated cost) into `count` shards, longest first to the least loaded
    shard (ties: the lower shard). Each shard lists its units in the order they were taken."""
    shards: list[list[str]] = [[] for _ in range(count)]
    load = [0.0] * count
    for unit in sorted(costs, key=lambda u: (-costs[u], u)):
        k = min(range(count), key=lambda i: (load[i], i))
        shards[k].append(unit)
        load[k] += costs[unit]
    return shards


def units_of(shard: Shard, costs: Mapping[str, float]) -> set[str]:
    return set(partition(costs, shard.count)[shard.index - 1])


def run_key(matrix: str, seed: int | None, backends: Sequence[str], keyword: str,
            markexpr: str, count: int, case_ids: Iterable[str]) -> str:
    """What makes two shards parts of one run: the same matrix (its case ids), seed,
    backends, -k / -m and shard count. A short hash, recorded in each shard's header."""
    doc = json.dumps({"matrix": matrix, "seed": seed, "backends": list(backends),
                      "k": keyword or "", "m": markexpr or "", "n": count,
                      "cases": sorted(case_ids)}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]
