"""`mlacheck`: run / list / replay / report / gate / selftest.

`run` is a thin layer over pytest.main with the mlacheck plugin (never a second runner).
Bad input (unknown backend, malformed matrix, impossible case) is one line on stderr and
exit code 2, never a traceback. The options become one mlacheck.session.RunRequest and the
exit code is mlacheck.session.outcome's, here as under plain pytest.
"""

from __future__ import annotations

import signal
import sys
from os.path import basename
from types import FrameType


def _hold(signum: int, frame: FrameType | None) -> None:
    """SIGTERM / SIGINT while the command line is read, before main() knows the command: noted
    and acted on then (`run`: an interrupted run, exit 6; other commands: as by default).
    Without it `timeout -s TERM` in the interpreter's first moments gave 143, no gate line."""
    _HELD.append(signum)


_HELD: list[int] = []
_EARLY_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# This process is the command (the console script, `python -m mlacheck.cli`), not a library
# call from someone else's process (a test calling main()): only then is it ours to end.
_ENTRY_POINT = __name__ == "__main__" or basename(sys.argv[0]) == "mlacheck"
if _ENTRY_POINT:  # the entry points: held
    for _signum in _EARLY_SIGNALS:  # from here, not only from main() (imports: 0.03-0.17 s)
        signal.signal(_signum, _hold)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from mlacheck.errors import OneLineParser, UsageError  # noqa: E402
from mlacheck.outcome import (  # noqa: E402
    EXIT_KERNEL_FAILURE,
    EXIT_OK,
    EXIT_PYTEST_USAGE,
    EXIT_SUITE_ERROR,
    EXIT_USAGE,
    exit_meaning,
)

DEFAULT_RESULTS = "mlacheck-out/results.jsonl"
PYTEST_INTERRUPTED = 2  # pytest.ExitCode.INTERRUPTED (pytest is imported only to run)


class _SessionEnd:
    """A pytest plugin that notes whether the session reached its end, where the mlacheck
    plugin sets the gate's code, and the session's config (the gate's lines)."""

    reached = False
    config = None

    def pytest_sessionfinish(self, session) -> None:  # noqa: ANN001 - pytest.Session
        self.reached, self.config = True, session.config


_DEFAULTS = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}


def _hold_signals() -> dict[int, Any]:
    return {s: signal.signal(s, _hold) for s in _EARLY_SIGNALS}


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a CI time limit, `timeout`) ends the run as Ctrl-C does: pytest stops, the
    gate says INCOMPLETE (exit 6) and the report is written, instead of a silent 143."""
    global _FIRST_TERM
    _RECEIVED.append(signal.Signals(signum).name)
    if signum == signal.SIGTERM:
        _FIRST_TERM = time.monotonic()
        signal.signal(signum, _again)
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


# The signals _interrupt received in this run. Its KeyboardInterrupt can be swallowed: torch's
# import clears any error raised while it imports NumPy (a SIGTERM 1 s into a run was lost
# there and the run went on to exit 0); _stop_if_signalled ends such a run at the next step.
_RECEIVED: list[str] = []


def _stop_if_signalled() -> None:
    if _RECEIVED:
        raise KeyboardInterrupt(f"signal {_RECEIVED[0]}")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM / SIGINT held, and acted on when the block ends: a KeyboardInterrupt raised
    inside torch's import can end in abort() (exit 134, a traceback through
    torch/functional.py: `timeout -s TERM 1` on the tiny matrix, 2026-11-27)."""
    previous = _hold_signals()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if _HELD:
        first = _HELD[0]
        _HELD.clear()
        _interrupt(first, None)


# `timeout -s TERM` sends its signal twice, to the run and to its process group: the second,
# moments after the first, killed the run (143, no gate line; 1 of 10 runs of a T sweep). A
# second one within this many seconds is that duplicate; a later one kills.
DUPLICATE_TERM_S = 5.0
_FIRST_TERM = 0.0


def _again(signum: int, frame: FrameType | None) -> None:
    if time.monotonic() - _FIRST_TERM < DUPLICATE_TERM_S:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _die(msg: str) -> int:
    print(f"mlacheck: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _plugin_args() -> list[str]:
    """Load the plugin explicitly when it is not installed as a pytest11 entry point
    (e.g. mlacheck used from a source tree on PYTHONPATH)."""
    from importlib.metadata import entry_points

    installed = any(ep.name == "mlacheck" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "mlacheck.pytest_plugin"]


def _suite_path() -> str:
    from mlacheck.suite import test_mla

    return str(Path(test_mla.__file__))


# --------------------------------------------------------------------------- run


def _run_guarded(argv: list[str]) -> int:
    """`mlacheck run` with SIGTERM handled as Ctrl-C from its first line to its report: under
    `timeout -s TERM` 3 of 8 runs exited 143, with no gate line, when the signal came before
    pytest started (imports, checks: ~2 s) or after it returned (the handler was installed
    around pytest.main only). One that came while the command line was read (_hold) counts
    from here."""
    _RECEIVED.clear()
    _RECEIVED.extend(signal.Signals(s).name for s in _HELD)
    _HELD.clear()
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    stage: dict[str, Any] = {}
    try:
        try:
            _stop_if_signalled()
            return _main(argv, stage)
        except KeyboardInterrupt:  # before pytest ran, or while the report was written
            return _interrupted(stage)
        except Exception:  # noqa: BLE001 - mlacheck's bug or a plugin's, never a kernel's
            # e.g. another plugin's session-end hook that raised before mlacheck's set the
            # gate's code: the exception left pytest and Python's exit 1 read as a kernel
            # failure with none on record (a tracing plugin, 4x H200, 2026-11-27)
            traceback.print_exc()
            print()  # pytest's progress line may be unfinished: the gate line starts a line
            return _interrupted(stage, internal=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupted(stage: dict[str, Any], internal: bool = False) -> int:
    """The gate of a run a signal ended outside pytest's session (which has its own): from
    what is on record (a failure wins, as in session.outcome), else INCOMPLETE, exit 6. A run
    that recorded nothing yet gets a run header saying what it meant to run, so its results
    file and report say that nothing ran instead of there being none. `internal`: an
    exception ended it instead (INTERNAL ERROR, exit 7)."""
    from mlacheck.outcome import gate_lines
    from mlacheck.session import RunRequest, outcome

    results = stage.get("results")
    results = results if isinstance(results, Path) else None
    if results is not None and not stage.get("reporting"):
        try:
            _record_the_run_meant(stage, results)
        except (OSError, ValueError) as e:  # the gate line still comes
            print(f"mlacheck: warning: no run header written to {results}: {e}", file=sys.stderr)
    request = stage.get("request")
    request = request if isinstance(request, RunRequest) else RunRequest()
    on_record = results if results is not None and results.exists() else []
    out = outcome(on_record, request, interrupted=not internal, internal_error=internal,
                  selection=str(stage.get("selection", "")))
    decided = stage.get("code")  # the session's gate, when the signal came during the report
    if decided in (EXIT_KERNEL_FAILURE, EXIT_SUITE_ERROR):  # a failure on record wins
        out.code = decided
    for line in gate_lines(out):
        print(line)
    sys.stdout.flush()
    if stage.get("report") and not stage.get("reporting") and results is not None \
            and results.exists():
        from mlacheck.report import main as report_main

        report_main([str(results), "-o", str(results.parent)])
    return out.code


def _record_the_run_meant(stage: dict[str, Any], results: Path) -> None:
    """The run header pytest would have written, when this invocation wrote none yet: the
    items the -k / -m selection surely keeps (under the backend names when resolved, else
    as requested: a schema-1 header, which readers map by the verdicts' backend_spec)."""
    import dataclasses

    from mlacheck import results as results_file

    if stage.get("fresh") and not stage.get("cleared"):  # what the run would have done next
        results.unlink(missing_ok=True)
    now = len(results_file.read_raw(results).headers) if results.exists() else 0
    if now > stage.get("headers_before", 0):
        return  # pytest wrote this run's header
    request, matrix = stage["request"], stage.get("matrix")
    names = dict(zip(request.backends, request.names, strict=False))
    kept = () if stage.get("shard") else stage.get("kept", ())
    header = results_file.new_header(
        [(names.get(c.backend, c.backend), c.case_id) for c in kept], list(request.backends),
        matrix.name if matrix is not None else str(request.matrix),
        str(stage.get("device", request.device)))
    if not request.names:
        header = dataclasses.replace(header, schema=1)
    results_file.append_line(results, header.to_line())


def cmd_run(args: argparse.Namespace, extra: list[str], stage: dict[str, Any] | None = None
            ) -> int:
    """`stage`: how far the run got, for _run_guarded when a signal ends it early."""
    stage = {} if stage is None else stage
    stage["report"] = args.report
    if args.device != "cpu":  # a GPU run (or maybe one): the host's driver woken up first
        from mlacheck import cuda_context

        cuda_context.init_driver()
    from mlacheck import results as results_file
    from mlacheck.backends.registry import builtin_name
    from mlacheck.matrices import load
    from mlacheck.preflight import (
        check_expression,
        check_markers,
        check_output_file,
        resolve_device,
    )
    from mlacheck.selection import selected_by

    check_expression("-k", args.k)  # under xdist a bad one was an INTERNALERROR
    check_expression("-m", args.m)
    check_markers(args.m)  # an unknown one selected nothing: exit 5 with no word why
    stage["selection"] = selected_by(args.k, args.m)
    request = _parsed_request(args)  # the options; backends resolved below (imports torch)
    # what the run means to run, known before torch is imported: an interrupt from here on
    # leaves a results file and a report that say what did not run
    stage["request"] = request
    results = check_output_file(args.results, "results file")
    if args.junit:
        check_output_file(args.junit, "JUnit XML file")
    fresh = not (args.resume or args.append)
    if fresh:
        stage.update(results=results, fresh=True)
    matrix = load(request.matrix, request.seed)
    stage["matrix"] = matrix
    shard = None
    if args.shard:
        from mlacheck import shard as shard_mod

        shard = shard_mod.parse(args.shard)
        stage["shard"] = shard
    if not fresh:  # the file is one mlacheck wrote (and, resumed, of this run) before it counts
        results_file.check_resumable(results, "--resume" if args.resume else "--append")
        if args.resume:
            results_file.check_same_run(results, request.backends, matrix.name)
        stage.update(results=results, fresh=False, headers_before=len(
            results_file.read_raw(results).headers) if results.exists() else 0)
    chosen = _selection(matrix, request.backends, args)
    stage["kept"] = chosen.kept
    # a requested backend is required: the run does not start without it. Asked in another
    # process from here (beside pytest starting the workers), awaited before the first item;
    # where the names and the device are known without torch, resolving them and checking
    # the device are that process's too (the workers start ~4 s sooner: torch's import)
    in_probe = _checked_in_probe(request)
    with contextlib.closing(_Usability(request, resolves=in_probe)) as usable:
        if in_probe:
            request = request.resolved(lambda b: builtin_name(b) or b)
        else:
            with _signals_held():  # imports torch
                request = _resolved(request)  # every backend resolved before pytest: exit 2
        _stop_if_signalled()
        stage["request"] = request
        usable.resolved(request)
        device = request.device if in_probe else resolve_device(request.device)
        stage["device"] = device
        return _session(args, extra, stage, request, matrix, chosen, results, shard, device,
                        usable)


def _not_run(request, unusable: dict[str, str], stage: dict[str, Any]) -> int:  # noqa: ANN001
    """A required backend is not usable: one line each, exit 6, and the results file of an
    earlier run left as it was."""
    from mlacheck.session import outcome

    out = outcome([], request, unusable=unusable)
    for line in out.lines:
        print(f"mlacheck: not run: {line}", file=sys.stderr)
    stage.pop("results", None)
    return out.code


def _session(args: argparse.Namespace, extra: list[str], stage: dict[str, Any], request: Any,
             matrix: Any, chosen: Any, results: Path, shard: Any, device: str,
             usable: _Usability) -> int:
    """The pytest session of `mlacheck run`, once its request is resolved."""
    from mlacheck import results as results_file

    backends, policy = request.backends, request.policy
    if chosen.surely_empty and not args.resume:  # pytest said so only after its workers started
        if unusable := usable.result():
            return _not_run(request, unusable, stage)
        from mlacheck.outcome import EXIT_NOTHING_COLLECTED
        from mlacheck.selection import nothing_selected

        n = len(request.backends)
        why = nothing_selected(matrix.name, len(matrix.cases), n, len(matrix.cases) * n,
                               args.k, args.m)
        print(f"mlacheck gate: exit {EXIT_NOTHING_COLLECTED} "
              f"({exit_meaning(EXIT_NOTHING_COLLECTED)}): {why}")
        return EXIT_NOTHING_COLLECTED
    leave_out = None
    if args.resume:
        results_file.repair_torn_tail(results)  # a record cut by the kill: its item runs again
        done = results_file.recorded_items(results)
        leave_out = results.with_name(f".{results.name}.done")
        leave_out.write_text("".join(f"{b}\t{c}\n" for b, c in sorted(done)))
        print(f"mlacheck: resuming {results}: {len(done)} item(s) already recorded", flush=True)

    def clear() -> None:
        """A fresh run replaces the file of an earlier one: once its backends are usable."""
        if not (stage.get("cleared") or args.resume or args.append):
            results.unlink(missing_ok=True)
        stage["cleared"] = True

    if args.resume or args.append:
        clear()
    extra, passed_workers = _take_worker_option(extra)
    workers = _workers(passed_workers if passed_workers is not None else args.workers, device)
    argv = [
        _suite_path(), "-q", "-rfE", "--no-header",
        "-o", "console_output_style=progress", "-p", "no:cacheprovider",
        # mlacheck is imported before pytest loads it as a plugin: its asserts need no
        # rewriting, and pytest-benchmark (when installed) only warns under xdist
        "-W", "ignore::pytest.PytestAssertRewriteWarning", "-p", "no:benchmark",
        # plugins of the environment the suite's items do not use: Hypothesis's imported
        # itself at the terminal summary, in the controller and again in each worker
        # (measured: 7.9 s of an 22 s two-item run under load), anyio's at start (2.5 s)
        "-p", "no:hypothesispytest", "-p", "no:anyio",
        # and the unraisable-exception plugin, whose session end runs gc.collect() five times
        # (1.1 s of a worker's 8 s start-to-end on a collect-only nightly, every worker)
        "-p", "no:unraisableexception",
        f"--mla-matrix={request.matrix}", f"--mla-device={device}",
        f"--mla-golden={request.golden}",
        f"--mla-results={results}", f"--timeout={args.timeout}",
        f"-n={workers}", f"--max-worker-restart={max(4, len(matrix.cases) * len(backends))}",
        "--rootdir", str(Path.cwd()), "--mla-gate-by-caller",
    ]
    argv += _plugin_args()
    argv += [f"--mla-backend={b}" for b in backends]
    if request.seed is not None:
        argv.append(f"--mla-seed={request.seed}")
    if leave_out is not None:
        argv.append(f"--mla-leave-out={leave_out}")
    if policy.require_ops:
        argv.append(f"--mla-require-ops={','.join(policy.require_ops)}")
    if policy.min_executed:
        argv.append(f"--mla-min-executed={policy.min_executed}")
    if policy.allow_xpass:
        argv.append("--mla-allow-xpass")
    if shard is not None:
        argv.append(f"--mla-shard={shard}")
    if args.junit:
        argv.append(f"--junitxml={args.junit}")
    if args.k:
        argv += ["-k", args.k]
    if args.m:
        argv += ["-m", args.m]
    argv += extra
    part = f", shard {shard} of its cases" if shard is not None else ""
    print(f"mlacheck: matrix {matrix.name} ({len(matrix.cases)} cases{part}) x backends "
          f"{', '.join(backends)} on {device}, {workers} worker(s); results -> {results}",
          flush=True)
    import pytest

    from mlacheck.outcome import gate_lines

    os.environ.setdefault("PYTHONHASHSEED", "0")
    from mlacheck.pytest_plugin import BackendsUsable

    end, gate = _SessionEnd(), BackendsUsable(usable.result, clear)
    _stop_if_signalled()
    if usable.resolves:
        argv.append("--mla-checked-by-caller")
    code = int(pytest.main(argv, plugins=[end, gate]))
    late = _late_error(gate, usable, code)
    if late:  # exit 2, as when checked before pytest started (no item ran, nothing written)
        raise UsageError(late)
    if gate.unusable:
        return _not_run(request, gate.unusable, stage)
    clear()  # pytest stopped before it asked (a usage or internal error): as it would have
    if signal.getsignal(signal.SIGTERM) not in (_interrupt, _again):  # pytest's handling may
        signal.signal(signal.SIGTERM, _interrupt)  # have reset it
    # a signal during pytest's session: pytest stopped and its gate says INCOMPLETE; one it
    # swallowed, or one before its session began (no run header yet): the same from here
    _stop_if_signalled()
    lines: list[str] = []
    if code == EXIT_PYTEST_USAGE:  # pytest said why (an extra argument): mlacheck's usage code
        code = EXIT_USAGE
    elif not end.reached:
        # pytest stopped before its session end, where the plugin sets the gate's code: an
        # interrupt or an internal error while starting; the gate, from what is on record
        from mlacheck.session import outcome

        out = outcome(results, request, interrupted=code == PYTEST_INTERRUPTED,
                      internal_error=code != PYTEST_INTERRUPTED,
                      selection=str(stage["selection"]))
        code, lines = out.code, gate_lines(out)
    else:
        from mlacheck.pytest_plugin import session_gate_lines

        lines = session_gate_lines(end.config)
    if args.report and results.exists():
        from mlacheck.report import main as report_main

        stage.update(reporting=True, code=code)
        report_main([str(results), "-o", str(results.parent)])
        stage["reporting"] = False
    # the gate's lines last, after the report: a signal while the report was written
    # changes them (exit 6) instead of adding a second, contrary gate line
    _hold_signals()  # the code is decided: a signal from here on is held, not raised
    for line in lines:
        print(line)
    return code


def _late_error(gate: Any, usable: _Usability, code: int) -> str:
    """The error of the checks left to the usability probe (_checked_in_probe), '' if none:
    as the gate met it before the first item, or, where pytest stopped before asking (a usage
    or internal error while starting), asked now: it would have been found first."""
    if gate.error or not usable.resolves or gate.asked or code == PYTEST_INTERRUPTED:
        return gate.error
    try:
        usable.result()
    except UsageError as e:
        return str(e)
    return ""


def _selection(matrix, backends, args: argparse.Namespace):  # noqa: ANN001, ANN202
    """What -k / -m keep of the matrix's items (mlacheck.selection), before pytest starts."""
    from mlacheck.selection import Candidate, select

    return select([Candidate(b, mc.case.id, tuple(mc.markers)) for mc in matrix.cases
                   for b in backends], args.k, args.m)


def _take_worker_option(extra: list[str]) -> tuple[list[str], int | None]:
    """`mlacheck run ... -- -n N` (or --numprocesses): taken out of pytest's arguments and
    counted as `-n N`, so the cap on workers holds (passed through, it overrode the cap).
    `auto` / `logical` mean the default."""
    out: list[str] = []
    found: str | None = None
    i = 0
    while i < len(extra):
        a = extra[i]
        for flag in ("--numprocesses", "-n"):
            if a == flag and i + 1 < len(extra):
                found, i = extra[i + 1], i + 2
                break
            if a.startswith(flag + "=") or (flag == "-n" and a.startswith("-n") and a != "-n"):
                found, i = a[len(flag):].lstrip("="), i + 1
                break
        else:
            out.append(a)
            i += 1
    if found is None or found in ("auto", "logical"):
        return out, None
    try:
        n = int(found)
    except ValueError:
        raise UsageError(f"-- -n {found}: not a worker count (an integer, auto or logical)") \
            from None
    if n < 1:
        raise UsageError(f"-- -n {found}: the run needs at least one worker")
    return out, n


class _Usability:
    """{name: why} of the requested backends that are not usable here (mlacheck list's
    verdict: the library is missing, its API does not fit, its probe failed), from a probe
    started on the backends as requested (mlacheck.inventory.UsabilityProbe) and read, under
    the names they resolved to, when `result()` is asked. `resolves`: the probe also
    resolves the backends and checks the device (_checked_in_probe), and `result()` raises
    UsageError with the first of them that fails, or for a built-in backend that records its
    verdicts under another name than the one taken for it here (a suite bug)."""

    def __init__(self, request, resolves: bool = False) -> None:  # noqa: ANN001 - RunRequest
        from mlacheck.inventory import UsabilityProbe

        self.resolves = resolves
        self._probe = UsabilityProbe(list(request.backends),
                                     request.device if resolves else None)
        self._names: dict[str, str] = {}

    def resolved(self, request) -> None:  # noqa: ANN001 - mlacheck.session.RunRequest
        self._names = dict(zip(request.backends, request.names, strict=True))

    def result(self) -> dict[str, str]:
        answer = self._probe.result()
        if answer.error:
            raise UsageError(answer.error)
        for spec, name in answer.names.items():
            if self._names.get(spec, name) != name:
                raise UsageError(f"backend {spec!r} records its verdicts as {name!r}, not "
                                 "under its built-in name (mlacheck.backends.registry.BUILTIN: "
                                 "a suite bug)")
        return {self._names[spec]: why for spec, why in answer.unusable.items()
                if spec in self._names}

    def close(self) -> None:
        self._probe.close()



def _parsed_request(args: argparse.Namespace):  # noqa: ANN202 - mlacheck.session.RunRequest
    """The run's options, parsed and checked once; backends as requested (not yet resolved)."""
    from mlacheck.backends.registry import DEFAULT_BACKENDS
    from mlacheck.session import RunRequest

    return RunRequest.parse(
        backends=args.backend, default_backends=DEFAULT_BACKENDS, matrix=args.matrix,
        device=args.device, golden=args.golden, seed=args.seed,
        require_ops=args.require_ops, min_executed=args.min_executed,
        allow_xpass=args.allow_xpass,
    )


def _checked_in_probe(request) -> bool:  # noqa: ANN001 - mlacheck.session.RunRequest
    """Whether every backend is a built-in name and the device is named outright (cpu, cuda,
    cuda:N): then their names and the device are known without importing torch, and resolving
    the backends and checking the device (exit 2 as before) are left to the usability probe,
    whose answer is awaited before the first item. Import paths, entry points and
    --device auto need an import to be known: resolved here, before pytest starts."""
    from mlacheck.backends.registry import builtin_name
    from mlacheck.preflight import is_explicit

    return is_explicit(request.device) and all(builtin_name(b) for b in request.backends)


def _resolved(request):  # noqa: ANN001, ANN202 - mlacheck.session.RunRequest
    """Every backend resolved (imports it: torch; exit 2 if one does not exist)."""
    from mlacheck.backends.registry import resolve

    return request.resolved(lambda b: resolve(b).name)


# Peak resident memory of one CPU worker over the premerge matrix (the largest decode case's
# inputs + golden): 4.5 GB, measured with `/usr/bin/time -f %M mlacheck run --matrix premerge
# --device cpu -n 1` on the 2-core CI machine. More workers than memory allows would swap.
CPU_WORKER_PEAK_GIB = 4.5
# Workers on one GPU: each takes CORES_PER_GPU_WORKER cores for its torch threads and input
# work, at most GPU_WORKERS_MAX per GPU (device memory is shared through mlacheck.admission).
# Measured on one H100 with 16 cores: the nightly x 3 backends in 137-148 s with 8 workers,
# ~630 s with 4 and `--resume` (docs/gpu-results.md, "Suite throughput").
CORES_PER_GPU_WORKER = 2
GPU_WORKERS_MAX = 8
# Host memory of one GPU worker at its peak. 13.6 GiB was the largest process of that nightly
# when inputs and the judge ran on the host; since they run on the GPU the largest process of
# the nightly (torch, aiter-model, aiter-triton; 8 workers per GPU) was 1.64-1.69 GiB on one
# H100 and on a 4x H200 host (2026-11-26, docs/gpu-results.md). 4 GiB keeps a 2.4x margin; at
# 13.6 an 8-GPU node with 560 GiB got at most 5 workers per GPU, not 8.
GPU_WORKER_HOST_GIB = 4.0


def _default_workers(device: str) -> int:
    """Workers in separate processes (a crash cannot take the run). On a CPU one per core, as
    many as the free memory holds: measured on 2 cores, premerge 40.4 s with one worker,
    29.4 s with two. On GPUs, CORES_PER_GPU_WORKER cores each, at most GPU_WORKERS_MAX per GPU
    and at least one, as many as the host memory holds."""
    from mlacheck.preflight import gpu_count

    gpus = 0 if device == "cpu" else gpu_count()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if gpus:
        per_gpu = min(GPU_WORKERS_MAX, (cores or 1) // (CORES_PER_GPU_WORKER * gpus))
        by_memory = int(_available_gib() // GPU_WORKER_HOST_GIB)
        return gpus * max(1, min(per_gpu, by_memory // gpus))
    return max(1, min(cores or 1, int(_available_gib() // CPU_WORKER_PEAK_GIB)))


def _workers(requested: int | None, device: str) -> int:
    """The run's worker count: the default, or an explicit `-n` capped at the default (what the
    cores and memory allow), with one warning line. Uncapped, `-n 1000` on 2 cores and 23 GB
    started 1000 workers, ran the machine out of memory (the OOM killer took unrelated
    processes too) and ended with exit 137 after 16 minutes."""
    limit = _default_workers(device)
    if requested is None or requested <= limit:
        return limit if requested is None else requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"mlacheck: warning: -n {requested} capped to {limit}: what {cores or 1} core(s) and "
          f"{_available_gib():.1f} GiB of available memory allow on {device}", file=sys.stderr)
    return limit


def _available_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return CPU_WORKER_PEAK_GIB  # unknown: one worker


# --------------------------------------------------------------------------- list


def cmd_list(args: argparse.Namespace) -> int:
    from mlacheck import inventory

    if args.coverage is not None or args.pairs is not None:
        return _print_coverage(args.coverage or args.pairs or [], args.backend, args.device,
                               pairs=args.pairs is not None, strength=args.strength)
    if args.faults:
        from mlacheck.backends.faults import FAULTS, PREFIX

        for spec in FAULTS.values():
            print(f"  {PREFIX}{spec.name:26s} class {spec.class_label:22s} {spec.mechanism}")
        return EXIT_OK
    if args.json:
        from mlacheck.processes import machine_stdout
        from mlacheck.session import split_names

        with machine_stdout() as out:  # what libraries print while probed goes to stderr
            out.write(json.dumps(inventory.listing(list(split_names(args.backend))), indent=1)
                      + "\n")
        return EXIT_OK
    from mlacheck.backends.faults import PREFIX

    print("backends:")
    for s in inventory.backend_statuses():
        if not s.usable:
            # a name that cannot be resolved at all vs. one whose library is missing here
            where = "" if s.reason and s.reason.startswith("backend ") else " here"
            print(f"  {s.name:18s} unavailable{where}: {s.reason}")
            continue
        print(f"  {s.name}")
        for op, text in s.capabilities.items():
            print(f"    {op:18s} {text}")
    print(f"  {PREFIX}* ({inventory.fault_count()} planted faults for `mlacheck selftest`; "
          "`mlacheck list --faults` lists them)")
    print("matrices:")
    for m, n in inventory.matrix_counts().items():
        print(f"  {m:10s} {n} cases")
    return EXIT_OK


def _print_coverage(matrices: list[str], backends: list[str] | None = None,
                    device: str = "auto", pairs: bool = False, strength: int = 2) -> int:
    """Which boundary classes (mlacheck/boundaries.py) each matrix covers, per op: the number
    of cases, all of them and those a CPU gate runs (without large_kv); the FP8 input scales
    of every FP8 case. With backends: the cases each backend executes here (not SKIPped by its
    capabilities), so a class the matrix covers and the backend skips shows as not covered for
    that backend. With `pairs`, the feasible t-tuples of feature levels no case covers
    (mlacheck/coverage.py; exit 1 when there are any)."""
    from mlacheck import boundaries
    from mlacheck.backends.base import skip_reason
    from mlacheck.backends.registry import resolve
    from mlacheck.matrices import load, names
    from mlacheck.preflight import resolve_device
    from mlacheck.session import split_names

    chosen = [resolve(b) for b in split_names(backends)]
    where = resolve_device(device) if chosen else ""
    missing_pairs = 0
    for name in matrices or names():
        m = load(name)
        every = boundaries.coverage(mc.case for mc in m.cases)
        cpu = boundaries.coverage(mc.case for mc in m.cases if "large_kv" not in mc.markers)
        print(f"{m.name} ({len(m.cases)} cases): boundary class / op: cases (without large_kv)")
        for cls in boundaries.CLASSES:
            cells = []
            for op, n in every[cls.name].items():
                mark = "" if n else "  <- MISSING" if cls.cpu else "  (needs large_kv)"
                cells.append(f"{op} {n} ({cpu[cls.name][op]}){mark}")
            print(f"  {cls.name:24s} " + "; ".join(cells))
        for backend in chosen:
            runs = [mc.case for mc in m.cases if skip_reason(backend, mc.case, where) is None]
            mine = boundaries.coverage(runs)
            print(f"  {backend.name} on {where} executes {len(runs)} of {len(m.cases)} cases: "
                  "boundary class / op: cases it executes (of the matrix's)")
            for cls in boundaries.CLASSES:
                cells = []
                for op, n in mine[cls.name].items():
                    total = every[cls.name][op]
                    mark = "  <- SKIPPED" if total and not n else ""
                    cells.append(f"{op} {n} (of {total}){mark}")
                print(f"    {cls.name:22s} " + "; ".join(cells))
        _print_scales(m)
        if pairs:
            missing_pairs += _print_pairs(m, strength)
    return EXIT_KERNEL_FAILURE if missing_pairs else EXIT_OK


def _print_scales(m) -> None:  # noqa: ANN001 - a loaded Matrix
    """Per FP8 case: the scale each quantised input gets and the closest two (a kernel that
    uses one tensor's scale for another's is wrong by that factor; below
    coverage.MIN_SCALE_SPREAD the inputs hide such a mix-up)."""
    from mlacheck import coverage

    rows = [coverage.scale_report(mc.case) for mc in m.cases if mc.case.quant.is_fp8]
    if not rows:
        return
    measured = [r for r in rows if r.spread is not None]
    low = [r for r in measured if r.spread < coverage.MIN_SCALE_SPREAD]
    spreads = sorted(r.spread for r in measured)
    summary = (f"closest two per-tensor scales differ {spreads[0]:.2f}x .. {spreads[-1]:.2f}x "
               f"(median {spreads[len(spreads) // 2]:.2f}x)" if spreads else "")
    print(f"  FP8 input scales: {len(rows)} FP8 cases, {len(measured)} with per-tensor amax "
          f"scales; {summary}; {len(low)} below {coverage.MIN_SCALE_SPREAD:g}x")
    for r in rows:
        print(f"    {r.case_id:64s} {r.text}")


def _print_pairs(m, strength: int) -> int:  # noqa: ANN001 - a loaded Matrix
    from mlacheck import coverage

    cases = [mc.case for mc in m.cases]
    total = 0
    for op in coverage.OPS:
        need = coverage.required(op, strength)
        left = coverage.uncovered(cases, op, strength)
        n_imp = coverage.impossible_count(op, strength)
        print(f"  {op}: {len(need) - len(left)} of {len(need)} feasible {strength}-tuples "
              f"covered ({n_imp} impossible, declared in mlacheck/coverage.py)"
              + ("" if left else "; none uncovered"))
        for combo in left:
            print("    uncovered: " + ", ".join(f"{f}={v}" for f, v in combo))
        total += len(left)
    return total


# --------------------------------------------------------------------------- replay


# What a case id looks like: a slug (dec- / pf- / sparse-...) and 8 hex digits of its hash.
CASE_ID = re.compile(r"(dec|pf|sparse)-[a-z0-9.^-]+-[0-9a-f]{8}")


def find_case(ref: str):  # noqa: ANN201
    """A case from a JSON file, inline JSON, or a case id found in the named matrices."""
    from mlacheck.matrices import load, names
    from mlacheck.spec import case_from_json

    if ref.lstrip().startswith("{"):
        return case_from_json(ref)
    path = Path(ref)
    if path.suffix == ".json" or os.sep in ref:
        if not path.is_file():
            raise UsageError(f"case file {ref!r} not found")
        return case_from_json(path.read_text())
    if not CASE_ID.fullmatch(ref):
        raise UsageError(f"{ref!r} is not a case id (e.g. dec-b1-kv300-h16-p16-bf16-shuffled-"
                         "a66560d0), a JSON file or JSON text")
    for m in names():
        for mc in load(m).cases:
            if mc.case.id == ref:
                return mc.case
    raise UsageError(f"case id {ref!r} is in none of the matrices {', '.join(names())} "
                     "(replay it from its JSON: the `case` field of its results line)")


def cmd_replay(args: argparse.Namespace) -> int:
    from mlacheck import footprint
    from mlacheck.backends.registry import DEFAULT_BACKENDS, resolve
    from mlacheck.harness import RunOptions, run
    from mlacheck.preflight import resolve_device
    from mlacheck.session import RunRequest, outcome

    case = find_case(args.case)
    request = RunRequest.parse(backends=args.backend, default_backends=DEFAULT_BACKENDS,
                               device=args.device, golden=args.golden)
    resolved = {b: resolve(b) for b in request.backends}
    request = request.resolved(lambda b: resolved[b].name)
    backends = [resolved[b] for b in request.backends]
    device = resolve_device(request.device)
    too_big = footprint.does_not_fit(case, device)
    if too_big:
        raise UsageError(f"{case.id}: {too_big}")
    print("case:", case.to_json())
    verdicts = []
    for backend in backends:
        result = run(case, backend, RunOptions(device, request.golden))
        v = result.verdict
        verdicts.append(v)
        print(v.summary())
        if v.known_failure:
            print(f"  known failure ({v.known_rule}): {v.known_failure}")
        checks = [{"check": c.name, "passed": c.passed, "value": c.value, "bound": c.bound,
                   "detail": c.detail} for c in v.checks]
        print(json.dumps({"checks": checks, "timings": result.timings,
                          "metrics": {k: x for k, x in v.metrics.items() if k != "heatmap"}},
                         indent=1, default=str))
    out = outcome(verdicts, request)  # the gate's meaning, as for a run of this one case
    if out.code != EXIT_OK:
        print(f"mlacheck gate: exit {out.code} ({exit_meaning(out.code)})")
        for line in out.lines:
            print(f"  {line}")
    return out.code


# --------------------------------------------------------------------------- main


def _positive(text: str) -> int:
    n = _integer(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return n


def _non_negative(text: str) -> int:
    n = _integer(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return n


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _matrix_names() -> list[str]:
    from mlacheck.matrices import names

    return names()


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="mlacheck", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run a matrix against backends (pytest underneath)",
                       description="Run a matrix of cases against backends; one pytest item per "
                                   "(case, backend). Exit codes: README 'Exit codes'.")
    r.add_argument("--backend", "-b", action="append",
                   help="backend name, entry point or pkg.module:factory; repeatable, or "
                        "comma-separated (default: the embedded aiter-model-gfx942,"
                        "aiter-model-gfx950); `mlacheck list` shows them")
    r.add_argument("--matrix", default="smoke",
                   help=f"matrix name ({', '.join(_matrix_names())}) or a YAML path "
                        "(default: smoke)")
    r.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N, or auto (cuda when torch sees a GPU; default)")
    r.add_argument("--golden", default="fp32", choices=("fp32", "fp64"),
                   help="precision of the reference (default fp32; fp64 is slower)")
    r.add_argument("--results", default=DEFAULT_RESULTS,
                   help=f"results file, one JSON line per item (default {DEFAULT_RESULTS}); "
                        "the reports go next to it")
    keep = r.add_mutually_exclusive_group()  # --resume continues the file's run; --append adds one
    keep.add_argument("--append", action="store_true", help="append to an existing results file")
    keep.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: keep the results file and run only the "
                        "(case, backend) items it has no line for (same matrix and backends)")
    r.add_argument("--seed", type=_non_negative, default=None,
                   help="offset added to every case's seed: another draw of the same matrix")
    r.add_argument("--workers", "-n", type=_positive, default=None,
                   help="pytest-xdist workers (default: on GPUs 2 cores per worker, at most 8 per GPU; on "
                        "a CPU one per core; as host memory allows); a larger -n is capped at that")
    r.add_argument("--timeout", type=_positive, default=900,
                   help="per-case timeout in seconds (default 900): a hang is a CRASH")
    r.add_argument("--junit", default=None, help="write JUnit XML here")
    r.add_argument("-k", default=None, help="pytest -k expression")
    r.add_argument("-m", default=None, help="pytest -m marker expression")
    r.add_argument("--no-report", dest="report", action="store_false",
                   help="write no report.md / report.html next to the results file "
                        "(default: write them)")
    r.add_argument("--require-ops", default="",
                   help="comma-separated ops every backend must execute at least one case of "
                        "(e.g. mla_prefill,mla_decode); otherwise exit 6")
    r.add_argument("--min-executed", type=float, default=0.0,
                   help="least executed (not skipped) fraction per backend x op, 0..1; "
                        "otherwise exit 6 (default 0: only a backend that runs nothing fails)")
    r.add_argument("--allow-xpass", action="store_true",
                   help="a known failure that now passes does not fail the run (default: exit 1)")
    r.add_argument("--shard", default=None, metavar="K/N",
                   help="run the K-th of N shards (1 <= K <= N): the selection's cases split "
                        "by estimated time, the same on every runner; `mlacheck merge` joins "
                        "the N results files (docs/ci.md)")

    ls = sub.add_parser("list", help="backends available here and matrices")
    ls.add_argument("--coverage", nargs="*", default=None, metavar="MATRIX",
                    help="show which boundary classes each matrix (default: all) covers, per "
                         "op, and the FP8 input scales of its FP8 cases")
    ls.add_argument("--backend", "-b", action="append", default=None,
                    help="repeatable or comma-separated; with --json: only these backends, and "
                         "no matrices (what a CI job checks before it runs); with --coverage: "
                         "also the classes each named backend executes here (its capabilities' "
                         "SKIPs left out)")
    ls.add_argument("--device", default="auto",
                    help="with --coverage --backend: the device whose capabilities count "
                         "(default auto)")
    ls.add_argument("--pairs", nargs="*", default=None, metavar="MATRIX",
                    help="with --coverage (or alone, naming the matrices): list the feasible "
                         "pairs of feature levels no case covers (mlacheck/coverage.py); "
                         "exit 1 when there are any")
    ls.add_argument("--strength", type=int, default=2, choices=(2, 3),
                    help="--pairs: tuples of this many levels (3: the nightly's triples)")
    ls.add_argument("--faults", action="store_true",
                    help="list the planted faults (fault:<name>) and their mechanisms")
    ls.add_argument("--json", action="store_true",
                    help="one JSON document on stdout (what CI scripts read): every backend with "
                         "usable / reason / version / capabilities, the matrices with their case "
                         "counts, the platform; what libraries print while imported goes to "
                         "stderr")

    rp = sub.add_parser("replay", help="re-run exactly one case and print the full verdict",
                        description="Re-run one case (by id, from a case.json, or from the "
                                    "`case` field of a results line) against backends and "
                                    "print each verdict in full: checks, locations, metrics. "
                                    "Exit codes as for `mlacheck run` (README 'Exit codes'): "
                                    "1 when a backend FAILs or CRASHes (a KNOWN failure is 0, "
                                    "a strict XPASS 1), 3 on a suite error, 6 when a backend "
                                    "could not run the case.")
    rp.add_argument("case", help="case id (e.g. from a failure card), case.json, or JSON text")
    rp.add_argument("--backend", "-b", default=None,
                    help="backend name, entry point or pkg.module:factory; comma-separated "
                         "for several (default: the embedded aiter-model-gfx942,"
                         "aiter-model-gfx950)")
    rp.add_argument("--device", default="auto",
                    help="cpu, cuda, cuda:N, or auto (cuda when torch sees a GPU; default)")
    rp.add_argument("--golden", default="fp32", choices=("fp32", "fp64"),
                    help="precision of the reference (default fp32; fp64 is slower)")

    sub.add_parser("report", help="markdown + HTML report from results.jsonl", add_help=False)
    sub.add_parser("merge", help="the shards of a split run (run --shard K/N) as one run: "
                                 "one results file, one report, one exit code", add_help=False)
    sub.add_parser("gate", help="end-to-end accuracy gates: gate TASK run|compare|promote "
                                "(lm-eval tasks, gsm8k first)", add_help=False)
    sub.add_parser("selftest", help="prove the suite catches every known bug class", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """`mlacheck` (the console script) and `python -m mlacheck.cli`. A SIGTERM / SIGINT from
    here on is held until the command is known (before it: the interpreter's start and this
    module's imports, ~0.1-0.2 s, where the signal's default action still applies)."""
    previous = _hold_signals()
    decided: int | None = None  # a run's code
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        if argv[:1] == ["run"]:
            decided = _run_guarded(argv)  # interrupted: exit 6, its gate line and report
            return decided
    finally:
        if decided is not None and _ENTRY_POINT:  # no default action in between: a 143
            _exit_on_signal(decided)
            _HELD.clear()  # a signal after the gate line: the run had finished
        else:
            for signum, handler in previous.items():
                signal.signal(signum, _DEFAULTS[signum] if handler is _hold else handler)
            if decided is not None:  # a library call's run: a signal held after its gate
                _raise_held()  # acts as it would have
    _raise_held()  # other commands: a held signal acts as it would have
    return _main(argv, {})


def _raise_held() -> None:
    if _HELD:
        signum = _HELD[0]
        _HELD.clear()
        signal.raise_signal(signum)


def _exit_on_signal(code: int) -> None:
    """Once a run's gate line is printed, a SIGTERM / SIGINT while the interpreter shuts down
    (torch's teardown) ends the process with the code that line gave, not the default 143:
    in a CI run of the `timeout -s TERM` sweep the gate said exit 0 and the process 143."""
    def _finish(signum: int, frame: FrameType | None) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to save
                stream.flush()
        os._exit(code)

    for signum in _EARLY_SIGNALS:
        signal.signal(signum, _finish)
    _DECIDED.append(code)


# The code of a run whose gate line is printed, in a process that is the command.
_DECIDED: list[int] = []


def _ignore_signals_once_decided() -> None:
    """The interpreter's last stage (modules freed, torch's C++ teardown: ~0.5 s on 2 cores)
    runs no Python handler, and CPython resets every Python-handled signal to its default
    action first, but not an ignored one: there a SIGTERM after the gate line killed the run
    (143: 5 of 5 runs signalled 0.01-0.4 s after the gate line). Registered at import, so it
    runs after the exit handlers of the modules imported later (torch's)."""
    if _DECIDED:
        for signum in _EARLY_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


if _ENTRY_POINT:
    import atexit  # noqa: E402

    atexit.register(_ignore_signals_once_decided)


def _main(argv: list[str], stage: dict[str, Any]) -> int:
    delegated = {"report": "mlacheck.report:main", "gate": "mlacheck.gate.cli:main",
                 "selftest": "mlacheck.selftest:main", "merge": "mlacheck.merge:main"}
    if argv and argv[0] in delegated:
        import importlib

        mod, fn = delegated[argv[0]].split(":")
        try:  # only the import: an ImportError while the command runs is its own failure
            entry = getattr(importlib.import_module(mod), fn)
        except ImportError as e:
            return _die(f"{argv[0]} is not available: {e}")
        return int(entry(argv[1:]))
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return _die(str(e))
    from mlacheck.backends.registry import BackendError
    from mlacheck.matrices import MatrixError
    from mlacheck.preflight import PreflightError
    from mlacheck.results import NotAResultsFile

    try:
        if args.cmd == "run":
            return cmd_run(args, extra, stage)
        if args.cmd == "list":
            return cmd_list(args)
        if args.cmd == "replay":
            return cmd_replay(args)
    except (UsageError, BackendError, MatrixError, PreflightError, NotAResultsFile,
            ValueError) as e:
        return _die(str(e))
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
