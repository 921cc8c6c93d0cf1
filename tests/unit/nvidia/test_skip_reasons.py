"""Every SKIP a real backend gives on the H100 is a kernel limit that names its source, or an
adapter omission this file lists (issue 32).

The adapters run against the CPU fakes (FlashInfer 0.2.14 and 0.7, FlashMLA, DeepGEMM) or with
their loader stubbed (aiter-triton, as compiled for sm_90), on an sm_90 GPU as far as the
adapters can tell, over every case of the premerge and nightly matrices (seed 0). The AITER
ASM adapter (ROCm only) runs over mlacheck's model of AITER's API: the same capabilities the
real adapter computes on gfx950 / gfx942, persistent and not. A kernel
limit's reason must name where it was read (a file of the kernel library, `path.ext[:line]`) or
say it was measured; a SKIP the coverage table counts as the adapter's must be in
ADAPTER_OMISSIONS (and each listed omission must still occur, so the list stays true).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _nvidia_fakes import fake_deep_gemm, fake_flash_mla, fake_flashinfer, install  # noqa: I001  (test-local helper)

from mlacheck.backends import aiter_triton, deepgemm, flashinfer, flashmla
from mlacheck.backends import aiter_triton_compat as compat
from mlacheck.backends.aiter import adapter as aiter_asm
from mlacheck.backends.base import skip_reason
from mlacheck.report.coverage import ADAPTER, KERNEL, skip_class

H100_ARCH = (9, 0)
H100_SMEM_PER_SM = 233472
# A file of the kernel library (path.ext, optionally :line) or a measurement.
SOURCE = re.compile(r"[\w./-]+\.(?:py|cu|cuh|h|hpp|cpp|csv)\b|\bmeasured\b")

# (backend, op) -> what the adapter does not wire although the library has a kernel for it
# (docs/gpu-results.md lists them with the reason they stay).
ADAPTER_OMISSIONS: dict[tuple[str, str], str] = {}  # none left (issue 32)

# Libraries of one kind of kernel: the ops of another kind are not theirs (DeepGEMM: GEMMs and
# the indexer logits, no attention), so "does not provide op" is the whole story there.
OTHER_KIND_OPS = {"deepgemm": "does not provide op"}


@pytest.fixture(scope="module")
def matrix_cases() -> list[Any]:
    from mlacheck.matrices.loader import load

    return [getattr(mc, "case", mc) for m in ("premerge", "nightly")
            for mc in load(m, seed=0).cases]


def _flashinfer(version: str, kernel: str) -> Callable[[pytest.MonkeyPatch], Any]:
    def make(mp: pytest.MonkeyPatch) -> Any:
        install(mp, fake_flashinfer(version=version))
        mp.setattr(flashinfer, "gpu_arch", lambda: H100_ARCH)
        mp.setattr(flashinfer, "smem_per_sm", lambda: H100_SMEM_PER_SM)
        return flashinfer.FlashInferBackend(kernel)
    return make


def _flashmla(mp: pytest.MonkeyPatch) -> Any:
    install(mp, {"flash_mla": fake_flash_mla()})
    return flashmla.FlashMLABackend()


def _deepgemm(mp: pytest.MonkeyPatch) -> Any:
    install(mp, {"deep_gemm": fake_deep_gemm(), "flash_mla": fake_flash_mla()})
    return deepgemm.factory()


def _aiter_triton(mp: pytest.MonkeyPatch) -> Any:
    """Every AITER entry point importable, as compiled for sm_90 (what the H100 runs)."""
    mp.setattr(aiter_triton, "load", lambda: aiter_triton.Loaded("e4048607a"))
    mp.setattr(compat, "compile_only", lambda: True)
    return aiter_triton.factory()


BACKENDS: dict[str, Callable[[pytest.MonkeyPatch], Any]] = {
    **{f"flashinfer{'' if k == 'fa2' else '-fa3'} {v}": _flashinfer(v, k)
       for v in ("0.2.14", "0.7") for k in ("fa2", "fa3")},
    "flashmla": _flashmla, "deepgemm": _deepgemm, "aiter-triton": _aiter_triton,
    "aiter gfx950": lambda mp: aiter_asm.model_gfx950_factory(),
    "aiter gfx942": lambda mp: aiter_asm.model_gfx942_factory(),
    "aiter non-persistent": lambda mp: aiter_asm.model_nonpersistent_factory(),
}


def _skips(backend: Any, cases: list[Any]) -> Iterator[tuple[str, str]]:
    backend.unavailable = lambda: None  # the machine's reasons are not the kernels'
    for case in cases:
        why = skip_reason(backend, case, "cuda")
        if why:
            yield str(case.op), why


@pytest.mark.parametrize("name", BACKENDS)
def test_every_skip_is_a_sourced_kernel_limit_or_a_listed_omission(
        monkeypatch: pytest.MonkeyPatch, matrix_cases: list[Any], name: str) -> None:
    backend = BACKENDS[name](monkeypatch)
    unsourced, unlisted, omitted = set(), set(), set()
    for op, why in _skips(backend, matrix_cases):
        cls = skip_class(why)
        if cls == KERNEL and not SOURCE.search(why):
            unsourced.add((op, why))
        elif cls == ADAPTER and OTHER_KIND_OPS.get(name, "\0") in why:
            continue
        elif cls == ADAPTER:
            (omitted if (name, op) in ADAPTER_OMISSIONS else unlisted).add(op)
        else:
            assert cls in (KERNEL, ADAPTER), (op, why)
    assert not unsourced, "kernel-limit SKIPs without a source:\n" + "\n".join(
        f"{op}: {why}" for op, why in sorted(unsourced))
    assert not unlisted, f"adapter SKIPs not listed as omissions: {sorted(unlisted)}"
    listed = {op for b, op in ADAPTER_OMISSIONS if b == name}
    assert listed == omitted, f"listed omissions that no longer occur: {sorted(listed - omitted)}"
