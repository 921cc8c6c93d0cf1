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


@dataclass(frozen=True)
class ShardFile:
    """What a results file says about the shard it holds (from its run headers)."""

    path: str
    shards: tuple[str, ...]  # "K/N" of each header that names one ("" for one that does not)
    run_keys: tuple[str, ...]


@dataclass
class Joined:
    """Which files are shards of one run, and what keeps them from being the whole run."""

    members: list[str]  # the files whose verdicts count
    problems: list[str]  # each one makes the merged run INCOMPLETE (exit 6)


def join(files: Sequence[ShardFile]) -> Joined:
    """The shards of one run among `files`: the run key most files name is the run (ties: the
    first file's); a file of another run, or of no split run, is foreign and left out; every
    K of 1..N must be there."""
    problems: list[str] = []
    keyed = [f for f in files if f.run_keys and all(f.run_keys) and len(set(f.run_keys)) == 1]
    votes: dict[str, int] = {}
    for f in keyed:
        votes[f.run_keys[0]] = votes.get(f.run_keys[0], 0) + 1
    run = max(votes, key=votes.__getitem__, default="")  # the first of equals: first seen
    members = [f for f in keyed if f.run_keys[0] == run]
    for f in files:
        if f in members:
            continue
        if not f.shards or not any(f.shards):
            problems.append(f"{f.path} is not a shard (no --shard run header): left out")
        else:
            problems.append(f"{f.path} is a shard of another run (run key "
                            f"{', '.join(sorted(set(f.run_keys)))}, not {run}): left out")
    counts = {parse(s).count for f in members for s in f.shards}
    if not members:
        problems.append("no shard of a split run among the files")
    elif len(counts) == 1:
        n = counts.pop()
        have = {parse(s).index for f in members for s in f.shards}
        missing = [k for k in range(1, n + 1) if k not in have]
        if missing:
            problems.append(f"INCOMPLETE: shard(s) {', '.join(f'{k}/{n}' for k in missing)} "
                            f"missing ({len(have)} of {n} merged)")
    else:  # cannot happen with one run key (N is part of it); said rather than assumed
        problems.append(f"shards of one run disagree on N: {sorted(counts)}")
    return Joined([f.path for f in members], problems)
