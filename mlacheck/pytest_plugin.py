"""pytest is the driver: each (case, backend) of a matrix is one test item.

Options: --mla-backend (repeatable, or comma-separated), --mla-matrix, --mla-device,
--mla-golden, --mla-results, --mla-seed, and the gate's coverage policy (--mla-require-ops,
--mla-min-executed, --mla-allow-xpass). Results: a run header, then one JSON line per item,
appended and flushed as it finishes by the process that ran it (mlacheck.results), so
nothing is lost if a run dies. Under pytest-xdist each worker gets one GPU
(HIP/CUDA_VISIBLE_DEVICES set before the device is touched); a worker killed by a crash is
replaced by xdist and the controller records that item as CRASH; after a device-side error
a worker exits, so no later case runs on a poisoned context.

The exit status is the gate's: set at session end by mlacheck.session.outcome from everything
the results file holds. The options are parsed once into a mlacheck.session.RunRequest; bad
ones are pytest usage errors (exit 4) raised before collection. This module holds pytest
hooks only: the run model is mlacheck.session, the xdist scheduler mlacheck.scheduling,
device discovery mlacheck.preflight.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mlacheck import results as results_file
from mlacheck.errors import UsageError
from mlacheck.outcome import Outcome
from mlacheck.processes import slow_exit_kept
from mlacheck.progress import Progress
from mlacheck.session import RunRequest

# Runs smaller than this get no progress lines (pytest's own output says enough).
PROGRESS_MIN_ITEMS = 20
# Where workers write when the user named no results file (the controller's private file).
_PRIVATE_RESULTS_ENV = "MLACHECK_PRIVATE_RESULTS"
# Exit status of a worker that leaves after a device-side error (xdist replaces it).
DEVICE_ERROR_EXIT = 70
_OPTION_PREFIX = "mla_"


@dataclass(frozen=True)
class MatrixItem:
    """One test item: a matrix case on one backend (as requested)."""

    backend: str
    case: Any  # mlacheck.spec.Case
    markers: tuple[str, ...]

    @property
    def id(self) -> str:
        from mlacheck.selection import item_id

        return item_id(self.backend, self.case.id)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("mlacheck", "MLA kernel validation")
    g.addoption("--mla-backend", action="append", default=None,
                help="backend name, entry-point name or pkg.mod:factory (repeatable; commas "
                     "separate several)")
    g.addoption("--mla-matrix", default="smoke", help="matrix name or YAML path (default: smoke)")
    g.addoption("--mla-device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    g.addoption("--mla-golden", default="fp32", choices=("fp32", "fp64"), help="golden precision")
    g.addoption("--mla-results", default=None,
                help="results file (JSON lines); default: a temporary file read at the end")
    g.addoption("--mla-seed", type=int, default=None, help="offset added to every case seed")
    g.addoption("--mla-no-ideal", action="store_true", help="skip the unquantised-input golden")
    g.addoption("--mla-leave-out", default=None,
                help="file of 'backend<TAB>case id' lines not to run (mlacheck run --resume)")
    g.addoption("--mla-require-ops", default="",
                help="comma-separated ops every backend must execute at least one case of")
    g.addoption("--mla-min-executed", type=float, default=0.0,
                help="least executed (not skipped) fraction per backend x op, 0..1 (default 0)")
    g.addoption("--mla-allow-xpass", action="store_true",
                help="a known failure that passes does not fail the run (default: it does)")
    g.addoption("--mla-gate-by-caller", action="store_true",
                help="print no gate lines: the caller prints them (mlacheck run: after its "
                     "report, so that a signal during the report changes the one gate line)")
    g.addoption("--mla-checked-by-caller", action="store_true",
                help="the caller resolves the built-in backends and checks the device before "
                     "the first item (mlacheck run's usability probe): the controller takes "
                     "their names and the device as given, and imports no torch")
    g.addoption("--mla-shard", default=None,
                help="K/N: run only the K-th of N shards of the selection (mlacheck.shard)")


def pytest_configure(config: pytest.Config) -> None:
    from mlacheck.markers import MARKERS  # torch-free: the controller builds no case

    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description} (mlacheck case marker)")
    worker = is_worker(config)
    if worker:
        info = config.workerinput  # type: ignore[attr-defined]
        if info.get(_LOADGROUP):
            config.option.loadgroup = True
        _start_worker(info)
        config.pluginmanager.register(_WorkerEnd(), "mla-worker-end")
    state = _State(config)
    config.stash[_STATE] = state
    if config.pluginmanager.hasplugin("xdist") and not config.pluginmanager.has_plugin("mla-xdist"):
        config.pluginmanager.register(_XdistHooks(), "mla-xdist")
    if worker and info.get(_MATRIX_CACHE):
        from mlacheck.matrices.loader import adopt_expansions

        adopt_expansions(Path(info[_MATRIX_CACHE]))
    if not worker and _runs_the_suite(config):
        state.preflight()
        if getattr(config.option, "dist", "no") == "load":
            # each case's items to one worker, in order (xdist_group marks): its inputs and
            # references are built once there for all its backends; the queue keeps the
            # collection's order (longest first), not xdist's by-size reordering
            config.option.dist = "loadgroup"
            config.option.loadscopereorder = False
            if state.device.startswith("cuda"):
                state.gpu_dir = Path(tempfile.mkdtemp(prefix="mlacheck-gpus-"))
            state.matrix_cache = _export_matrix()


class _WorkerEnd:
    """An xdist worker leaves as soon as its session is over: its last report ("workerfinished")
    is sent by then, and the controller waited for each worker's interpreter to tear down
    torch and its GPU context (the last worker's exit held the run 2.5 s past its last item
    on one H100, 2026-11-27). What the process holds is given back first: the kept case's
    device reservation (mlacheck.harness), buffered output, the fault-dump file."""

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if not _runs_the_suite(config) or slow_exit_kept():
            return
        if "mlacheck.harness" in sys.modules:
            sys.modules["mlacheck.harness"].release_shared()
        for f in (*_FAULT_FILE, sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()
        os._exit(0)


# How long the controller waits for the processes of workers that finished a run to end
# before xdist kills what is left (xdist waits up to 10 s). On 4x H200 the 32 workers' exits
# held the run 2.35 s after their last report (the driver frees one CUDA context after
# another), against 0.6 s with 8 workers on one GPU (MLA_TRACE patch, 2026-11-27).
WORKER_EXIT_WAIT_S = 0.5


def _export_matrix() -> Path | None:
    """The matrix as preflight expanded it, for the workers to adopt instead of expanding it
    again; None (each worker expands it) where it cannot be written."""
    from mlacheck.matrices.loader import export_expansions

    fd, name = tempfile.mkstemp(prefix="mlacheck-matrix-", suffix=".pickle")
    os.close(fd)
    try:
        export_expansions(Path(name))
    except (OSError, pickle.PicklingError):
        Path(name).unlink(missing_ok=True)
        return None
    return Path(name)


def _publish_gpu(state: _State, folder: Path, worker: str) -> None:
    """Say which GPU this worker runs on (the scheduler hands each GPU what fits it); a
    worker that cannot say is scheduled as before, never stopped."""
    from mlacheck import admission
    from mlacheck.preflight import PreflightError

    try:
        admission.publish_worker_gpu(folder, worker, state.device)
    except Exception as e:  # noqa: BLE001
        if isinstance(e, PreflightError) and state.config.getoption("--mla-checked-by-caller"):
            return  # no such device: `mlacheck run`'s probe says so, once, and nothing runs
        print(f"mlacheck: worker {worker} could not publish its GPU: {e}", file=sys.stderr)


def _quiet_xdist_status(config: pytest.Config) -> None:
    """xdist prints "bringing up nodes..." twice into non-TTY logs; the run's own progress
    lines (mlacheck.progress) say more."""
    trdist = config.pluginmanager.get_plugin("terminaldistreporter")
    if trdist is not None:
        trdist.ensure_show_status = lambda: None
        # its other line, "[gw0] node down: ...": mlacheck's own line says it (worker_died)
        trdist.write_line = lambda msg: None
    dsession = config.pluginmanager.get_plugin("dsession")
    if dsession is not None:  # "replacing crashed worker gw0" too; other lines stay
        said = dsession.report_line
        dsession.report_line = lambda line: (
            None if line.strip().startswith("replacing crashed worker") else said(line))


def is_worker(config: pytest.Config) -> bool:
    """An xdist worker (config.workerinput; not the environment, which a subprocess that a
    worker starts inherits)."""
    return hasattr(config, "workerinput")


def _runs_the_suite(config: pytest.Config) -> bool:
    """Whether this session is an mlacheck matrix run (the plugin is also loaded in every
    other pytest session of the environment, where it must stay out of the way)."""
    if any(("mlacheck.suite" in a or "mlacheck/suite" in a) for a in config.args):
        return True
    defaults = {"mla_matrix": "smoke", "mla_device": "auto", "mla_golden": "fp32",
                "mla_min_executed": 0.0, "mla_require_ops": ""}
    return any(v not in (None, False, defaults.get(k))
               for k, v in vars(config.option).items() if k.startswith(_OPTION_PREFIX))


def _map_worker_to_device(index: int) -> None:
    """Worker gwN sees one GPU: the N-th (modulo) of those visible to the controller, named in
    the variable the runtime reads (HIP_VISIBLE_DEVICES on ROCm, where it wins over
    CUDA_VISIBLE_DEVICES; CUDA_VISIBLE_DEVICES on CUDA). The same list gpu_count() counts, so
    gwN never names a GPU outside the job's subset (on ROCm with only CUDA_VISIBLE_DEVICES=2,3
    set, a HIP_VISIBLE_DEVICES=0/1 of our own would have moved the workers onto GPUs 0 and 1).

    Must run before the worker touches the device; torch initialises CUDA/HIP lazily.
    """
    from mlacheck.preflight import _machine, _visible_ids, gpu_count

    platform, _ = _machine()
    listed = _visible_ids(platform)
    count = gpu_count() or len(listed or [])  # no driver files: as the variables list
    if not count:
        return
    ids = (listed or [str(i) for i in range(count)])[:count]
    for var in {"rocm": ("HIP_VISIBLE_DEVICES",), "cuda": ("CUDA_VISIBLE_DEVICES",)}.get(
            platform, ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")):
        os.environ[var] = ids[index % len(ids)]


def _start_worker(info: dict[str, Any]) -> None:
    """In this order: the worker's GPU (its variable set before the device is touched), its
    CUDA context started in the background on a GPU run (mlacheck.cuda_context), then torch
    imported for its share of the CPU threads while the context is being made."""
    _map_worker_to_device(int(re.sub(r"\D", "", str(info.get("workerid", ""))) or 0))
    if info.get(_GPU_DIR) and _on_cuda():
        from mlacheck import cuda_context

        cuda_context.start_primary_context()
    _share_cpu_threads(int(info.get("workercount", 1)))


def _on_cuda() -> bool:
    """NVIDIA's driver is what this machine has (mlacheck.cuda_context is CUDA only)."""
    from mlacheck.preflight import _machine

    return _machine()[0] == "cuda"


def _share_cpu_threads(workers: int) -> None:
    """xdist workers share the cores: each gets its share of torch's CPU threads."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, workers)))


_STATE = pytest.StashKey["_State"]()
_LOADGROUP = "mla_loadgroup"  # workerinput key: the controller schedules by case
_GPU_DIR = "mla_gpu_dir"  # workerinput key: where workers publish their GPU (admission)
_MATRIX_CACHE = "mla_matrix_cache"  # workerinput key: the controller's expanded matrix


class _State:
    """Options resolved once per process; backends instantiated once per process (a reused
    instance keeps its persistent buffers across cases, as a serving engine does)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._backends: dict[str, Any] = {}
        self._items: list[MatrixItem] | None = None
        self._request: RunRequest | None = None
        self._device: str | None = None
        path = config.getoption("--mla-results") or os.environ.get(_PRIVATE_RESULTS_ENV)
        self.results = Path(path) if path else None
        self.device_poisoned: str | None = None
        self.header_written = False
        self.outcome: Outcome | None = None
        self.temporary_results = False
        self._by_id: dict[str, MatrixItem] | None = None
        self._progress: Progress | None = None
        self.selected: list[MatrixItem] = []  # what this run collected (after -k / -m / resume)
        self.matrix_name, self.matrix_cases = "", 0  # set by items()
        self.matrix_case_ids: list[str] = []
        self.gpu_dir: Path | None = None  # controller: where workers publish their GPU
        self.matrix_cache: Path | None = None  # controller: its expansion, for the workers
        self.nodes_down: dict[str, str] = {}  # controller: worker id -> why xdist lost it
        self.refused = False  # controller: a requested backend is not usable (BackendsUsable)
        self.collect_errors: list[str] = []  # controller: failed collections (a worker's)
        self._matrix: Any = None
        self._started = time.time()  # this session's start (pytest_sessionstart resets it)

    @property
    def request(self) -> RunRequest:
        """The options, parsed and checked once (UsageError), backends keyed by their names."""
        if self._request is None:
            from mlacheck.backends.registry import DEFAULT_BACKENDS

            opt = self.config.getoption
            self._request = RunRequest.parse(
                backends=opt("--mla-backend"), default_backends=DEFAULT_BACKENDS,
                matrix=opt("--mla-matrix"), device=opt("--mla-device"), golden=opt("--mla-golden"),
                seed=opt("--mla-seed"), require_ops=opt("--mla-require-ops"),
                min_executed=opt("--mla-min-executed"), allow_xpass=opt("--mla-allow-xpass"),
                flag_prefix="--mla-",
            ).resolved(self._name_of)
        return self._request

    @property
    def _caller_checks(self) -> bool:
        """`mlacheck run` resolves the backends and checks the device in its usability probe,
        awaited before the first item (BackendsUsable): this controller then takes built-in
        names as their backends' names and the device as given, and starts its workers
        without importing torch (4.4 s of the controller's 6.5 s before them on a 4x H200
        host, 2026-11-27)."""
        return not is_worker(self.config) and bool(
            self.config.getoption("--mla-checked-by-caller"))

    def _name_of(self, spec: str) -> str:
        from mlacheck.backends.registry import builtin_name

        name = builtin_name(spec) if self._caller_checks else None
        return name if name is not None else self.backend(spec).name

    def name_of(self, spec: str) -> str:
        """The name the verdicts of a requested backend record (no backend built for it)."""
        request = self.request
        return dict(zip(request.backends, request.names, strict=True)).get(spec) \
            or self.backend(spec).name

    @property
    def backend_names(self) -> tuple[str, ...]:
        """The backends as requested, one spelling per backend name."""
        return self.request.backends

    def backend(self, name: str) -> Any:
        if name not in self._backends:
            from mlacheck.backends.registry import resolve

            self._backends[name] = resolve(name)
        return self._backends[name]

    @property
    def device(self) -> str:
        if self._device is None:
            from mlacheck.preflight import resolve_device

            spec = self.config.getoption("--mla-device")
            self._device = spec if self._caller_checks else resolve_device(spec)
        return self._device

    def preflight(self) -> None:
        """Everything that can be wrong before the first case: a usage error (exit 4)."""
        from mlacheck.backends.registry import BackendError
        from mlacheck.matrices import MatrixError
        from mlacheck.preflight import PreflightError, check_expression, check_output_file

        try:
            _ = self.request
            _ = self.device, self.shard
            self.items()
            check_expression("-k", getattr(self.config.option, "keyword", ""))
            check_expression("-m", getattr(self.config.option, "markexpr", ""))
            if self.results is None:  # the gate needs a file to read: a private one
                fd, name = tempfile.mkstemp(prefix="mlacheck-", suffix=".jsonl")
                os.close(fd)
                os.unlink(name)
                self.results = Path(name)
                self.temporary_results = True
                os.environ[_PRIVATE_RESULTS_ENV] = name  # xdist workers inherit it
            check_output_file(self.results, "results file")
            xml = getattr(self.config.option, "xmlpath", None)
            if xml:
                check_output_file(xml, "JUnit XML file")
        except (BackendError, MatrixError, PreflightError, UsageError, ValueError) as e:
            raise pytest.UsageError(str(e)) from None

    def items(self) -> list[MatrixItem]:
        if self._items is None:
            from mlacheck.backends.registry import BackendError
            from mlacheck.matrices import MatrixError, load

            try:
                request = self.request
                matrix = load(request.matrix, request.seed)
            except (BackendError, MatrixError, UsageError, ValueError) as e:
                raise pytest.UsageError(str(e)) from None
            self._matrix = matrix
            self.matrix_name = matrix.name
            self.matrix_cases = len(matrix.cases)
            self.matrix_case_ids = [mc.case.id for mc in matrix.cases]
            leave_out = _leave_out(self.config.getoption("--mla-leave-out"))
            # case by case (a case's inputs and references serve all its backends in one
            # worker: mlacheck.harness), in the scheduler's order
            from mlacheck.scheduling import case_order

            cases = case_order(matrix.cases, request.names, self.device)
            self._items = [MatrixItem(b, mc.case, tuple(mc.markers)) for mc in cases
                           for b in self.backend_names if (b, mc.case.id) not in leave_out]
        return self._items

    def write(self, record: dict[str, Any]) -> None:
        if self.results is not None:
            results_file.append_record(self.results, record)

    def write_header(self, node_ids: list[str]) -> None:
        """The run header: what this invocation is about to run (once, by the controller)."""
        if self.header_written or self.results is None:
            return
        by_id = {it.id: it for it in self.items()}
        self.selected = [it for nid in node_ids
                         if (it := by_id.get(_param_id(nid) or "")) is not None]
        if not self.selected:
            return
        self.header_written = True
        results_file.repair_torn_tail(self.results)
        # keyed as the verdict lines key items: by the backend's name, not the request
        expected = [(self.name_of(it.backend), it.case.id) for it in self.selected]
        header = results_file.new_header(expected, list(self.backend_names),
                                         getattr(self, "matrix_name", ""), self.device,
                                         self.workers, *self.shard_record(),
                                         started=self.started)
        results_file.append_line(self.results, header.to_line())

    @property
    def shard(self) -> Any:
        """The --mla-shard this process runs (mlacheck.shard.Shard), or None."""
        from mlacheck import shard

        text = self.config.getoption("--mla-shard")
        return shard.parse(text) if text else None

    def shard_record(self) -> tuple[str, str]:
        """(K/N, run key) for the run header: what `mlacheck merge` checks shards against."""
        from mlacheck import shard as shard_mod

        sh = self.shard
        if sh is None:
            return "", ""
        opt = self.config.option
        names = list(self.request.names)
        key = shard_mod.run_key(self.matrix_name, self.config.getoption("--mla-seed"), names,
                                getattr(opt, "keyword", ""), getattr(opt, "markexpr", ""),
                                sh.count, self.matrix_case_ids)
        return str(sh), key

    def in_shard(self, selected: list[MatrixItem]) -> set[str]:
        """Case ids of this process's shard, partitioned over the selection (after -k / -m)
        together with the items --resume left out: every runner, resumed or not, computes
        the same partition."""
        from mlacheck import cost, shard

        sh = self.shard
        cases = {it.case.id: it.case for it in selected}
        by_id = {mc.case.id: mc.case for mc in self._matrix.cases}
        for _, case_id in _leave_out(self.config.getoption("--mla-leave-out")):
            if case_id in by_id:
                cases.setdefault(case_id, by_id[case_id])
        names = list(self.request.names)
        costs = {cid: cost.case_s(c, names, self.device) for cid, c in cases.items()}
        return shard.units_of(sh, costs)

    @property
    def started(self) -> float:
        """The run's one clock: the session's start as pytest's terminal reporter took it
        (pytest's `in N s` counts from it), else this plugin's own session start. The results
        header (the report's wall time) and the progress lines count from it."""
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        own = getattr(getattr(tr, "_session_start", None), "time", None)
        return float(own) if isinstance(own, int | float) else self._started

    @property
    def workers(self) -> int:
        """Processes running items: xdist's workers, or this one."""
        n = getattr(self.config.option, "numprocesses", None)
        return n if isinstance(n, int) and n > 0 else 1

    def why_nothing_selected(self) -> str:
        """Why a run selected no item: the matrix, --resume and -k / -m each take their part."""
        from mlacheck.selection import nothing_selected

        opt = self.config.option
        left = len(self.items())  # loads the matrix
        return nothing_selected(self.matrix_name, self.matrix_cases, len(self.backend_names),
                                left, getattr(opt, "keyword", ""),
                                getattr(opt, "markexpr", ""))

    def recorded_ids(self) -> set[tuple[str, str]]:
        return results_file.recorded_items(self.results)

    def item_of(self, nodeid: str) -> MatrixItem | None:
        """The mla item a pytest node id names (None for other tests)."""
        if self._by_id is None:
            self._by_id = {it.id: it for it in self.items()} if _runs_the_suite(
                self.config) else {}
        return self._by_id.get(_param_id(nodeid))

    def progress(self) -> Progress:
        if self._progress is None:
            from collections import Counter

            since = time.time() - self.started  # the same start on Progress's clock
            self._progress = Progress(Counter((it.backend, it.case.op)
                                              for it in self.selected or self.items()),
                                      started=time.monotonic() - since)
        return self._progress

    @property
    def show_progress(self) -> bool:
        """Progress lines for runs of more than a handful of items (and never with -qq)."""
        n = len(self.selected or self.items())
        return n >= PROGRESS_MIN_ITEMS and self.config.get_verbosity() >= -1


def _param_id(nodeid: str) -> str | None:
    """The item id in a node id: `...test_mla[<id>]`, with xdist's `@<group>` suffix
    (--dist loadgroup) left out."""
    m = re.search(r"\[(.+)\](?:@[^\[\]]*)?$", nodeid)
    return m.group(1) if m else None


def _leave_out(path: str | None) -> set[tuple[str, str]]:
    # a fixed file, not the growing results file: every xdist worker must collect the same items
    if not path:
        return set()
    return {tuple(line.split("\t", 1)) for line in Path(path).read_text().splitlines() if line}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mla_item" not in metafunc.fixturenames:
        return
    state: _State = metafunc.config.stash[_STATE]
    params = [
        pytest.param(it, id=it.id, marks=[*(getattr(pytest.mark, m) for m in it.markers),
                                          pytest.mark.xdist_group(it.case.id)])
        for it in state.items()
    ]
    metafunc.parametrize("mla_item", params)


@pytest.fixture
def mla_state(request: pytest.FixtureRequest) -> _State:
    return request.config.stash[_STATE]


def check_item(item: MatrixItem, state: _State, node: pytest.Item) -> None:
    """Run one item, record its verdict, and turn it into a pytest outcome."""
    from mlacheck.harness import CaseResult, DeviceError, RunOptions, run
    from mlacheck.session import pytest_outcome
    from mlacheck.verdict import XPASS

    if state.device_poisoned:
        pytest.skip(f"device context poisoned by an earlier device error ({state.device_poisoned})")
    opts = RunOptions(state.device, state.request.golden,
                      not state.config.getoption("--mla-no-ideal"),
                      memory_wait_s=_memory_wait_s(state.config), share=True)
    backend = state.backend(item.backend)
    start = time.time()
    try:
        result = run(item.case, backend, opts)
    except DeviceError as e:  # the judge's CRASH verdict; this worker stops after recording it
        result = CaseResult(e.verdict)
        state.device_poisoned = item.case.id
    verdict, record = result.verdict, result.record()
    # when and in which worker it ran: a run's timeline (benchmarks/suite_throughput.py)
    record.update(nodeid=node.nodeid, wall=time.time() - start, device=state.device,
                  backend_spec=item.backend, started=start,
                  worker=os.environ.get("PYTEST_XDIST_WORKER", "main"))
    state.write(record)
    node.stash[_RECORDED] = True
    node.user_properties.append((STATUS_PROPERTY, verdict.status))  # for the controller
    if state.device_poisoned and is_worker(state.config):
        os._exit(DEVICE_ERROR_EXIT)  # xdist reports this item crashed and starts a new worker
    how = pytest_outcome(verdict.bucket, state.request.policy.allow_xpass)
    if how == "skipped":
        pytest.skip(verdict.reason)
    elif how == "xfailed":
        pytest.xfail(f"known failure: {verdict.known_failure}\n{verdict.summary()}")
    elif how == "failed" and verdict.bucket == XPASS:
        pytest.fail(f"XPASS {item.backend} {item.case.id}: the known failure "
                    f"{verdict.known_rule!r} passes; remove its rule from mlacheck/known.py "
                    "(or run with --allow-xpass)", pytrace=False)
    elif how == "failed":
        own = "\n(mlacheck's own error, not the kernel's)" if verdict.is_suite_error else ""
        pytest.fail(verdict.summary() + own, pytrace=False)


def _memory_wait_s(config: pytest.Config) -> float:
    """A wait for device memory ends well before pytest-timeout would call the item a hang."""
    from mlacheck import admission

    timeout = float(getattr(config.option, "timeout", None) or 0)
    return min(admission.WAIT_S, timeout / 2) if timeout > 0 else admission.WAIT_S


_RECORDED = pytest.StashKey[bool]()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A case's inputs are kept for the next backend of the same case (harness sharing); when
    the next test is anything else they are given back now. Seen in mlacheck's own test run:
    a worker kept the 98305-token decode's ~460 MB through every later, unrelated test."""
    here = _mla_param(item)
    if here is None or "mlacheck.harness" not in sys.modules:
        return
    following = _mla_param(nextitem) if nextitem is not None else None
    if following is None or following.case.id != here.case.id:
        sys.modules["mlacheck.harness"].release_shared()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """An mla item that errored before recording (timeout, harness error) still gets a line."""
    outcome = yield
    rep = outcome.get_result()
    mla = getattr(item, "callspec", None) and item.callspec.params.get("mla_item")
    if mla is None or rep.when != "call" or item.stash.get(_RECORDED, False):
        return
    if rep.failed:
        state: _State = item.config.stash[_STATE]
        msg = str(call.excinfo.value).splitlines()[0][:500] if call.excinfo else "error"
        state.write(_crash_record(state, mla, f"error outside the verdict: {msg}", item.nodeid))


@pytest.hookimpl(tryfirst=True)  # before junitxml and the terminal read report.node
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Controller (or the only process): progress lines; under xdist, a CRASH line for an
    item whose worker died under it, and no worker banner ("[gw0] linux -- Python ...")
    above each failure card."""
    config = _CONFIG.get("config")
    if config is None or is_worker(config):
        return
    state: _State = config.stash[_STATE]
    it = state.item_of(report.nodeid)
    if it is None:
        return
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    if hasattr(report, "node"):
        del report.node  # only the banner reads it
    if report.when == "???" and report.failed:  # its worker died under it
        line, reason = worker_died(state, it, str(getattr(gateway, "id", "") or ""))
        report.longrepr = line  # the failure card: the same one line
        if (it.backend, it.case.id) not in state.recorded_ids():
            state.write(_crash_record(state, it, reason, report.nodeid))
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            if getattr(tr, "_width_of_current_line", 0):  # after pytest's dots
                tr.write("\n")
            tr.write_line(line)
    finished = report.when in ("call", "???") or (report.when == "setup" and not report.passed)
    if finished:
        line = state.progress().record(it.backend, it.case.op, _progress_outcome(report))
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if line and tr is not None and state.show_progress:
            if getattr(tr, "_width_of_current_line", 0):  # after pytest's dots
                tr.write("\n")
            tr.write_line(line)


# The verdict's status, carried from the worker to the controller in the item's report (and
# into JUnit XML as a property): pytest's own outcome cannot tell a CRASH from a FAIL.
STATUS_PROPERTY = "mla_status"


def _progress_outcome(report: pytest.TestReport) -> str:
    """What the progress line counts this finished item as."""
    from mlacheck.verdict import CRASH, is_suite_error

    status = str(dict(report.user_properties).get(STATUS_PROPERTY, ""))
    if hasattr(report, "wasxfail"):
        return "known"
    if report.when == "???" or status == CRASH:  # "???": its worker died under it
        return "crashed"
    return "error" if is_suite_error(status) else report.outcome


_CONFIG: dict[str, pytest.Config] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG["config"] = session.config
    state = session.config.stash.get(_STATE, None)
    if state is not None:
        state._started = time.time()
    if not is_worker(session.config) and _runs_the_suite(session.config):
        _quiet_xdist_status(session.config)
    if is_worker(session.config) and state is not None:
        _fault_dumps_to_file(state, str(session.config.workerinput.get("workerid", "")))  # type: ignore[attr-defined]


# A worker's open fault-dump file (faulthandler writes to its descriptor when the process dies).
_FAULT_FILE: list[Any] = []


def fault_file(results: Path, worker: str) -> Path:
    """Where worker `worker` of a run writing `results` dumps its threads' stacks if it dies
    of a fatal error (a segfault or abort in a kernel)."""
    return results.with_name(f"{results.name}.{worker}.faults")


def _fault_dumps_to_file(state: _State, worker: str) -> None:
    """A worker that dies of a fatal error printed ~60 lines (every thread's stack, the loaded
    extension modules) into the run's output; they go to fault_file instead, and the
    controller's one line (worker_died) names it."""
    if not worker or state.results is None or not state.config.getoption("--mla-results"):
        return
    import faulthandler

    try:
        f = open(fault_file(state.results, worker), "w")  # noqa: SIM115 - open until the end
    except OSError:
        return
    faulthandler.enable(file=f, all_threads=True)
    _FAULT_FILE[:] = [f]


def worker_died(state: _State, item: MatrixItem, worker: str) -> tuple[str, str]:
    """(the terminal's line, the CRASH verdict's reason) for an item whose worker died under
    it: xdist said it in three places ("[gw0] node down: ...", "replacing crashed worker gw0",
    a failure card), with the worker's ~60-line fault dump between the progress dots."""
    how = state.nodes_down.get(worker, "")
    reason = f"worker crashed: {worker or 'a worker'} died while running it" + (
        f" ({how})" if how else "")
    dump = fault_file(state.results, worker) if state.results is not None and worker else None
    where = (f"; its fatal-error stacks: {dump}" if dump is not None and dump.exists()
             and dump.stat().st_size else "")
    line = (f"mlacheck: worker {worker or '?'} died" + (f" ({how})" if how else "")
            + f" while running {item.backend} {item.case.id}: CRASH{where}")
    return line, reason


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A collection that failed (in the controller: a worker's, which xdist forwards, or one
    whose items differ from the run's: mlacheck.scheduling) makes the run INCOMPLETE, whenever
    it came: a worker whose collection differs arrived after the others had run everything,
    and the run went green beside its printed ERROR (found in review of the early start)."""
    config = _CONFIG.get("config")
    if not report.failed or config is None or is_worker(config) or _STATE not in config.stash:
        return
    first = (str(report.longrepr).strip().splitlines() or ["no reason given"])[0][:200]
    config.stash[_STATE].collect_errors.append(
        f"INCOMPLETE: collecting {report.nodeid or 'the suite'} failed: {first}")


@pytest.hookimpl(trylast=True)  # after -k / -m deselected theirs
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """--mla-shard K/N: the items of the other shards are deselected (in every xdist worker
    alike: the partition is a pure function of the selection)."""
    state: _State = config.stash[_STATE]
    if not _runs_the_suite(config) or state.shard is None:
        return
    mine = state.in_shard([it for node in items if (it := _mla_param(node)) is not None])
    keep, other = [], []
    for node in items:
        it = _mla_param(node)
        (keep if it is None or it.case.id in mine else other).append(node)
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = keep


@pytest.hookimpl(tryfirst=True)  # a worker: before xdist sends its collection
def pytest_collection_finish(session: pytest.Session) -> None:
    """Without xdist: the selected items (after -k / -m) are what this run means to run.

    An xdist worker of a GPU run says which GPU it runs on here, after it collected and
    before the controller learns its collection (the scheduler reads it then): asking the
    GPU waits for the worker's CUDA context, and on 4 GPUs the 32 workers' contexts were
    made ~10.7 s into the run while their collections, which need no GPU, took 1.7 s after
    it when they waited for it (MLA_TRACE patch, 4x H200, 2026-11-27)."""
    if is_worker(session.config):
        info = session.config.workerinput  # type: ignore[attr-defined]
        if info.get(_GPU_DIR):
            _publish_gpu(session.config.stash[_STATE], Path(info[_GPU_DIR]),
                         str(info.get("workerid", "")))
        return
    state: _State = session.config.stash[_STATE]
    state.write_header([it.nodeid for it in session.items if _mla_param(it) is not None])


class _XdistHooks:
    """The xdist controller collects nothing itself: it learns the selection from a worker."""

    @staticmethod
    def pytest_testnodedown(node: Any, error: object) -> None:
        """Why a worker went down ("Not properly terminated"), for worker_died's line."""
        config = _CONFIG.get("config")
        if error and config is not None and _STATE in config.stash:
            config.stash[_STATE].nodes_down[str(node.gateway.id)] = str(error)

    @staticmethod
    @pytest.hookimpl(tryfirst=True)  # before xdist's own, which waits for the workers' exit
    def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
        """A run whose workers all finished waits WORKER_EXIT_WAIT_S for their processes to
        end, not xdist's 10 s: each has sent its last report and is leaving (_WorkerEnd);
        what is left is the driver freeing its CUDA context, one after another on the host.
        An interrupted or broken run, or one that keeps the slow exit (the knob), as before."""
        config = session.config
        if (is_worker(config) or not _runs_the_suite(config)
                or slow_exit_kept()
                or exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR)):
            return
        nodemanager = getattr(config.pluginmanager.get_plugin("dsession"), "nodemanager", None)
        if nodemanager is not None:
            nodemanager.EXIT_TIMEOUT = WORKER_EXIT_WAIT_S

    @staticmethod
    def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
        config = _CONFIG.get("config")
        if config is not None:
            config.stash[_STATE].write_header(list(ids))

    @staticmethod
    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        if config.getvalue("dist") != "loadgroup" or not _runs_the_suite(config):
            return None
        from mlacheck import footprint
        from mlacheck.scheduling import case_scheduler

        state: _State = config.stash[_STATE]
        need = {it.case.id: footprint.estimate(it.case).total for it in state.items()}
        sched = case_scheduler(config, log, need, state.gpu_dir)
        dsession = config.pluginmanager.get_plugin("dsession")
        if dsession is not None:
            _compare_collections_after_the_end(dsession, sched)
        return sched

    @staticmethod
    def pytest_configure_node(node: Any) -> None:
        """Workers re-read the command line (`--dist load`): say that groups are on, so they
        name items `<id>@<case>` as the loadgroup scheduler expects; where to say which
        GPU they run on (mlacheck.admission.publish_worker_gpu); and the expanded matrix."""
        if getattr(node.config.option, "dist", "") == "loadgroup":
            node.workerinput[_LOADGROUP] = True
        state = node.config.stash.get(_STATE, None)
        if state is not None and state.gpu_dir is not None:
            node.workerinput[_GPU_DIR] = str(state.gpu_dir)
        if state is not None and state.matrix_cache is not None:
            node.workerinput[_MATRIX_CACHE] = str(state.matrix_cache)


def _compare_collections_after_the_end(dsession: Any, sched: Any) -> None:
    """xdist drops a worker's collection that comes while the run shuts down (its
    worker_collectionfinish returns at once): the scheduler still compares it with the run's
    (scheduling.case_scheduler), so a slow worker whose collection differs makes the run
    INCOMPLETE whether it came before the last item was handed out, after it, or after the
    end (that one exited 0: gw1's differing collection held until gw0 had gone down)."""
    plain = dsession.worker_collectionfinish

    def worker_collectionfinish(node: Any, ids: Sequence[str]) -> None:
        if dsession.shuttingdown:
            sched.collection_after_the_end(node, ids)
        plain(node=node, ids=ids)

    dsession.worker_collectionfinish = worker_collectionfinish


class BackendsUsable:
    """Handed to pytest.main by `mlacheck run`, which asks in another process whether its
    backends are usable while pytest starts the workers (on one H100: importing torch and
    AITER was 9.3 s of the controller's time before the first worker started, 2026-11-27).
    The answer is awaited here, before anything is scheduled: a backend that is not usable
    runs nothing and writes nothing (`unusable` says why), nor does a check the caller left to
    that process and that failed (the answer's UsageError: `error`, exit 2); otherwise `then`
    (the fresh run's results file cleared) runs first, on an interrupt during the wait too."""

    def __init__(self, answer: Callable[[], dict[str, str]], then: Callable[[], None]) -> None:
        self.answer, self.then = answer, then
        self.unusable: dict[str, str] = {}
        self.error = ""  # the answer's UsageError: a check left to the probe failed (exit 2)
        self.asked = False

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool | None:
        self.asked = True
        try:
            self.unusable = self.answer()
        except UsageError as e:
            self.error = str(e)
        finally:
            if not (self.unusable or self.error):
                self.then()
        if not (self.unusable or self.error):
            return None  # xdist's loop runs the items
        state = session.config.stash.get(_STATE, None)
        if state is not None:
            state.refused = True
        return True


def _mla_param(item: pytest.Item) -> MatrixItem | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("mla_item") if callspec else None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The gate's exit code (mlacheck.session.outcome), from everything the results file holds
    (controller only; lines from before a `--resume` count, also when nothing was left to
    run). pytest keeps its usage errors."""
    config = session.config
    if is_worker(config) or not _runs_the_suite(config):
        return
    state: _State = config.stash[_STATE]
    if exitstatus == pytest.ExitCode.USAGE_ERROR or state.results is None or state.refused:
        return
    from mlacheck.session import outcome

    internal = exitstatus == pytest.ExitCode.INTERNAL_ERROR  # no verdict on the run: exit 7
    from mlacheck.selection import selected_by

    opt = config.option
    state.outcome = out = outcome(state.results, RunRequest() if internal else state.request,
                                  interrupted=exitstatus == pytest.ExitCode.INTERRUPTED,
                                  internal_error=internal, incomplete=state.collect_errors,
                                  selection=selected_by(getattr(opt, "keyword", ""),
                                                        getattr(opt, "markexpr", "")))
    session.exitstatus = out.code


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    from mlacheck.outcome import EXIT_NOTHING_COLLECTED, coverage_lines

    out = config.stash[_STATE].outcome
    if out is None:
        return
    tr = terminalreporter
    if out.code != EXIT_NOTHING_COLLECTED and out.coverage:
        tr.section("mlacheck coverage (per backend x op)")
        for line in coverage_lines(out.coverage):
            tr.write_line(line)
    if config.getoption("--mla-gate-by-caller"):
        return
    head, *reasons = session_gate_lines(config)
    tr.write_line(head, bold=True, red=out.code != 0, green=out.code == 0)
    for line in reasons:
        tr.write_line(line)


def session_gate_lines(config: pytest.Config | None) -> list[str]:
    """The gate's lines of a finished session ([] when it has no gate: a usage error); a run
    that selected nothing says what left nothing."""
    from mlacheck.outcome import EXIT_NOTHING_COLLECTED, gate_lines

    state = config.stash.get(_STATE, None) if config is not None else None
    out = state.outcome if state is not None else None
    if out is None:
        return []
    if out.code == EXIT_NOTHING_COLLECTED:
        return gate_lines(out, state.why_nothing_selected())
    return gate_lines(out)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is not None and state.gpu_dir is not None:
        import shutil

        shutil.rmtree(state.gpu_dir, ignore_errors=True)
    if state is not None and state.matrix_cache is not None:
        state.matrix_cache.unlink(missing_ok=True)
    if state is not None and state.temporary_results and not is_worker(config):
        state.results.unlink(missing_ok=True)
        os.environ.pop(_PRIVATE_RESULTS_ENV, None)
    if state is not None and state.results is not None and not is_worker(config):
        for dump in state.results.parent.glob(fault_file(state.results, "*").name):
            if not dump.stat().st_size:  # the workers that did not die: nothing to keep
                dump.unlink(missing_ok=True)


def _crash_record(state: _State, item: MatrixItem, reason: str, nodeid: str) -> dict[str, Any]:
    import json

    from mlacheck.judge import with_known_label
    from mlacheck.verdict import CRASH, Verdict

    case, backend = item.case, item.backend
    v = with_known_label(Verdict(case.id, state.name_of(backend), case.op, CRASH, reason,
                                 case=json.loads(case.to_json())), case)
    d = v.to_dict()
    d.update(nodeid=nodeid, backend_spec=backend)
    return d
