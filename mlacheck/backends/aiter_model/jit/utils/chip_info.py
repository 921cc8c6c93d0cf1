"""Model of `aiter.jit.utils.chip_info`: the chip the model pretends to be.

AITER asks rocminfo; the model has no GPU to ask, so the chip comes from the environment:
`MLACHECK_AITER_MODEL_GFX` (gfx942 = MI300, the default; gfx950 = MI355) and `CU_NUM`
(AITER's own override of the compute-unit count). Both are read on every call (AITER caches
them per process) so one test process can model both chips.
"""

from __future__ import annotations

import os

GFX_ENV = "MLACHECK_AITER_MODEL_GFX"
CU_ENV = "CU_NUM"  # the variable AITER's get_cu_num() honours
SUPPORTED_GFX = ("gfx942", "gfx950")
DEFAULT_GFX = "gfx942"
# A real MI300X has 304 CUs and an MI355X 256. The model defaults to a handful so that the
# small batches a CPU test can afford still have more work than CUs: the v1.2 planner then
# splits KV across CUs and the partial / reduce paths run, as they do on a GPU with large
# batches and long contexts.
DEFAULT_CU_NUM = 8


def get_gfx() -> str:
    """The modelled chip (env MLACHECK_AITER_MODEL_GFX, default gfx942)."""
    gfx = os.environ.get(GFX_ENV, DEFAULT_GFX).strip() or DEFAULT_GFX
    if gfx not in SUPPORTED_GFX:
        raise RuntimeError(f"{GFX_ENV}={gfx!r}: the AITER model knows {', '.join(SUPPORTED_GFX)}")
    return gfx


def get_gfx_runtime() -> str:
    return get_gfx()


def get_cu_num() -> int:
    """Compute units of the modelled chip (env CU_NUM, default DEFAULT_CU_NUM)."""
    raw = os.environ.get(CU_ENV, "0").strip() or "0"
    try:
        cu = int(raw)
    except ValueError:
        raise RuntimeError(f"{CU_ENV}={raw!r} is not an integer") from None
    if cu < 0:
        raise RuntimeError(f"{CU_ENV}={cu} must be >= 0")
    return cu if cu > 0 else DEFAULT_CU_NUM
