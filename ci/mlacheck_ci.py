"""Helpers for the CI scripts (ci/premerge.sh, ci/nightly.sh): what is awkward in shell.

    python3 ci/mlacheck_ci.py summary RESULTS [--md FILE] [--title T] [--note LINE ...]
            [--backend B ...] [--require-ops OPS] [--min-executed F] [--allow-xpass] [--shards]
        One screen of a results file: totals, counts per backend x op x status, the failures
        one line each (status, backend, op, case, reason and where), the biggest SKIP groups,
        and the gate's result. Exit: the gate's code (mlacheck.session.outcome, README "Exit
        codes": 0 pass, 1 FAIL/CRASH/XPASS, 3 suite error, 6 not enough ran), 2 no verdicts.
    python3 ci/mlacheck_ci.py plan LISTING --platform rocm|cuda|none --out FILE
            [--backends "A B"] [--optional "C D"]
        Which backends a CI job runs, from `mlacheck list --json` (LISTING; never its human
        text): BACKENDS as given, else the platform's defaults (PLATFORM_BACKENDS). Every one
        is required (`mlacheck run` ends with exit 6 and one line when a required backend is
        not usable) unless named optional: OPTIONAL_BACKENDS, else the platform's default
        optional ones; an optional backend runs when usable, else the summary says so at its
        top. FILE gets TAB-separated lines: `run NAME`, `note TEXT`, `unusable NAME WHY`.
        Exit 0, or 2 (one line) for a listing that is not mlacheck's or a bad knob.
    python3 ci/mlacheck_ci.py candidates --platform rocm|cuda|none [--backends "A B"]
        The names `plan` would choose from, space-separated (what `mlacheck list --json -b`
        is asked about).
    python3 ci/mlacheck_ci.py wait-server URL MODEL [--timeout S] [--interval S] [--pid PID]
        Until the OpenAI-compatible server at URL answers a 1-token completion for MODEL
        (mlacheck's own gate preflight). --timeout 0: ask once. --pid: give up as soon as
        that process (the server we started) has exited. Exit 0 answered, 2 not (one line).
    python3 ci/mlacheck_ci.py baseline PATH
        Check that PATH is a readable GSM8K gate record (exit 0) or say why not (exit 2).
    python3 ci/mlacheck_ci.py combine --out FILE --title T [--step NAME=TEXT ...]
            [--section TITLE=FILE ...]
        One markdown file: a steps table, then each section (a .md file as is, anything else
        in a text block; a missing file is said to be missing).

Errors are one line on stderr (prefix "mlacheck-ci: error:"), never a traceback. Only the
standard library and mlacheck are used; mlacheck is imported lazily.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

EXIT_OK, EXIT_ERROR = 0, 2
MAX_FAILURE_LINES = 20  # one screen: the rest are in report.md / report.html
MAX_SKIP_LINES = 6
REASON_WIDTH = 220


def _error(msg: str) -> int:
    print(f"mlacheck-ci: error: {' '.join(msg.split())}", file=sys.stderr)
    return EXIT_ERROR


# --------------------------------------------------------------------------- summary


def one_line(v: object) -> str:
    """A FAIL/CRASH verdict in one line: status, backend, op, case, reason, first location."""
    from mlacheck.ops import unit_of

    unit = unit_of(v.op)  # type: ignore[attr-defined]
    text = f"{v.status} {v.backend} {v.op} {v.case_id}"  # type: ignore[attr-defined]
    reason = " ".join(str(v.reason or "").split())  # type: ignore[attr-defined]
    if reason:
        text += f": {reason}"
    where = getattr(v, "where", None) or []
    if where:
        # a location we cannot render must not hide the failure
        with contextlib.suppress(Exception):
            text += f"; at {where[0].message(unit)}"
    return text if len(text) <= REASON_WIDTH else text[: REASON_WIDTH - 3] + "..."


def render_summary(
    verdicts: list, unparsable: int, title: str, notes: Sequence[str], outcome: object = None,
    expected: int = 0, missing: int | None = None,
) -> tuple[str, str, int]:
    """(screen text, markdown, exit code) for a list of verdicts and the gate's outcome
    (mlacheck.session.outcome; without one, the gate's decision over the verdicts alone)."""
    from mlacheck.report.summary import summarise
    from mlacheck.session import RunRequest
    from mlacheck.session import outcome as gate_outcome
    from mlacheck.verdict import CRASH, FAIL

    if outcome is None:
        outcome = gate_outcome(verdicts, RunRequest())
    s = summarise(verdicts, unparsable, expected=expected, missing=missing)
    statuses = s.statuses
    rows = [(b, op, [c.get(st, 0) for st in statuses]) for (b, op), c in s.counts.items()]
    wb = max([len("backend")] + [len(b) for b, _, _ in rows])
    wo = max([len("op")] + [len(op) for _, op, _ in rows])
    wc = [max(len(st), 5) for st in statuses]
    code = outcome.code  # type: ignore[attr-defined]
    verdict = outcome.word  # type: ignore[attr-defined]
    why = list(outcome.lines)  # type: ignore[attr-defined]

    screen = [f"== {title} ==", s.total_line()]
    screen += [f"note: {n}" for n in notes]
    screen.append(
        "  ".join(
            [f"{'backend':<{wb}}", f"{'op':<{wo}}"]
            + [f"{st:>{w}}" for st, w in zip(statuses, wc, strict=True)]
        )
    )
    for b, op, counts in rows:
        screen.append(
            "  ".join(
                [f"{b:<{wb}}", f"{op:<{wo}}"]
                + [f"{n:>{w}}" for n, w in zip(counts, wc, strict=True)]
            )
        )
    failures = [one_line(f.verdict) for f in s.failures]
    if failures:
        screen.append(f"failures ({len(failures)}):")
        screen += [f"  {line}" for line in failures[:MAX_FAILURE_LINES]]
        if len(failures) > MAX_FAILURE_LINES:
            screen.append(
                f"  ... {len(failures) - MAX_FAILURE_LINES} more in report.md / report.html"
            )
    if s.known:
        screen.append(f"known failures (KNOWN, not gating): {len(s.known)}")
    if s.skips:
        screen.append(
            f"skipped: {s.by_status.get('SKIP', 0)} case(s) in {len(s.skips)} reason group(s)"
            " (coverage holes):"
        )
        screen += [f"  {g.line()}" for g in s.skips[:MAX_SKIP_LINES]]
        if len(s.skips) > MAX_SKIP_LINES:
            screen.append(f"  ... {len(s.skips) - MAX_SKIP_LINES} more groups in report.md")
    screen += [f"gate: {line}" for line in why]
    screen.append(
        f"result: {verdict} ({s.by_status.get(FAIL, 0)} FAIL, {s.by_status.get(CRASH, 0)} CRASH;"
        f" exit {code})"
    )

    md = [f"### {title}", "", f"**{verdict}** — {s.total_line()}", ""]
    md += [f"> note: {n}" for n in notes] + ([""] if notes else [])
    md += [f"> gate: {_md_escape(line)}" for line in why] + ([""] if why else [])
    md.append("| backend | op | " + " | ".join(statuses) + " |")
    md.append("|---|---|" + "---:|" * len(statuses))
    md += [f"| {b} | {op} | " + " | ".join(str(n) for n in counts) + " |" for b, op, counts in rows]
    md.append("")
    if failures:
        md += [f"**Failures ({len(failures)})**", ""]
        md += [f"- `{_md_escape(line)}`" for line in failures[:MAX_FAILURE_LINES]]
        if len(failures) > MAX_FAILURE_LINES:
            md.append(f"- ... {len(failures) - MAX_FAILURE_LINES} more in report.md / report.html")
        md.append("")
    if s.skips:
        md += [f"**Skipped ({s.by_status.get('SKIP', 0)}: coverage holes)**", ""]
        md += [f"- {_md_escape(g.line())}" for g in s.skips[:MAX_SKIP_LINES]]
        md.append("")
    return "\n".join(screen) + "\n", "\n".join(md) + "\n", code


def run_notes(path: Path) -> list[str]:
    """Where the run(s) of a results file ran, from their headers (machine output)."""
    from mlacheck.results import read_raw

    out = []
    for h in read_raw(path).headers:
        workers = f", {h.workers} worker(s)" if h.workers else ""
        out.append(f"ran on {h.device or 'an unrecorded device'}{workers}: "
                   f"{len(h.expected)} item(s) of matrix {h.matrix or '?'}")
    return list(dict.fromkeys(out))


def _md_escape(text: str) -> str:
    return text.replace("`", "'").replace("|", "\\|")


def cmd_summary(args: argparse.Namespace) -> int:
    from mlacheck.backends.registry import resolve
    from mlacheck.report.load import read_results
    from mlacheck.session import RunRequest, outcome

    path = Path(args.results)
    if not path.is_file():
        return _error(f"no results file {path} (the run recorded nothing)")
    loaded = read_results(path)
    if not loaded.verdicts:
        return _error(f"no verdicts in {path} (the run recorded nothing)")
    request = RunRequest.parse(backends=args.backend, require_ops=args.require_ops,
                               min_executed=args.min_executed, allow_xpass=args.allow_xpass,
                               ).resolved(lambda b: resolve(b).name)
    incomplete: list[str] = []
    if args.shards:  # a merged file: every shard of its run must be in it
        from mlacheck import merge, shard

        incomplete = shard.join([merge.shard_file(path)]).problems
        if not request.backends:
            request = request.named(merge.header_backends(path))
    notes = [*(args.note or []), *run_notes(path)]
    screen, md, code = render_summary(loaded.verdicts, loaded.skipped, args.title, notes,
                                      outcome(path, request, incomplete=incomplete),
                                      loaded.expected, loaded.missing)
    sys.stdout.write(screen)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(md, encoding="utf-8")
    return code


# --------------------------------------------------------------------------- plan

# Per platform (the torch build): the backends a GPU job runs when BACKENDS is not set, and
# which of them are optional by default (run when usable, else named at the top of the
# summary). On ROCm AITER's kernels are what the job exists for: all required. On CUDA the
# documented install is AITER's Triton kernels (docs/aiter-triton.md); FlashInfer and FlashMLA
# run when installed. torch, the reference implementation, runs everywhere, but never alone:
# a GPU gate green on the reference alone tests no kernel (issue 27).
PLATFORM_BACKENDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rocm": (("aiter", "aiter-nonpersistent", "aiter-triton", "torch"), ()),
    "cuda": (("aiter-triton", "flashinfer", "flashinfer-fa3", "flashmla", "torch"),
             ("flashinfer", "flashinfer-fa3", "flashmla")),
}


def _names(text: str | None) -> list[str]:
    return list(dict.fromkeys((text or "").replace(",", " ").split()))


def candidates(platform: str, backends: str | None) -> list[str]:
    """The backends a job would run: BACKENDS as given, else the platform's (CPU: none, i.e.
    mlacheck's embedded default)."""
    return _names(backends) or list(PLATFORM_BACKENDS.get(platform, ((), ()))[0])


def plan_backends(listing: dict, platform: str, backends: str | None,
                  optional: str | None) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(backends to run, notes for the top of the summary, required ones not usable with
    why). An empty run list means mlacheck's embedded default (a CPU job without BACKENDS)."""
    from mlacheck.inventory import SCHEMA_KEY

    if not isinstance(listing, dict) or SCHEMA_KEY not in listing:
        raise ValueError("the backend listing is not `mlacheck list --json` output")
    status = {b["name"]: b for b in listing.get("backends", [])}
    default_optional = PLATFORM_BACKENDS.get(platform, ((), ()))[1]
    chosen = candidates(platform, backends)
    if not chosen:
        return [], [], []
    opt = _names(optional) if _names(optional) else ([] if _names(backends) else
                                                      list(default_optional))
    stray = [o for o in opt if o not in chosen]
    if stray:
        raise ValueError(f"OPTIONAL_BACKENDS names {', '.join(stray)}, which this job does "
                         f"not run (its backends: {' '.join(chosen)})")
    run, unusable = [], []
    notes = [f"required backends: {' '.join(n for n in chosen if n not in opt)}"]
    for name in chosen:
        st = status.get(name)  # None: an import path, `mlacheck run` resolves it
        usable = st is None or bool(st.get("usable"))
        why = "" if st is None else str(st.get("reason") or "")
        if name in opt:
            if usable:
                run.append(name)
            notes.append(f"optional backend {name} (OPTIONAL_BACKENDS): "
                         + ("ran" if usable else f"not run: {why}"))
            continue
        run.append(name)
        if not usable:
            unusable.append((name, why))
    return run, notes, unusable


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    try:
        listing = json.loads(Path(args.listing).read_text(encoding="utf-8"))
        run, notes, unusable = plan_backends(listing, args.platform, args.backends,
                                             args.optional)
    except (OSError, ValueError) as e:
        return _error(f"cannot choose the backends: {e}")
    lines = [f"run\t{n}" for n in run] + [f"note\t{_one(n)}" for n in notes]
    lines += [f"unusable\t{n}\t{_one(why)}" for n, why in unusable]
    Path(args.out).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return EXIT_OK


def cmd_candidates(args: argparse.Namespace) -> int:
    print(" ".join(candidates(args.platform, args.backends)))
    return EXIT_OK


def _one(text: str) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------- server


def cmd_wait_server(args: argparse.Namespace) -> int:
    from mlacheck.gate.errors import GateError
    from mlacheck.gate.lmeval_runner import normalize_completions_url, preflight
    from mlacheck.processes import process_alive

    try:
        url = normalize_completions_url(args.url)
    except GateError as e:
        return _error(str(e))
    deadline = time.monotonic() + max(0.0, args.timeout)
    last = ""
    while True:
        if args.pid and not process_alive(args.pid):
            return _error(
                f"the server process ({args.pid}) exited before answering at {url}"
                + (f"; see {args.log}" if args.log else "")
            )
        try:
            preflight(url, args.model, timeout_s=min(30.0, max(5.0, args.interval * 4)))
            return EXIT_OK
        except GateError as e:
            last = str(e)
        if time.monotonic() >= deadline:
            break
        time.sleep(min(args.interval, max(0.1, deadline - time.monotonic())))
    waited = f" (waited {args.timeout:g} s)" if args.timeout > 0 else ""
    return _error(f"{last}{waited}")


def cmd_baseline(args: argparse.Namespace) -> int:
    from mlacheck.gate.errors import GateError
    from mlacheck.gate.record import GateRecord

    path = Path(args.path)
    if not path.is_file():
        return _error(
            f"baseline {path} does not exist (promote a run with "
            "`mlacheck gate gsm8k promote`, see docs/ci.md)"
        )
    try:
        rec = GateRecord.load(path)
    except GateError as e:
        return _error(f"baseline {path} is not a usable gate record: {e}")
    if not rec.complete:
        return _error(f"baseline {path} is not a complete run (status {rec.status})")
    return EXIT_OK


# --------------------------------------------------------------------------- combine


def _pairs(items: Sequence[str], what: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} expects NAME=VALUE, got {item!r}")
        out.append((key, value))
    return out


_HEADING = re.compile(r"^(#{1,6})(\s)", re.MULTILINE)
_IMAGE = re.compile(r"(!\[[^\]]*\]\()([^)\s]+)(\))")


def _embed_markdown(text: str, src_dir: Path, out_dir: Path) -> str:
    """A markdown file as a section: its headings start at level 3 (under the section's H2)
    and its relative image links still point at the images."""
    levels = [len(m.group(1)) for m in _HEADING.finditer(text)]
    shift = 3 - min(levels) if levels else 0

    def heading(m: re.Match[str]) -> str:
        return "#" * min(6, max(1, len(m.group(1)) + shift)) + m.group(2)

    def image(m: re.Match[str]) -> str:
        target = m.group(2)
        if "://" in target or target.startswith(("/", "#", "data:")):
            return m.group(0)
        rel = os.path.relpath(src_dir.resolve() / target, out_dir.resolve())
        return f"{m.group(1)}{rel}{m.group(3)}"

    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        lines.append(line if fenced else _IMAGE.sub(image, _HEADING.sub(heading, line)))
    return "\n".join(lines)


def cmd_combine(args: argparse.Namespace) -> int:
    try:
        steps = _pairs(args.step or [], "--step")
        sections = _pairs(args.section or [], "--section")
    except ValueError as e:
        return _error(str(e))
    out = [f"# {args.title}", ""]
    if steps:
        out += ["| step | result |", "|---|---|"]
        out += [f"| {name} | {_md_escape(text)} |" for name, text in steps] + [""]
    for title, file in sections:
        out += [f"## {title}", ""]
        path = Path(file)
        if not file or not path.is_file():
            out += [f"_(no output: {file or 'step skipped'})_", ""]
            continue
        text = path.read_text(encoding="utf-8", errors="replace").rstrip()
        if path.suffix == ".md":
            out += [_embed_markdown(text, path.parent, Path(args.out).parent), ""]
        else:
            out += ["```text", text.replace("```", "'''"), "```", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(out), encoding="utf-8")
    return EXIT_OK


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlacheck_ci.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary")
    s.add_argument("results")
    s.add_argument("--md", default=None)
    s.add_argument("--title", default="mlacheck")
    s.add_argument("--note", action="append")
    s.add_argument("--backend", action="append", help="the backends the run was asked for")
    s.add_argument("--require-ops", default="")
    s.add_argument("--min-executed", type=float, default=0.0)
    s.add_argument("--allow-xpass", action="store_true")
    s.add_argument("--shards", action="store_true",
                   help="RESULTS is merged shards (mlacheck merge): a missing one is INCOMPLETE")
    pl = sub.add_parser("plan")
    pl.add_argument("listing")
    pl.add_argument("--platform", required=True, choices=("rocm", "cuda", "none"))
    pl.add_argument("--out", required=True)
    pl.add_argument("--backends", default="")
    pl.add_argument("--optional", default="")
    ca = sub.add_parser("candidates")
    ca.add_argument("--platform", required=True, choices=("rocm", "cuda", "none"))
    ca.add_argument("--backends", default="")
    w = sub.add_parser("wait-server")
    w.add_argument("url")
    w.add_argument("model")
    w.add_argument("--timeout", type=float, default=0.0)
    w.add_argument("--interval", type=float, default=5.0)
    w.add_argument("--pid", type=int, default=0)
    w.add_argument("--log", default="")
    b = sub.add_parser("baseline")
    b.add_argument("path")
    c = sub.add_parser("combine")
    c.add_argument("--out", required=True)
    c.add_argument("--title", default="mlacheck")
    c.add_argument("--step", action="append")
    c.add_argument("--section", action="append")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "summary": cmd_summary,
        "plan": cmd_plan,
        "candidates": cmd_candidates,
        "wait-server": cmd_wait_server,
        "baseline": cmd_baseline,
        "combine": cmd_combine,
    }
    try:
        return handlers[args.cmd](args)
    except KeyboardInterrupt:
        return _error("interrupted")
    except Exception as e:  # noqa: BLE001 - CI output: one line, never a traceback
        return _error(f"{args.cmd}: {type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
