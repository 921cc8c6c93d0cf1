"""Shared helpers of the model-backed AITER adapter tests: the modelled chip, a CPU-feasible
premerge subset, and running cases through the harness."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import pytest

from mlacheck.backends.aiter import MODEL_MODULE, AiterAdapter
from mlacheck.harness import run_case
from mlacheck.spec import PIPELINE_OPS, Case, DecodeCase, PrefillCase, SparseDecodeCase
from mlacheck.verdict import Verdict

GFX_ENV = "MLACHECK_AITER_MODEL_GFX"  # the chip the AITER model pretends to be
REVISION_ENV = "MLACHECK_AITER_MODEL_REVISION"  # head (AITER main) or pr3606


def require_model() -> None:
    pytest.importorskip(MODEL_MODULE, reason="the AITER torch model is not in this checkout")
    pytest.importorskip(f"{MODEL_MODULE}.mla", reason="the AITER model has no mla module yet")


@contextmanager
def modelled_chip(monkeypatch: pytest.MonkeyPatch, gfx: str) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setenv(GFX_ENV, gfx)
        m.delenv("CU_NUM", raising=False)
        yield


def model_adapter(persistent: bool = True, cls: type[AiterAdapter] = AiterAdapter,
                  **kwargs: object) -> AiterAdapter:
    name = "aiter-model" if persistent else "aiter-model-nonpersistent"
    return cls(MODEL_MODULE, persistent=persistent, name=kwargs.pop("name", name),  # type: ignore[arg-type]
               devices=("cpu",), **kwargs)  # type: ignore[arg-type]


def cost(case: Case) -> int:
    """A rough CPU cost (score elements) used to keep the premerge subset fast."""
    if isinstance(case, PrefillCase):
        return sum(s.q_len * s.kv_len for s in case.segments) * case.num_heads
    if isinstance(case, SparseDecodeCase):
        return case.total_q * min(case.topk, max(r.kv_len for r in case.requests)) * case.num_heads
    if case.op in PIPELINE_OPS:  # the sparse path: every row against its unit's keys
        return sum(q * kv for q, kv in zip(case.q_lengths, case.kv_lengths, strict=True)) * case.num_heads
    assert isinstance(case, DecodeCase)
    return sum(r.q_len * r.kv_len for r in case.requests) * case.num_heads


def premerge_subset(max_cost: int = 1_500_000, stride: int = 1) -> list[Case]:
    """CPU-feasible cases of the premerge matrix (no >2 GB pools), or [] without the loader."""
    try:
        from mlacheck.matrices import load
    except ImportError:
        return []
    cases = [mc.case for mc in load("premerge").cases
             if "large_kv" not in mc.markers and cost(mc.case) <= max_cost]
    return cases[::stride]


def run_all(cases: Iterable[Case], backend: AiterAdapter) -> list[Verdict]:
    return [run_case(c, backend) for c in cases]


def describe(verdicts: Iterable[Verdict]) -> str:
    return "\n".join(f"{v.status} {v.case_id}: {v.reason}" for v in verdicts)
