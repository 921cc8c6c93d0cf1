"""The xdist scheduler of a matrix run (issue 27): longest case first, a worker's next case
only when it starts its last item, and each GPU handed only what fits beside what it runs.

On two H100s the nightly took longer than on one (114.7 s vs 99.7 s): workers waited 374 s
in all for device memory, each for the memory of its own GPU, while the other GPU could have
run the case. Here xdist's scheduler runs against fake workers on two fake GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlacheck import admission
from mlacheck.scheduling import case_scheduler, pick_unit


def test_pick_unit_takes_the_longest_that_fits_else_the_smallest() -> None:
    need = {"big": 60, "mid": 30, "small": 10}.__getitem__
    queue = ["big", "mid", "small"]
    assert pick_unit(queue, need, held=0, budget=100) == "big"
    assert pick_unit(queue, need, held=50, budget=100) == "mid"
    assert pick_unit(queue, need, held=95, budget=100) == "small"  # waits least
    assert pick_unit(queue, need, held=95, budget=None) == "big"  # no GPU: order only


class FakeNode:
    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True

    def __repr__(self) -> str:
        return self.gateway.id


class FakeConfig:
    def __init__(self, workers: int) -> None:
        self.option = SimpleNamespace(loadscopereorder=False, tx=[f"{workers}*popen"],
                                      dist="loadgroup")

    def getvalue(self, name: str) -> object:
        return getattr(self.option, name)

    def getoption(self, name: str) -> object:
        return getattr(self.option, name)


# case -> device memory it needs; the queue order is the collection's (longest first)
NEED = {"big1": 60, "big2": 60, "big3": 60, "big4": 60,
        **{f"small{i}": 10 for i in range(1, 9)}}


def _scheduler(tmp_path: Path, workers: int = 4):  # noqa: ANN202
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for w in range(workers):  # gw0, gw2 on GPU A; gw1, gw3 on GPU B (the plugin's modulo map)
        (gpus / f"gw{w}.json").write_text(json.dumps({"gpu": "AB"[w % 2], "budget": 100}))
    sched = case_scheduler(FakeConfig(workers), None, NEED, gpus)
    nodes = [FakeNode(f"gw{w}") for w in range(workers)]
    collection = [f"suite.py::test_mla[b-{case}]@{case}" for case in NEED]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes, collection


def _cases(node: FakeNode, collection: list[str]) -> list[str]:
    return [collection[i].rsplit("@", 1)[1] for i in node.sent]


def _held(sched, gpu: str) -> int:  # noqa: ANN001
    return sum(NEED[scope] for node, work in sched.assigned_work.items()
               if "AB"[int(node.gateway.id[2:]) % 2] == gpu
               for scope, unit in work.items() if not all(unit.values()))


def test_large_cases_spread_over_the_gpus_and_none_is_handed_to_wait(tmp_path: Path) -> None:
    sched, nodes, collection = _scheduler(tmp_path)
    first = {n.gateway.id: _cases(n, collection)[0] for n in nodes}
    assert first["gw0"] == "big1" and first["gw1"] == "big2"  # one large case per GPU
    assert first["gw2"].startswith("small") and first["gw3"].startswith("small")
    # every GPU holds no more than fits, while the large cases wait in the queue
    assert _held(sched, "A") <= 100 and _held(sched, "B") <= 100
    assert "big3" in sched.workqueue and "big4" in sched.workqueue
    # big1 finishes on gw0: gw0's next case is the next large one, now that it fits GPU A
    sched.mark_test_complete(nodes[0], collection.index("suite.py::test_mla[b-big1]@big1"))
    assert "big3" in _cases(nodes[0], collection) or "big3" in _cases(nodes[2], collection)
    assert _held(sched, "A") <= 100


def test_a_worker_gets_its_next_case_only_at_its_last_item(tmp_path: Path) -> None:
    """One item per case here: after the initial hand-out each worker holds its running case
    and one more (it needs the next item to finish the last), never a backlog."""
    sched, nodes, collection = _scheduler(tmp_path)
    for node in nodes:
        assert len(node.sent) == 2
    assert len(sched.workqueue) == len(NEED) - 2 * len(nodes)


def _cpu_scheduler():  # noqa: ANN202
    """Two workers without GPUs, both collected, the first hand-out done."""
    sched = case_scheduler(FakeConfig(2), None, NEED, None)
    nodes = [FakeNode("gw0"), FakeNode("gw1")]
    collection = [f"suite.py::test_mla[b-{case}]@{case}" for case in NEED]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes, collection


def test_without_gpus_the_queue_order_is_kept(tmp_path: Path) -> None:
    sched, nodes, collection = _cpu_scheduler()
    assert [_cases(n, collection) for n in nodes] == [["big1", "big3"], ["big2", "big4"]]


def test_workers_publish_their_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "gpu_key", lambda device: "GPU-1234")
    monkeypatch.setattr(admission, "budget_bytes", lambda device: 64 << 30)
    admission.publish_worker_gpu(tmp_path, "gw3", "cuda")
    admission.publish_worker_gpu(tmp_path, "gw4", "cpu")  # a CPU run publishes nothing
    (tmp_path / "gw9.json").write_text("{not json")
    assert admission.worker_gpus(tmp_path) == {"gw3": ("GPU-1234", 64 << 30)}


def test_two_crashed_workers_and_their_replacements_keep_the_run_going() -> None:
    """xdist replaces a crashed worker with a new one that collects first; when two
    replacements exist and one reports, scheduling must not hand work to the other before
    its collection is in (it raised KeyError: INTERNALERROR, the H100 nightly ended after
    two kernel crashes, 2026-11-26)."""
    sched, nodes, collection = _cpu_scheduler()
    crashed = [sched.remove_node(n) for n in nodes]  # both die on their first item
    assert all(c is not None for c in crashed)
    fresh = [FakeNode("gw2"), FakeNode("gw3")]
    for node in fresh:
        sched.add_node(node)
    sched.add_node_collection(fresh[0], collection)
    sched.schedule()  # gw3 has not collected yet
    assert fresh[0].sent and not fresh[1].sent
    sched.add_node_collection(fresh[1], collection)
    sched.schedule()
    assert fresh[1].sent
    ran = {collection[i] for n in fresh for i in n.sent}
    assert not ran & set(crashed)  # the items the workers died under are not run again


def test_a_crashed_workers_next_case_goes_back_to_the_head_of_the_queue() -> None:
    """A worker holds two cases (the one it runs and the next); when it dies under the first,
    the second goes out next, not after everything else (4 GPUs: it ended the run last)."""
    sched, nodes, collection = _cpu_scheduler()
    gw0 = nodes[0]
    held = _cases(gw0, collection)
    assert len(held) >= 2
    sched.remove_node(gw0)
    queue = list(sched.workqueue)
    assert queue[0].endswith(held[1]), (held, queue[:3])


# --------------------------------------------------------------------------- early start
# xdist hands out nothing until every worker has collected: on one H100 (8 workers, the
# nightly) workers finished collecting 15.4 s to 18.2 s after the start, and all got their
# first item at 18.21 s. The scheduler starts at the first collection instead.


def _arrive(sched, node: FakeNode, collection: list[str]) -> None:  # noqa: ANN001
    """What xdist's DSession.worker_collectionfinish does with a worker's collection."""
    sched.add_node_collection(node, collection)
    if sched.collection_is_completed:
        sched.schedule()


def _run_all(sched, node: FakeNode) -> None:  # noqa: ANN001
    """The worker runs everything it was sent, and what it is sent meanwhile."""
    done = 0
    while done < len(node.sent):
        sched.mark_test_complete(node, node.sent[done])
        done += 1


def _joined(workers: int, reports: list | None = None):  # noqa: ANN202
    """CPU workers that have all started, none collected yet."""
    config = FakeConfig(workers)
    config.hook = SimpleNamespace(pytest_collectreport=lambda report: reports.append(report))
    sched = case_scheduler(config, None, NEED, None)
    nodes = [FakeNode(f"gw{w}") for w in range(workers)]
    for node in nodes:
        sched.add_node(node)
    return sched, nodes, [f"suite.py::test_mla[b-{case}]@{case}" for case in NEED]


def test_work_goes_out_at_the_first_collection_and_only_to_collected_workers() -> None:
    sched, (gw0, gw1, gw2), collection = _joined(3)
    _arrive(sched, gw1, collection)
    assert _cases(gw1, collection) == ["big1", "big2"]  # the longest first, two to start
    assert not gw0.sent and not gw2.sent  # still collecting: nothing for them
    assert not sched.tests_finished


def test_a_late_worker_gets_work_when_its_collection_arrives() -> None:
    sched, (gw0, gw1, gw2), collection = _joined(3)
    _arrive(sched, gw1, collection)
    sched.mark_test_complete(gw1, gw1.sent[0])  # gw1 runs on meanwhile
    assert _cases(gw1, collection) == ["big1", "big2", "big3"]
    _arrive(sched, gw2, collection)
    assert _cases(gw2, collection) == ["big4", "small1"]  # the same queue, in its order
    assert not gw0.sent
    _arrive(sched, gw0, collection)
    assert _cases(gw0, collection) == ["small2", "small3"]
    for node in (gw0, gw1, gw2):
        _run_all(sched, node)
    ran = [c for n in (gw0, gw1, gw2) for c in _cases(n, collection)]
    assert sorted(ran) == sorted(NEED)  # every case once
    assert sched.tests_finished and all(n.shutting_down for n in (gw0, gw1, gw2))


def test_a_late_collection_that_differs_gets_no_work_is_reported_and_ends_the_hand_out() -> None:
    reports: list = []
    sched, (gw0, gw1), collection = _joined(2, reports)
    _arrive(sched, gw0, collection)
    first = list(gw0.sent)
    _arrive(sched, gw1, collection[:-1])  # one item less
    assert not gw1.sent and gw1.shutting_down
    assert len(reports) == 1 and reports[0].failed and reports[0].nodeid == "gw1"
    why = str(reports[0].longrepr)
    assert "Different tests were collected between gw0 and gw1" in why and "small8" in why
    assert not sched.workqueue  # the rest is not handed out: the run is INCOMPLETE
    _run_all(sched, gw0)
    assert gw0.sent == first and gw0.shutting_down and sched.tests_finished


def test_a_collection_after_the_end_is_compared_with_the_runs() -> None:
    """One that xdist drops (it came while the run shut down): refused if it differs, as a
    late one is; an identical one is nothing to report."""
    reports: list = []
    sched, (gw0, gw1, gw2), collection = _joined(3, reports)
    _arrive(sched, gw0, collection)
    _run_all(sched, gw0)
    assert sched.tests_finished
    sched.collection_after_the_end(gw1, collection)
    assert not reports and not gw1.shutting_down
    gw2.shutting_down = True  # xdist told every worker to stop
    sched.collection_after_the_end(gw2, collection[:-1])
    assert len(reports) == 1 and reports[0].failed and reports[0].nodeid == "gw2"
    assert "Different tests were collected between gw0 and gw2" in str(reports[0].longrepr)


def test_fewer_cases_than_workers() -> None:
    sched, (gw0, gw1, gw2), _ = _joined(3)
    one = ["suite.py::test_mla[b-big1]@big1", "suite.py::test_mla[c-big1]@big1"]
    _arrive(sched, gw2, one)
    assert gw2.sent == [0, 1] and gw2.shutting_down  # all of it, then told to stop
    _arrive(sched, gw0, one)
    assert not gw0.sent and gw0.shutting_down  # nothing left: it stops
    _run_all(sched, gw2)
    assert sched.tests_finished  # gw1 never collected: the run still ends
    assert sched.remove_node(gw1) is None and sched.remove_node(gw0) is None


def test_all_work_done_before_a_slow_worker_collects_ends_the_run() -> None:
    sched, (gw0, gw1), collection = _joined(2)
    _arrive(sched, gw0, collection)
    _run_all(sched, gw0)
    assert sorted(_cases(gw0, collection)) == sorted(NEED)
    assert sched.tests_finished  # xdist then shuts every worker down, gw1 included
    assert sched.remove_node(gw1) is None  # and it leaves with nothing pending


def test_late_workers_on_gpus_get_what_fits_their_gpu(tmp_path: Path) -> None:
    """The GPU pick is the same for a worker that collects late, and a worker whose GPU file
    appears only after the first hand-out is read when its collection arrives."""
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for w in (0, 1):  # gw0 on GPU A, gw1 on GPU B; gw2 (A) publishes later
        (gpus / f"gw{w}.json").write_text(json.dumps({"gpu": "AB"[w], "budget": 100}))
    sched = case_scheduler(FakeConfig(3), None, NEED, gpus)
    gw0, gw1, gw2 = nodes = [FakeNode(f"gw{w}") for w in range(3)]
    collection = [f"suite.py::test_mla[b-{case}]@{case}" for case in NEED]
    for node in nodes:
        sched.add_node(node)
    _arrive(sched, gw0, collection)
    assert _cases(gw0, collection) == ["big1", "small1"]  # big2 would not fit beside big1
    assert not gw1.sent and not gw2.sent
    _arrive(sched, gw1, collection)
    assert _cases(gw1, collection) == ["big2", "small2"]  # GPU B: the next large case
    (gpus / "gw2.json").write_text(json.dumps({"gpu": "A", "budget": 100}))
    _arrive(sched, gw2, collection)
    assert _cases(gw2, collection) == ["small3", "small4"]  # A holds big1 + small1


# A worker whose collection comes in only after the other worker has run every item (it waits
# for their verdicts in the results file): with xdist's start nothing would run until then.
SLOW_COLLECTION = """
import json, os, time
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's worker sends its collection
def pytest_collection_finish(session):
    if getattr(session.config, "workerinput", {}).get("workerid") != "gw1":
        return
    results, deadline = Path(os.environ["MLA_RESULTS"]), time.time() + 60
    while time.time() < deadline:
        lines = results.read_text().splitlines() if results.exists() else []
        if lines and len(lines) - 1 >= len(json.loads(lines[0])["run"]["expected"]):
            return
        time.sleep(0.1)
"""
FOUR_CASES = """
name: four
description: four small decode cases
groups:
  - name: decode
    kind: decode
    base: {requests: [[1, 70], [2, 130]], page_size: 16, num_heads: 16}
    axes: {num_heads: [16, 32], page_size: [16, 64]}
"""


def _run_with(plugin: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`mlacheck run -n 2` on FOUR_CASES with a pytest plugin loaded in every process."""
    (tmp_path / "mlaplug.py").write_text(plugin)
    matrix, res = tmp_path / "four.yaml", tmp_path / "r.jsonl"
    matrix.write_text(FOUR_CASES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")])),
               PYTEST_ADDOPTS="-p mlaplug", MLA_RESULTS=str(res))
    r = subprocess.run([sys.executable, "-m", "mlacheck.cli", "run", "-b", "torch", "--matrix",
                        str(matrix), "-n", "2", "--no-report", "--results", str(res)],
                       capture_output=True, text=True, env=env, timeout=300)
    return r, res


def test_a_run_ends_cleanly_when_its_work_is_done_before_a_slow_worker_collects(
        tmp_path: Path) -> None:
    r, res = _run_with(SLOW_COLLECTION, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    header, *verdicts = (json.loads(line) for line in res.read_text().splitlines())
    assert len(header["run"]["expected"]) == 4
    assert [v["status"] for v in verdicts] == ["PASS"] * 4
    assert {v["worker"] for v in verdicts} == {"gw0"}  # all ran before gw1 had collected


# A plugin under which gw1 collects one item less than the others, and the controller says
# (a file beside the results) when it has refused gw1's collection.
GW1_COLLECTS_ONE_LESS = """
import json, os, time
from pathlib import Path

import pytest


def _worker(config):
    return getattr(config, "workerinput", {}).get("workerid")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    if _worker(config) == "gw1":
        del items[-1]


def pytest_collectreport(report):
    if report.failed and report.nodeid == "gw1":  # the controller refused gw1's collection
        _marker("refused").touch()


def _marker(event):  # the file beside the results that says `event` happened
    return Path(os.environ["MLA_RESULTS"] + "." + event)


def _until(path):  # until `path` is there (60 s: a safety net only)
    deadline = time.time() + 60
    while not path.exists() and time.time() < deadline:
        time.sleep(0.05)
"""
# gw1 collects one item less, and only once gw0's collection is in (the controller writes the
# run header then); gw0's first item waits until the controller has refused gw1's collection,
# so gw0 holds its first two cases and the other two are still in the queue then. (A 3 s
# sleep in gw0's first item instead raced: a gw1 that finished collecting over 3 s after gw0
# came once the queue was empty or the run was over; 4 s later, the run exited 0.)
DIFFERENT_LATE_COLLECTION = GW1_COLLECTS_ONE_LESS + """

@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    if _worker(session.config) == "gw1":
        _until(Path(os.environ["MLA_RESULTS"]))


def pytest_runtest_call(item):
    if _worker(item.config) == "gw0" and not getattr(item.config, "_waited", False):
        item.config._waited = True
        _until(_marker("refused"))
"""


def test_a_late_collection_that_differs_is_reported_and_the_run_is_incomplete(
        tmp_path: Path) -> None:
    """As xdist's own check: the run stops handing out work and is not a pass (exit 6);
    what the first worker was given before still ran."""
    r, res = _run_with(DIFFERENT_LATE_COLLECTION, tmp_path)
    assert r.returncode == 6, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ERROR collecting gw1" in r.stdout
    assert "Different tests were collected between gw0 and gw1" in r.stdout
    header, *verdicts = (json.loads(line) for line in res.read_text().splitlines())
    assert len(header["run"]["expected"]) == 4  # gw0's collection is the run's
    assert len(verdicts) == 2 and {v["worker"] for v in verdicts} == {"gw0"}  # its first two
    assert f"INCOMPLETE: {len(verdicts)} of 4 items have a verdict" in r.stdout


# gw1 collects one item less, and only once gw0 has started its third case: an xdist worker
# runs an item only once it holds the next one (or is told to stop), so by then the fourth is
# handed out too and the queue is empty; the third waits until the controller has refused
# gw1's collection, so the run is still going when it arrives. (Waiting for two verdicts
# instead raced: the worker writes a verdict before the controller hears the item is done and
# hands out the next case, and on the 2-core CI gw1's collection came first once: the queue
# was dropped with one case in it. So did 3 s sleeps in the last two cases in place of the
# wait: a collection that came after them was dropped with the run ending, exit 0.)
DIFFERENT_COLLECTION_AFTER_THE_HAND_OUT = GW1_COLLECTS_ONE_LESS + """
CALLS = []


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    if _worker(session.config) == "gw1":
        _until(_marker("third"))


def pytest_runtest_call(item):
    if _worker(item.config) == "gw0":
        CALLS.append(1)
        if len(CALLS) == 3:
            _marker("third").touch()
            _until(_marker("refused"))
"""


# gw1 collects one item less, and only once the controller has seen gw0 go down: gw0 has run
# every case then and the run is shutting down, where xdist drops a worker's collection.
DIFFERENT_COLLECTION_AFTER_THE_END = GW1_COLLECTS_ONE_LESS + """

def pytest_testnodedown(node, error):
    if node.gateway.id == "gw0":  # the controller: gw0 finished, the run is ending
        _marker("gw0-down").touch()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session):
    if _worker(session.config) == "gw1":
        _until(_marker("gw0-down"))
"""


@pytest.mark.parametrize(("plugin", "event"), [
    (DIFFERENT_COLLECTION_AFTER_THE_HAND_OUT, "third"),
    (DIFFERENT_COLLECTION_AFTER_THE_END, "gw0-down")], ids=["after-the-hand-out", "after-the-end"])
def test_a_collection_that_differs_after_the_hand_out_or_the_end_makes_the_run_incomplete(
        plugin: str, event: str, tmp_path: Path) -> None:
    """The same run is not a pass or not depending on when a worker's collection came: with
    every case handed out to gw0 when gw1's differing collection came, all 4 ran and the gate
    said exit 0 beside the printed ERROR; once gw0 had finished, xdist dropped the collection
    (it came while the run shut down) and the gate said exit 0 with no word of it."""
    r, res = _run_with(plugin, tmp_path)
    assert r.returncode == 6, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / f"r.jsonl.{event}").exists()  # gw1 waited for it, not for the deadline
    assert "ERROR collecting gw1" in r.stdout
    header, *verdicts = (json.loads(line) for line in res.read_text().splitlines())
    assert [v["status"] for v in verdicts] == ["PASS"] * 4  # all ran, on gw0
    assert {v["worker"] for v in verdicts} == {"gw0"}
    assert "INCOMPLETE: collecting gw1 failed: Different tests were collected" in r.stdout


def test_cases_a_known_failure_can_end_a_worker_on_go_first_then_longest_first() -> None:
    """The nightly's two AITER Triton indexer cases that can take their worker down (an
    illegal memory access) come before the longest case; without aiter-triton among the
    backends the order is the estimate's alone."""
    from mlacheck import cost
    from mlacheck.matrices import load
    from mlacheck.scheduling import case_order

    cases = load("nightly").cases
    backends = ["torch", "aiter-model", "aiter-triton"]
    order = [mc.case.id for mc in case_order(cases, backends, "cuda")]
    assert [i.split("-high")[0] for i in order[:2]] == ["pidx-b2-kv700-2100-h64-d128-p64-e4m3fn"] * 2
    longest = max(cases, key=lambda mc: cost.case_s(mc.case, backends, "cuda")).case.id
    assert order[2] == longest
    torch_only = [mc.case.id for mc in case_order(cases, ["torch"], "cuda")]
    assert torch_only[0] == max(cases, key=lambda mc: cost.case_s(mc.case, ["torch"], "cuda")).case.id
    assert not torch_only[0].startswith("pidx-")
