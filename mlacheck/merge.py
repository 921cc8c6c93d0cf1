"""`mlacheck merge SHARD.jsonl ... [--results OUT]`: the shards of a split run as one run.

Each of N CI runners ran `mlacheck run --shard K/N` (docs/ci.md, "Many GPUs and many
runners"). Merging writes one results file holding every shard's lines (their headers too, so
the file says which shards it was made of), its report, and exits as a single run over the
union would (README "Exit codes"): a FAIL in any shard is 1, a KNOWN failure alone 0. A shard
that is missing, a file that is not a shard, or a shard of another run (mlacheck.shard.join)
makes the run INCOMPLETE: exit 6 with a line naming it, unless a failure on record wins (1).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlacheck import results as results_file
from mlacheck import shard
from mlacheck.errors import OneLineParser, UsageError
from mlacheck.outcome import EXIT_USAGE, coverage_lines, exit_meaning

DEFAULT_RESULTS = "mlacheck-merged/results.jsonl"


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="mlacheck merge", description=__doc__.splitlines()[0])
    p.add_argument("shards", nargs="+", metavar="RESULTS",
                   help="the results files of the shards (mlacheck run --shard K/N)")
    p.add_argument("--results", default=DEFAULT_RESULTS,
                   help=f"the merged results file (default {DEFAULT_RESULTS}); the report goes "
                        "next to it")
    p.add_argument("--no-report", dest="report", action="store_false",
                   help="write no report.md / report.html")
    p.add_argument("--require-ops", default="",
                   help="as `mlacheck run`: ops every backend must execute a case of")
    p.add_argument("--min-executed", type=float, default=0.0,
                   help="as `mlacheck run`: least executed fraction per backend x op")
    p.add_argument("--allow-xpass", action="store_true",
                   help="as `mlacheck run`: a known failure that passes does not fail the run")
    return p


def shard_file(path: Path) -> shard.ShardFile:
    """What a file's run headers say about its shard (nothing for a file of no split run)."""
    headers = results_file.read_raw(path).headers
    return shard.ShardFile(str(path), tuple(h.shard for h in headers),
                           tuple(h.run_key for h in headers))


def header_backends(path: Path) -> list[str]:
    """The backends the file's run headers name, in order: what the merged run was asked for."""
    headers = results_file.read_raw(path).headers
    return list(dict.fromkeys(b for h in headers for b in h.backends))


def write_merged(members: list[Path], out: Path) -> int:
    """The members' header and verdict lines, one file after another; returns how many torn or
    unparsable lines were left out."""
    dropped = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as merged:
        for path in members:
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except ValueError:
                    dropped += 1
                    continue
                if not results_file.is_header(doc) and not (isinstance(doc, dict)
                                                            and doc.get("case_id")):
                    dropped += 1
                    continue
                merged.write(line.rstrip("\n") + "\n")
    return dropped


def main(argv: list[str] | None = None) -> int:
    from mlacheck.session import RunRequest, outcome

    try:
        args = build_parser().parse_args(argv)
        request = RunRequest.parse(require_ops=args.require_ops, min_executed=args.min_executed,
                                   allow_xpass=args.allow_xpass)
        out = Path(args.results)
        inputs = [Path(s) for s in args.shards]
        if any(p.resolve() == out.resolve() for p in inputs):
            raise UsageError(f"--results {out} is one of the shards: merge into another file")
    except UsageError as e:
        print(f"mlacheck: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    problems = [f"{p}: no such results file (a shard that never wrote one)"
                for p in inputs if not p.is_file()]
    files = [shard_file(p) for p in inputs if p.is_file()]
    joined = shard.join(files)
    problems += joined.problems
    members = [Path(m) for m in joined.members]
    dropped = write_merged(members, out)
    if dropped:
        problems.append(f"{dropped} unreadable line(s) in the shards left out")
    gate = outcome(out, request.named(header_backends(out)), incomplete=problems)
    keys = sorted({k for f in files if f.path in joined.members for k in f.run_keys})
    print(f"mlacheck merge: {len(members)} of {len(inputs)} file(s) merged (run "
          f"{', '.join(keys) or '-'}): {gate.recorded} of {gate.expected} item(s) with a "
          f"verdict -> {out}")
    for line in coverage_lines(gate.coverage):
        print(line)
    print(f"mlacheck gate: exit {gate.code} ({exit_meaning(gate.code)})")
    for line in gate.lines:
        print(f"  {line}")
    if args.report and results_file.read_raw(out).records:
        from mlacheck.report import main as report_main

        report_main([str(out), "-o", str(out.parent)])
    return gate.code


if __name__ == "__main__":
    sys.exit(main())
