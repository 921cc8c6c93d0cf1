"""The AITER API as the adapter sees it: the functions it calls and with which keywords, the
environment it pins, and importing the module (real `aiter` or mlacheck's model) with every
signature checked before first use.

Target: AITER main at commit TARGET_COMMIT (see docs/aiter.md). A mismatch between an
installed function and CALLED_PARAMETERS is a one-line SKIP reason naming the function and the
parameter, never a CRASH.
"""


from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from mlacheck import fp8
from mlacheck.backends import aiter_conversion
from mlacheck.backends.aiter_logging import configure_aiter_logger
from mlacheck.backends.toolkit import library_version, signature_problems
from mlacheck.ops import Op

# --------------------------------------------------------------------------- targets

TARGET_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"
REAL_MODULE = "aiter"
MODEL_MODULE = "mlacheck.backends.aiter_model"
INSTALL_HINT = "pip install mlacheck[rocm] -> amd-aiter"
# The AITER model's chip (read by mlacheck.backends.aiter_model.jit.utils.chip_info).
MODEL_GFX_ENV = "MLACHECK_AITER_MODEL_GFX"

# Functions reached by a dotted path under the package (imported on first use: the Triton
# indexer modules import triton and query the GPU at import).
FP8_MQA_LOGITS = "ops.triton.attention.fp8_mqa_logits.fp8_mqa_logits"
PAGED_MQA_LOGITS = "ops.triton.attention.pa_mqa_logits.deepgemm_fp8_paged_mqa_logits"

# The keyword parameters the adapter passes to each installed function. `_call` refuses a
# keyword missing from this table, so the signature check below covers every call made.
CALLED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "get_mla_metadata_info_v1": (
        "batch_size", "max_seqlen_qo", "num_head_qo", "q_dtype", "kv_dtype", "is_sparse",
        "fast_mode", "num_kv_splits", "intra_batch_mode", "max_split_per_batch",
    ),
    "get_mla_metadata_v1": (
        "seqlens_qo_indptr", "seqlens_kv_indptr", "kv_last_page_lens", "num_heads_per_head_k",
        "num_heads_k", "is_causal", "work_metadata_ptrs", "work_info_set", "work_indptr",
        "reduce_indptr", "reduce_final_map", "reduce_partial_map", "page_size",
        "kv_granularity", "max_seqlen_qo", "uni_seqlen_qo", "fast_mode", "topk",
        "max_split_per_batch", "intra_batch_mode", "dtype_q_nope", "dtype_kv_nope",
    ),
    "mla.mla_decode_fwd": (
        "q", "kv_buffer", "o", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_lens",
        "max_seqlen_q", "page_size", "nhead_kv", "sm_scale", "logit_cap", "num_kv_splits",
        "num_kv_splits_indptr", "work_meta_data", "work_indptr", "work_info_set",
        "reduce_indptr", "reduce_final_map", "reduce_partial_map", "q_scale", "kv_scale",
        "return_lse", "causal",
    ),
    "get_ps_metadata_info_v1": ("batch_size", "num_head_k", "max_qlen", "qlen_granularity"),
    "get_ps_metadata_v1": (
        "seqlens_qo_indptr", "pages_kv_indptr", "context_lens", "gqa_ratio", "num_heads_k",
        "work_metadata_ptrs", "work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map", "qhead_granularity", "qlen_granularity", "kvlen_granularity",
        "block_size", "is_causal",
    ),
    "mla.mla_prefill_ps_fwd": (
        "Q", "K", "V", "output", "qo_indptr", "kv_indptr", "kv_page_indices", "work_indptr",
        "work_info_set", "max_seqlen_q", "is_causal", "reduce_indptr", "reduce_final_map",
        "reduce_partial_map", "softmax_scale", "q_scale", "k_scale", "v_scale",
    ),
    "mha_batch_prefill_func": (
        "q", "k", "v", "cu_seqlens_q", "kv_indptr", "kv_page_indices", "max_seqlen_q",
        "max_seqlen_k", "dropout_p", "softmax_scale", "logits_soft_cap", "causal",
        "window_size", "return_lse", "out", "kv_last_page_lens", "q_descale", "k_descale",
        "v_descale",
    ),
    # the DeepSeek-V3.2 indexer (Triton kernels, reached by module path) and its top-k
    FP8_MQA_LOGITS: ("Q", "KV", "kv_scales", "weights", "cu_starts", "cu_ends",
                     "clean_logits"),
    PAGED_MQA_LOGITS: ("q_fp8", "kv_cache", "weights", "out_logits", "context_lens",
                       "kv_indices", "max_model_len", "Preshuffle", "KVBlockSize", "ChunkK"),
    "top_k_per_row_prefill": ("logits", "rowStarts", "rowEnds", "indices", "values", "numRows",
                              "stride0", "stride1", "k"),
    "top_k_per_row_decode": ("logits", "next_n", "seqLens", "indices", "numRows", "stride0",
                             "stride1", "k"),
}

PERSISTENT_DECODE_FUNCTIONS = ("get_mla_metadata_info_v1", "get_mla_metadata_v1",
                               "mla.mla_decode_fwd")
OP_FUNCTIONS: dict[str, tuple[str, ...]] = {
    Op.DECODE: PERSISTENT_DECODE_FUNCTIONS,
    Op.SPARSE_DECODE: PERSISTENT_DECODE_FUNCTIONS,
    Op.PREFILL: ("get_ps_metadata_info_v1", "get_ps_metadata_v1", "mla.mla_prefill_ps_fwd"),
    Op.PAGED_PREFILL: ("mha_batch_prefill_func",),
    Op.MQA_LOGITS: (FP8_MQA_LOGITS,),
    Op.PAGED_MQA_LOGITS: (PAGED_MQA_LOGITS,),
    Op.TOPK: ("top_k_per_row_prefill", "top_k_per_row_decode"),
    Op.INDEX_CONVERSION: (),  # found by aiter_conversion (entry point or kernels): conversion
    Op.SPARSE_PREFILL: PERSISTENT_DECODE_FUNCTIONS,  # V3.2 prefill runs as sparse decode
    Op.SPARSE_PIPELINE: (PAGED_MQA_LOGITS, "top_k_per_row_decode", *PERSISTENT_DECODE_FUNCTIONS),
}

# Names of the six persistent-schedule buffers, in the order get_mla_metadata_info_v1 and
# get_ps_metadata_info_v1 return their (shape, dtype) pairs.
METADATA_BUFFER_NAMES = (
    "work_metadata_ptrs", "work_indptr", "work_info_set",
    "reduce_indptr", "reduce_final_map", "reduce_partial_map",
)

# work_indptr's length is the persistent kernel's grid (one work group per CU): never reuse a
# longer one. The other buffers may be larger than asked.
EXACT_SIZE_BUFFERS = frozenset({"work_indptr"})

# AITER's environment controls, pinned for the duration of every call (restored afterwards)
# so the path under test is the one this adapter means to test:
AITER_ENV_CONTROLS: dict[str, str] = {
    # <= 0 disables the gate that silently drops persistent metadata for gfx950 bf16
    # 16-head qlen-1 decode at batch >= 32. Read ONCE per process (lru_cache), so it only
    # takes effect if set before the first decode call; the adapter also passes
    # num_kv_splits explicitly, which bypasses the gate regardless.
    "AITER_MLA_DECODE_PERSISTENT_MAX_BATCH": "0",
    # The experimental HipKittens kernels change kernel choice, metadata head folding and
    # the CU occupancy (buffer sizes): off, so the ASM kernels are the ones tested.
    "AITER_ENABLE_EXPERIMENTAL": "0",
    # The opus fp8 stage-1 kernel (gfx950 fp8 page 1) is opt-in: keep the ASM stage 1.
    "AITER_MLA_USE_OPUS": "0",
    # The FlyDSL reduce port is opt-in: keep the HIP mla_reduce_v1.
    "AITER_MLA_REDUCE_FLYDSL": "0",
    # Parallel metadata planner (C++ default when unset): pinned to the default.
    "AITER_MLA_META_USE_PARALLEL": "1",
    # CK batch prefill soft cap: 0 = cap * tanh(s / cap) (what the golden computes).
    # A JIT compile-time define: effective only when the module is built in this process.
    "CK_TILE_ATTENTION_LOGITS_SOFT_CAP_DEFAULT": "0",
}

class AdapterError(RuntimeError):
    """The adapter met something it does not understand (an unexpected shape or value)."""



# --------------------------------------------------------------------------- signatures


def _known_version_hint(problem: str) -> str:
    """A hint for the API generations we know (docs/aiter.md, 'Versions')."""
    if "mla_decode_fwd has no parameter 'page_size'" in problem or (
        "get_mla_metadata_v1 has no parameter 'kv_last_page_lens'" in problem
    ):
        return "; this is the AITER 0.1.7.x API (no page_size / kv_last_page_lens)"
    return ""


# --------------------------------------------------------------------------- the API module


@dataclass
class AiterApi:
    """The imported API (real aiter or the model) and what was learnt about it."""

    module: ModuleType
    mla: ModuleType
    gfx: str
    fp8_dtype: torch.dtype
    fp8_format: str
    cu_num: int | None
    version: str
    problems: dict[str, str] = field(default_factory=dict)  # function -> signature problem

    def submodule(self, path: str) -> ModuleType:
        """A submodule reached by path (`ops.triton.attention.<mod>`), imported on first use."""
        return importlib.import_module(f"{self.module.__name__}.{path}")

    def function(self, qualname: str) -> Callable[..., Any]:
        owner, _, name = qualname.rpartition(".")
        if owner in ("", "mla"):
            return getattr(self.mla if owner == "mla" else self.module, name)
        try:
            sub = self.submodule(owner)
        except Exception as e:  # noqa: BLE001 - an unimportable module is that op's problem
            raise AttributeError(f"{owner} failed to import: {type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}"[:240]) from None
        return getattr(sub, name)

    @functools.cached_property
    def conversion(self) -> aiter_conversion.Found:
        """index_conversion: AITER's entry point, else its kernels, else why not (found on
        first use: importing the real modules imports triton)."""
        return aiter_conversion.find(self.submodule, self.version)

    def op_problem(self, op: str) -> str | None:
        for fn in OP_FUNCTIONS[op]:
            if fn in self.problems:
                return self.problems[fn]
        return None

    @property
    def prefill_lse_fixed(self) -> bool:
        """ROCm/aiter#3606 (not merged at TARGET_COMMIT) makes mla_prefill_ps_fwd return the
        final LSE; vLLM detects it by `max_kvlen` in get_ps_metadata_info_v1, and so do we."""
        try:
            sig = inspect.signature(self.module.get_ps_metadata_info_v1)
        except (AttributeError, TypeError, ValueError):
            return False
        return "max_kvlen" in sig.parameters


def _distribution_of(top_level: str) -> list[str]:
    try:
        return list(importlib.metadata.packages_distributions().get(top_level, []))
    except Exception:  # pragma: no cover - metadata of a broken environment
        return []


def load_api(module_name: str) -> AiterApi | str:
    """Import the API module and probe it; a one-line reason string when it is unusable."""
    top = module_name.partition(".")[0]
    dists = _distribution_of(top) if module_name == REAL_MODULE else []
    if module_name == REAL_MODULE and dists and "amd-aiter" not in dists:
        return (f"the installed 'aiter' ({', '.join(dists)}) is not AMD AITER: PyPI 'aiter' is an "
                f"unrelated asyncio library ({INSTALL_HINT})")
    configure_aiter_logger()  # before `import aiter`: keeps torch._dynamo unimported
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            if module_name == REAL_MODULE:
                return f"aiter not installed ({INSTALL_HINT})"
            return f"API module {module_name} not found"
        return f"{module_name} failed to import: {type(e).__name__}: {e}"[:300]
    except Exception as e:  # aiter raises RuntimeError without ROCm ("ROCm version file ...")
        first = str(e).splitlines()[0] if str(e) else ""
        installed = f" ({library_version(dists)})" if dists else ""
        return f"{module_name}{installed} failed to import: {type(e).__name__}: {first}"[:300]
    try:
        mla = importlib.import_module(f"{module_name}.mla")
    except Exception as e:
        if module_name == REAL_MODULE and not dists:
            return ("the importable 'aiter' has no 'mla' submodule: it is not AMD AITER (PyPI "
                    f"'aiter' is an unrelated asyncio library; {INSTALL_HINT})")
        return f"{module_name}.mla failed to import: {type(e).__name__}: {e}"[:300]
    try:
        chip_info = importlib.import_module(f"{module_name}.jit.utils.chip_info")
        gfx = str(chip_info.get_gfx())
        cu_num: int | None = int(chip_info.get_cu_num())
    except Exception as e:
        return f"{module_name}: chip detection failed: {type(e).__name__}: {e}"[:300]
    if gfx not in ("gfx942", "gfx950"):
        return f"AITER MLA kernels are validated here for gfx942 / gfx950 only; this GPU is {gfx}"
    try:
        fp8_dtype = importlib.import_module(f"{module_name}.dtypes").fp8
    except Exception as e:
        return f"{module_name}.dtypes.fp8 unavailable: {type(e).__name__}: {e}"[:300]
    chip_format = fp8.chip_fp8_format(gfx)
    if fp8.fmt(chip_format).dtype != fp8_dtype:
        return (f"{module_name}.dtypes.fp8 is {fp8_dtype} but {gfx} computes in {chip_format}: "
                "inconsistent chip detection (GPU_ARCHS?)")
    # The torch model names itself (no distribution of its own: mlacheck's metadata against
    # its AITER-shaped __version__ read as two installs, found in review)
    version = (library_version(dists, module) if dists else
               getattr(module, "VERSION_MARKER", None) or library_version([top], module))
    api = AiterApi(module, mla, gfx, fp8_dtype, chip_format, cu_num, version)
    api.problems = {name: problem + _known_version_hint(problem) for name, problem in
                    signature_problems(api.function, module_name, CALLED_PARAMETERS).items()}
    return api


@contextlib.contextmanager
def pinned_environment(settings: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of a call, then restore them exactly."""
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


