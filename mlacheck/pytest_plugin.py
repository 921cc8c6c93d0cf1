"""pytest is the driver: each (case, backend) of a matrix is one test item.

Options: --mla-backend (repeatable), --mla-matrix, --mla-device, --mla-golden, --mla-results,
--mla-seed. Results: one JSON line per item, appended and flushed as it finishes, by the
process that ran it, so nothing is lost if a run dies. Under pytest-xdist each worker gets
one GPU (HIP/CUDA_VISIBLE_DEVICES set before the device is touched); a worker killed by a
crash is replaced by xdist and the controller records that item as CRASH; after a
device-side error a worker exits, so no later case runs on a poisoned context.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

RESULT_KEY = "mla_verdict"
# Exit status of a worker that leaves after a device-side error (xdist replaces it).
DEVICE_ERROR_EXIT = 70


@dataclass(frozen=True)
class Item:
    backend: str
    case: Any  # mlacheck.spec.Case
    markers: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.backend}-{self.case.id}"


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("mlacheck", "MLA kernel validation")
    g.addoption("--mla-backend", action="append", default=None,
                help="backend name, entry-point name or pkg.mod:factory (repeatable)")
    g.addoption("--mla-matrix", default="smoke", help="matrix name or YAML path (default: smoke)")
    g.addoption("--mla-device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    g.addoption("--mla-golden", default="fp32", choices=("fp32", "fp64"), help="golden precision")
    g.addoption("--mla-results", default=None, help="append one JSON line per case here")
    g.addoption("--mla-seed", type=int, default=None, help="offset added to every case seed")
    g.addoption("--mla-no-ideal", action="store_true", help="skip the unquantised-input golden")
    g.addoption("--mla-leave-out", default=None,
                help="file of 'backend<TAB>case id' lines not to run (mlacheck run --resume)")


def pytest_configure(config: pytest.Config) -> None:
    for m in ("large_kv", "fp8", "persistent", "sparse", "multiseg", "gpu", "slow"):
        config.addinivalue_line("markers", f"{m}: mlacheck case marker")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        _map_worker_to_device(int(re.sub(r"\D", "", worker) or 0))
        _share_cpu_threads(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    config.stash[_STATE] = _State(config)


def _map_worker_to_device(index: int) -> None:
    """Worker gwN sees one GPU: the N-th (modulo) of those visible to the controller.

    Must run before the worker touches the device; torch initialises CUDA/HIP lazily.
    """
    for var in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        visible = os.environ.get(var)
        ids = [v for v in visible.split(",") if v] if visible else None
        if ids is None:
            count = _gpu_count()
            if not count:
                continue
            ids = [str(i) for i in range(count)]
        os.environ[var] = ids[index % len(ids)]


def _share_cpu_threads(workers: int) -> None:
    """xdist workers share the cores: each gets its share of torch's CPU threads."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, workers)))


def _gpu_count() -> int:
    """GPUs on the machine without initialising the CUDA/HIP context (nvidia-smi / /dev/dri)."""
    override = os.environ.get("MLACHECK_NUM_GPUS")
    if override:
        return int(override)
    kfd = Path("/sys/class/kfd/kfd/topology/nodes")
    if kfd.is_dir():  # ROCm: nodes with a non-zero gfx target are GPUs
        n = 0
        for node in kfd.iterdir():
            props = node / "properties"
            if props.is_file() and re.search(r"gfx_target_version\s+[1-9]", props.read_text()):
                n += 1
        if n:
            return n
    nv = Path("/proc/driver/nvidia/gpus")
    return len(list(nv.iterdir())) if nv.is_dir() else 0


_STATE = pytest.StashKey["_State"]()


class _State:
    """Options resolved once per process; backends instantiated once per process (a reused
    instance keeps its persistent buffers across cases, as a serving engine does)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._backends: dict[str, Any] = {}
        self._items: list[Item] | None = None
        path = config.getoption("--mla-results")
        self.results = Path(path) if path else None
        if self.results is not None:
            self.results.parent.mkdir(parents=True, exist_ok=True)
        self.device_poisoned: str | None = None

    @property
    def backend_names(self) -> list[str]:
        from mlacheck.backends.registry import DEFAULT_BACKEND

        return self.config.getoption("--mla-backend") or [DEFAULT_BACKEND]

    def backend(self, name: str) -> Any:
        if name not in self._backends:
            from mlacheck.backends.registry import resolve

            self._backends[name] = resolve(name)
        return self._backends[name]

    @property
    def device(self) -> str:
        dev = self.config.getoption("--mla-device")
        if dev == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return dev

    def items(self) -> list[Item]:
        if self._items is None:
            from mlacheck.backends.registry import BackendError
            from mlacheck.matrices import MatrixError, load

            try:
                for b in self.backend_names:
                    self.backend(b)
                matrix = load(self.config.getoption("--mla-matrix"), self.config.getoption("--mla-seed"))
            except (BackendError, MatrixError, ValueError) as e:
                raise pytest.UsageError(str(e)) from None
            leave_out = _leave_out(self.config.getoption("--mla-leave-out"))
            self._items = [Item(b, mc.case, tuple(mc.markers)) for b in self.backend_names
                           for mc in matrix.cases if (b, mc.case.id) not in leave_out]
        return self._items

    def write(self, record: dict[str, Any]) -> None:
        """Append one JSON line with a single write on an O_APPEND fd (atomic between workers)."""
        if self.results is None:
            return
        line = (json.dumps(record, default=str, sort_keys=True) + "\n").encode()
        fd = os.open(self.results, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def recorded_ids(self) -> set[tuple[str, str]]:
        return recorded_items(self.results)


def _leave_out(path: str | None) -> set[tuple[str, str]]:
    # a fixed file, not the growing results file: every xdist worker must collect the same items
    if not path:
        return set()
    return {tuple(line.split("\t", 1)) for line in Path(path).read_text().splitlines() if line}


def recorded_items(results: Path | None) -> set[tuple[str, str]]:
    """(backend, case id) of every item a results file has a line for (a torn last line from
    a killed run is ignored: that item runs again)."""
    if results is None or not results.exists():
        return set()
    seen = set()
    for line in results.read_text().splitlines():
        try:
            d = json.loads(line)
            seen.add((d.get("backend", ""), d.get("case_id", "")))
        except json.JSONDecodeError:
            continue
    return seen


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mla_item" not in metafunc.fixturenames:
        return
    state: _State = metafunc.config.stash[_STATE]
    params = [
        pytest.param(it, id=it.id, marks=[getattr(pytest.mark, m) for m in it.markers])
        for it in state.items()
    ]
    metafunc.parametrize("mla_item", params)


@pytest.fixture
def mla_state(request: pytest.FixtureRequest) -> _State:
    return request.config.stash[_STATE]


def check_item(item: Item, state: _State, node: pytest.Item) -> None:
    """Run one item, record its verdict, and turn it into a pytest outcome."""
    from mlacheck.harness import DeviceError, RunOptions, run_case
    from mlacheck.judge import CRASH, FAIL, SKIP, Verdict

    if state.device_poisoned:
        pytest.skip(f"device context poisoned by an earlier device error ({state.device_poisoned})")
    opts = RunOptions(state.device, state.config.getoption("--mla-golden"),
                      not state.config.getoption("--mla-no-ideal"))
    backend = state.backend(item.backend)
    start = time.time()
    try:
        verdict = run_case(item.case, backend, opts)
    except DeviceError as e:
        verdict = Verdict(item.case.id, item.backend, item.case.op, CRASH, f"device error: {e}")
        state.device_poisoned = item.case.id
    known = known_failure(item.backend, item.case.id)
    if known and verdict.status in (FAIL, CRASH):
        verdict.known_failure = known
    record = verdict.to_dict()
    record.update(nodeid=node.nodeid, wall=time.time() - start, device=state.device)
    state.write(record)
    node.stash[_RECORDED] = True
    if state.device_poisoned and os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(DEVICE_ERROR_EXIT)  # xdist reports this item crashed and starts a new worker
    if verdict.status == SKIP:
        pytest.skip(verdict.reason)
    if known and verdict.status in (FAIL, CRASH):
        pytest.xfail(f"known failure: {known}\n{verdict.summary()}")
    if verdict.status in (FAIL, CRASH):
        pytest.fail(verdict.summary(), pytrace=False)


_RECORDED = pytest.StashKey[bool]()


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
        state.write(_crash_record(mla.backend, mla.case, f"error outside the verdict: {msg}", item.nodeid))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """xdist controller: record a CRASH line for an item whose worker died under it."""
    if report.when != "???" or not report.failed:
        return
    config = _CONFIG.get("config")
    if config is None:
        return
    state: _State = config.stash[_STATE]
    m = re.search(r"\[(.+)\]$", report.nodeid)
    if not m:
        return
    by_id = {it.id: it for it in state.items()}
    it = by_id.get(m.group(1))
    if it is None or (it.backend, it.case.id) in state.recorded_ids():
        return
    msg = str(report.longrepr).strip().splitlines()
    reason = "worker crashed: " + (msg[0] if msg else "no output")
    state.write(_crash_record(it.backend, it.case, reason, report.nodeid))


_CONFIG: dict[str, pytest.Config] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG["config"] = session.config


def _crash_record(backend: str, case: Any, reason: str, nodeid: str) -> dict[str, Any]:
    from mlacheck.judge import CRASH, Verdict

    v = Verdict(case.id, backend, case.op, CRASH, reason, case=json.loads(case.to_json()))
    d = v.to_dict()
    d["nodeid"] = nodeid
    return d


def known_failure(backend: str, case_id: str) -> str | None:
    """A documented real kernel finding (references/known_failures.yaml): reported as KNOWN."""
    from mlacheck.known import lookup

    return lookup(backend, case_id)
