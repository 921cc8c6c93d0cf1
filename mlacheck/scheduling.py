"""How xdist hands matrix items to workers: a case's items to one worker, in order, and on
GPUs only where the case fits beside what already runs there.

Its inputs and references are then built once there for all its backends (mlacheck.harness
shares them). The pytest plugin installs this scheduler for `--dist load` runs of the suite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def case_order(cases: Sequence[Any], backends: Sequence[str], device: str) -> list[Any]:
    """The order a run hands its cases (matrix cases) out in: longest first by estimated time
    (mlacheck.cost: the long cases start first, and workers do not wait at the end for one
    that started last), and before them the cases a known failure can end a worker on (its
    replacement then starts early, not in the run's last seconds: on 4 GPUs the two such
    cases of the nightly ran 27.5-28.2 s into a 49.6 s run and their replacements ended it,
    4x H200, 2026-11-27)."""
    from mlacheck import cost
    from mlacheck.known import can_end_a_worker

    return sorted(cases, key=lambda mc: (not can_end_a_worker(mc.case, backends),
                                         -cost.case_s(mc.case, list(backends), device),
                                         mc.case.id))


def pick_unit(queue: list[str], need: Callable[[str], int], held: int, budget: int | None) -> str:
    """The next case for a worker of a GPU on which cases holding `held` bytes run: the first
    (longest) in the queue that fits beside them in `budget`; if none does, the one that needs
    least (it waits for room the shortest). Without a budget (CPU, or unknown): the first."""
    if budget is None:
        return queue[0]
    for scope in queue:
        if held + need(scope) <= budget:
            return scope
    return min(queue, key=need)


def case_scheduler(config: Any, log: Any, need: dict[str, int],
                   gpu_dir: Path | None) -> Any:
    """xdist's loadgroup scheduling (a case's items to one worker, in order), with these
    changes. `need`: each case's device memory (footprint.estimate) by case id; `gpu_dir`:
    where the workers publish their GPU (None: no GPUs).

    - The queue keeps the collection's order (longest case first, mlacheck.cost), and a
      worker gets its next case only when it starts the last item of the one it has (xdist
      hands it over when at most 2 items are left): a long case is not committed to a worker
      still busy with another.
    - GPU memory: each worker publishes its GPU and budget (mlacheck.admission); a worker gets
      the longest case that fits its GPU beside the cases already handed to that GPU's
      workers (pick_unit), so no worker is given a case to wait for while another GPU has
      room for it, and the large cases spread over the GPUs.
    - Work goes out as soon as the first worker's collection is in, and to each worker when
      its own arrives (xdist waits for every worker's: on one H100, 8 workers, the nightly,
      workers finished collecting 15.4 s to 18.2 s after the start and all got their first
      item at 18.21 s; with 34 workers on 4 GPUs the spread is larger). The first collection
      is the run's (the run header is written from it too, pytest_plugin.write_header); a
      later one that differs gets no work, is reported as xdist reports it (a failed collect
      report, "Different tests collected") and ends the hand-out: the queue is dropped, so
      what was not handed out is missing from the results (INCOMPLETE), as xdist's own
      check aborts a run; so is one that came after the last item, as the run ended
      (collection_after_the_end). A worker replacing a crashed one is a late worker like any
      other.
    - The item a worker died under is not run again: loadscope puts the whole unfinished
      group back, the crashed item included, so a kernel that aborts the process would take
      down one worker after another (the item is recorded as CRASH).
    """
    from xdist.scheduler import LoadGroupScheduling

    from mlacheck import admission

    class CaseScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def __init__(self, config: Any, log: Any) -> None:
            super().__init__(config, log)
            self._gpus: dict[str, tuple[str, int]] | None = None
            self.refused = False  # a worker's collection differed: nothing more goes out

        @staticmethod
        def need(scope: str) -> int:
            return need.get(scope, 0)

        def gpus(self) -> dict[str, tuple[str, int]]:
            """{worker id: (GPU, budget)}, read again while a collected worker (a late one, or
            one replacing a crashed one) has not been seen (a worker publishes before it
            sends its collection: pytest_plugin.pytest_collection_finish)."""
            if gpu_dir is None:
                return {}
            if self._gpus is None or any(n.gateway.id not in self._gpus
                                         for n in self.registered_collections):
                self._gpus = admission.worker_gpus(gpu_dir)
            return self._gpus

        def _assign_work_unit(self, node: Any) -> None:
            gpus = self.gpus()
            mine = gpus.get(node.gateway.id)
            if mine is not None and len(self.workqueue) > 1:
                gpu, budget = mine
                held = sum(self.need(scope) for other, work in self.assigned_work.items()
                           if gpus.get(other.gateway.id, ("",))[0] == gpu
                           for scope, unit in work.items() if not all(unit.values()))
                scope = pick_unit(list(self.workqueue), self.need, held, budget)
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        @property
        def collection_is_completed(self) -> bool:
            """Enough to schedule: one worker's collection (xdist: every initial worker's)."""
            return bool(self.registered_collections)

        def ready(self) -> list[Any]:
            """The workers whose collection is in, in the order they joined."""
            return [n for n in self.nodes if n in self.registered_collections]

        def add_node_collection(self, node: Any, collection: Sequence[str]) -> None:
            assert node in self.assigned_work
            if self.collection is None:  # before the first hand-out: schedule() compares
                self.registered_collections[node] = list(collection)
                return
            if list(collection) != self.collection:
                self.refuse(node, collection)
                return
            self.registered_collections[node] = list(collection)

        def refuse(self, node: Any, collection: Sequence[str]) -> None:
            """A worker that collected other items than the run's: no work for it, a failed
            collect report naming the difference, and nothing more handed out."""
            import pytest
            from xdist.report import report_collection_diff

            first = next(iter(self.registered_collections))
            msg = report_collection_diff(self.collection, list(collection),
                                         first.gateway.id, node.gateway.id)
            self.log(msg)
            self.log("**Different tests collected, aborting run**")
            self.config.hook.pytest_collectreport(report=pytest.CollectReport(
                nodeid=node.gateway.id, outcome="failed", longrepr=msg, result=[]))
            self.refused = True
            self.workqueue.clear()
            if not node.shutting_down:
                node.shutdown()

        def collection_after_the_end(self, node: Any, collection: Sequence[str]) -> None:
            """A worker's collection that came once the run was ending (xdist drops it:
            DSession.worker_collectionfinish returns while shutting down): one that differs
            from the run's is refused as one that came earlier, so whether the run is a pass
            does not depend on when a slow worker's collection arrived."""
            if self.collection is not None and list(collection) != self.collection:
                self.refuse(node, collection)

        def schedule(self) -> None:
            """The first call builds the queue (xdist's) from the collections in so far and
            starts the workers that have one; later calls start a worker whose collection
            just arrived and top up the others."""
            assert self.collection_is_completed
            if self.collection is None:
                if not self._check_nodes_have_same_collection():
                    self.log("**Different tests collected, aborting run**")
                    return
                self.collection = list(next(iter(self.registered_collections.values())))
                if not self.collection:
                    return
                for nodeid in self.collection:  # the collection's order (plugin: no reorder)
                    unit = self.workqueue.setdefault(self._split_scope(nodeid), {})
                    unit[nodeid] = False
            # twice, as xdist's first hand-out: a worker starts with two cases where it can
            # (#277; a worker runs an item only once it has the next one or is told to stop)
            for _ in range(2):
                for node in self.ready():
                    self._reschedule(node)
            if not self.workqueue:  # all handed out: the workers may finish their last item
                for node in self.ready():
                    if not node.shutting_down:
                        node.shutdown()

        def _reschedule(self, node: Any) -> None:
            if node not in self.registered_collections:
                # still collecting (a late worker, or one replacing a crashed one), or its
                # collection differed: xdist would hand a replacement work when another one
                # reports (KeyError, INTERNALERROR: the run ended after two kernel crashes,
                # nightly on the H100); it gets work when its own collection arrives
                return
            if (not node.shutting_down and self.workqueue
                    and self._pending_of(self.assigned_work[node]) > 1):
                return  # more than its last item still to run: no next case yet
            super()._reschedule(node)

        def remove_node(self, node: Any) -> str | None:
            workload = self.assigned_work.pop(node)
            pending = [nid for unit in workload.values() for nid, done in unit.items() if not done]
            if not pending:
                return None
            crashed = pending[0]
            for unit in workload.values():
                if crashed in unit:
                    unit[crashed] = True
            if not self.refused:  # back at the head, in their order: they were handed out
                # early for a reason (longest first); xdist's order (appended) ran the case
                # after the crash case last, and a 3.4 s one ended the nightly on 4 GPUs
                # 3.2 s after every other worker (started 25.7 s into 29.1 s, 2026-11-27)
                back = [(scope, unit) for scope, unit in workload.items()
                        if not all(unit.values())]
                self.workqueue.update(back)
                for scope, _ in reversed(back):
                    self.workqueue.move_to_end(scope, last=False)
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return CaseScheduling(config, log)
