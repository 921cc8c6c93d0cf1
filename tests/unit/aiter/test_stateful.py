"""One AITER adapter instance, over the AITER model, driven through changing batch shapes as a
serving engine drives it: the persistent-metadata buffers are kept across calls (reallocated
only when get_mla_metadata_info_v1 says they must grow) and refilled on every call. Every call
is judged by the harness and must PASS. A planted variant that reuses the schedule computed
for a previous batch shape (bug class 10) must be caught by the same machine."""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from _aiter_cases import GFX_ENV, describe, model_adapter, require_model  # noqa: I001
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mlacheck.backends.aiter import AiterAdapter, AiterApi, MetadataBuffers
from mlacheck.harness import run_case
from mlacheck.spec import DecodeCase, Request
from mlacheck.verdict import PASS

VERDICT_PREFIX = "harness verdict"
KV_LENGTHS = st.integers(1, 320)
RUN_SETTINGS = settings(
    max_examples=6, stateful_step_count=6, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow], phases=[Phase.generate], database=None)


class StaleMetadataAdapter(AiterAdapter):
    """Refills the schedule only when a buffer was reallocated: a smaller or merely different
    batch then runs on the metadata of an earlier one."""

    def fill_metadata(self, api: AiterApi, cache: MetadataBuffers,
                      bufs: dict[str, torch.Tensor], grew: bool,
                      fill_args: dict[str, Any]) -> None:
        if cache.fills and not grew:
            return
        super().fill_metadata(api, cache, bufs, grew, fill_args)


class PersistentBufferReuse(RuleBasedStateMachine):
    adapter_class: type[AiterAdapter] = AiterAdapter
    checks_refresh = True  # the correct adapter refills on every call

    def __init__(self) -> None:
        super().__init__()
        self.adapter = model_adapter(True, cls=self.adapter_class, name="aiter-model-stateful")
        self.kv_lens = [40, 200]
        self.q_len = 1
        self.page_size = 16
        self.calls = 0
        self.sizes_seen: list[tuple[int, ...]] = []
        self._run()

    # -- one call through the harness
    def _case(self) -> DecodeCase:
        reqs = tuple(Request(self.q_len, max(kv, self.q_len)) for kv in self.kv_lens)
        return DecodeCase(requests=reqs, num_heads=16, page_size=self.page_size)

    def _run(self) -> None:
        case = self._case()
        cache = self.adapter.metadata_buffers.get("dense")
        before = {n: tuple(t.shape) for n, t in cache.tensors.items()} if cache else {}
        allocations = cache.allocations if cache else 0
        v = run_case(case, self.adapter)
        self.calls += 1
        assert v.status == PASS, f"{VERDICT_PREFIX} on call {self.calls}: {describe([v])}"
        if not self.checks_refresh:
            return
        cache = self.adapter.metadata_buffers["dense"]
        assert cache.fills == self.calls, "the schedule was not refilled on every call"
        # reallocated only when some buffer had to grow
        grew = cache.allocations > allocations
        if before and not grew:
            assert {n: tuple(t.shape) for n, t in cache.tensors.items()} == before

    # -- rules
    @rule(extra=st.lists(KV_LENGTHS, min_size=1, max_size=12))
    def grow_batch(self, extra: list[int]) -> None:
        self.kv_lens = self.kv_lens + extra
        self._run()

    @precondition(lambda self: len(self.kv_lens) > 1)
    @rule(data=st.data())
    def shrink_batch(self, data: st.DataObject) -> None:
        keep = data.draw(st.integers(1, len(self.kv_lens) - 1), label="keep")
        self.kv_lens = self.kv_lens[:keep]
        self._run()

    @rule(q_len=st.integers(1, 4))
    def change_q_len(self, q_len: int) -> None:
        self.q_len = q_len
        self._run()

    @rule(page_size=st.sampled_from([1, 16, 64]))
    def change_page_size(self, page_size: int) -> None:
        self.page_size = page_size
        self._run()

    @rule(data=st.data())
    def change_kv_lengths(self, data: st.DataObject) -> None:
        n = len(self.kv_lens)
        self.kv_lens = data.draw(st.lists(KV_LENGTHS, min_size=n, max_size=n), label="kv_lens")
        self._run()

    @invariant()
    def buffers_hold_the_last_schedule(self) -> None:
        cache = self.adapter.metadata_buffers.get("dense")
        assert cache is not None and set(cache.tensors) == {
            "work_metadata_ptrs", "work_indptr", "work_info_set", "reduce_indptr",
            "reduce_final_map", "reduce_partial_map"}


class StaleMetadataReuse(PersistentBufferReuse):
    adapter_class = StaleMetadataAdapter
    checks_refresh = False


@pytest.fixture
def _modelled_gfx942(monkeypatch: pytest.MonkeyPatch) -> None:
    require_model()
    monkeypatch.setenv(GFX_ENV, "gfx942")
    monkeypatch.delenv("CU_NUM", raising=False)


@pytest.mark.usefixtures("_modelled_gfx942")
def test_one_adapter_through_changing_batch_shapes() -> None:
    run_state_machine_as_test(PersistentBufferReuse, settings=RUN_SETTINGS)


@pytest.mark.usefixtures("_modelled_gfx942")
def test_stale_metadata_is_caught() -> None:
    with pytest.raises(AssertionError, match=VERDICT_PREFIX) as caught:
        run_state_machine_as_test(StaleMetadataReuse, settings=RUN_SETTINGS)
    assert "FAIL" in str(caught.value) or "CRASH" in str(caught.value)
