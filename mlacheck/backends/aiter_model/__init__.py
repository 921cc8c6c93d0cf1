"""mlacheck's executable torch *model* of AMD AITER's MLA API (not AITER itself).

It exposes the call surface of AITER main at commit AITER_COMMIT (`aiter` package names,
parameter names, defaults and return conventions) and computes in torch what AITER's
kernels are documented to compute, on CPU or GPU, deterministically:

- persistent decode metadata: `get_mla_metadata_info_v1`, `get_mla_metadata_v1` (v1.2
  planner), `mla_reduce_v1`, and `mla.mla_decode_fwd` (persistent and split-KV paths);
- FP8 persistent prefill: `get_ps_metadata_info_v1`, `get_ps_metadata_v1`,
  `mla_prefill_ps_asm_fwd`, `mla.mla_prefill_ps_fwd`;
- CK paged batch prefill: `mha_batch_prefill_func`;
- the DeepSeek-V3.2 indexer: `ops.triton.attention.fp8_mqa_logits.fp8_mqa_logits`,
  `ops.triton.attention.pa_mqa_logits.deepgemm_fp8_paged_mqa_logits` (Triton kernels) and
  the per-row top-k `top_k_per_row_prefill` / `top_k_per_row_decode`;
- the positions -> global slots kernels `ops.triton._triton_kernels.attention.
  sparse_attention_dsv4._compute_topk_lens_kernel` / `_pack_global_topk_ragged_kernel` (the
  entry point that launched them is not at AITER_COMMIT: mlacheck.backends.aiter_conversion);
- `dtypes` (fp8 = the modelled chip's format) and `jit.utils.chip_info`.

The modelled chip is env MLACHECK_AITER_MODEL_GFX (gfx942 default, gfx950), its CU count
env CU_NUM (default 8, see chip_info). Env MLACHECK_AITER_MODEL_REVISION=pr3606 models
ROCm/aiter#3606 (final LSE of the FP8 prefill) instead of AITER main. docs: the module
docstrings of `_metadata`, `_kernels`, `_ps`, `_reduce` and `_mha` say what is modelled and
where the model deliberately differs.

Not AITER's: `plan_decode_metadata`, the v1.2 decode plan without buffers (what the adapter's
known-failure predicates replay), and the IS_MLACHECK_MODEL / VERSION_MARKER markers.
"""

from __future__ import annotations

from typing import Any

from mlacheck.backends.aiter_model import dtypes, mla
from mlacheck.backends.aiter_model._common import (
    AITER_COMMIT,
    AITER_DESCRIBE,
    PR_3606_COMMIT,
    REVISION_ENV,
    revision,
)
from mlacheck.backends.aiter_model._kernels import mla_decode_stage1_asm_fwd
from mlacheck.backends.aiter_model._metadata import (
    get_mla_decode_fwd_max_splits,
    get_mla_metadata_info_v1,
    get_mla_metadata_v1,
)
from mlacheck.backends.aiter_model._metadata import (
    plan_for as plan_decode_metadata,  # mlacheck's own: the v1.2 plan without buffers
)
from mlacheck.backends.aiter_model._mha import mha_batch_prefill_func
from mlacheck.backends.aiter_model._ps import get_ps_metadata_v1, mla_prefill_ps_asm_fwd
from mlacheck.backends.aiter_model._reduce import mla_reduce_v1
from mlacheck.backends.aiter_model._topk import top_k_per_row_decode, top_k_per_row_prefill
from mlacheck.backends.aiter_model.jit.utils import chip_info

IS_MLACHECK_MODEL = True
MODEL_OF = f"ROCm/aiter@{AITER_COMMIT}"
# PEP 440: AITER main's setuptools-scm version at that commit, tagged as the mlacheck model
__version__ = "0.1.21.dev46+ge4048607a5.mlacheck.model"
VERSION_MARKER = f"mlacheck torch model of AITER {AITER_DESCRIBE} ({AITER_COMMIT})"


def __getattr__(name: str) -> Any:
    # get_ps_metadata_info_v1 has AITER main's signature, or #3606's (max_kvlen,
    # kvlen_granularity) when MLACHECK_AITER_MODEL_REVISION=pr3606: looked up per access.
    if name == "get_ps_metadata_info_v1":
        from mlacheck.backends.aiter_model._ps import ps_info_function

        return ps_info_function()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AITER_COMMIT",
    "IS_MLACHECK_MODEL",
    "MODEL_OF",
    "PR_3606_COMMIT",
    "REVISION_ENV",
    "VERSION_MARKER",
    "chip_info",
    "dtypes",
    "get_mla_decode_fwd_max_splits",
    "get_mla_metadata_info_v1",
    "get_mla_metadata_v1",
    "get_ps_metadata_info_v1",
    "get_ps_metadata_v1",
    "mha_batch_prefill_func",
    "mla",
    "mla_decode_stage1_asm_fwd",
    "mla_prefill_ps_asm_fwd",
    "mla_reduce_v1",
    "plan_decode_metadata",
    "revision",
    "top_k_per_row_decode",
    "top_k_per_row_prefill",
]
