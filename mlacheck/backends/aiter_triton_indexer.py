"""AITER's Triton lightning-indexer kernels (DeepSeek-V3.2) for the `aiter-triton` backend:

| op | AITER entry point |
|---|---|
| mqa_logits | `aiter.ops.triton.attention.fp8_mqa_logits.fp8_mqa_logits` (clean_logits=True) |
| paged_mqa_logits | `aiter.ops.triton.attention.pa_mqa_logits.deepgemm_fp8_paged_mqa_logits` (plain page layout, KVBlockSize = page size) |

On ROCm both run as shipped. Off ROCm (measured on an H100, docs/aiter-triton.md):

- `fp8_mqa_logits` launches its non-gluon kernel with `waves_per_eu` and
  `matrix_instr_nonkdim`, which CUDA Triton rejects (KeyError): for the duration of a call the
  module's `_fp8_mqa_logits_kernel` is a launcher that passes AITER's launch keywords through
  `aiter_triton_compat.launch_config` (AMD-only keys the kernel does not declare are
  dropped). Nothing else changes; the kernel is AITER's.
- `pa_mqa_logits` does not import in a Triton-only build: `from aiter import dtypes` (the
  package leaves `dtypes` unbound when its HIP ops are skipped) and
  `aiter.jit.utils.chip_info`, which imports `build_targets` (a module of AITER's JIT build,
  not installed). IMPORT SHIMS (`install_import_shims`, only where those imports fail): a
  module `aiter.dtypes` with the OCP e4m3 fp8 and the plain dtypes, and a module
  `aiter.jit.utils.chip_info` whose `get_gfx()` names the NVIDIA target (`sm_90`: not an AMD
  arch, so AITER takes its non-gluon kernel) and whose `get_cu_num()` is the SM count. They are
  installed in `sys.modules` before the import and stay (the imported module holds them); no
  AITER file is touched. Its non-gluon launch carries `waves_per_eu` too: filtered as above.

Importing this module imports neither triton nor aiter.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch

from mlacheck.backends import aiter_triton_compat as compat
from mlacheck.backends.base import Capability, Output
from mlacheck.backends.toolkit import signature_problem
from mlacheck.ops import Op
from mlacheck.spec import Case

MOD_FP8_MQA = "aiter.ops.triton.attention.fp8_mqa_logits"
MOD_PA_MQA = "aiter.ops.triton.attention.pa_mqa_logits"
OP_FILES: dict[str, tuple[str, ...]] = {
    Op.MQA_LOGITS: ("ops/triton/attention/fp8_mqa_logits.py",),
    Op.PAGED_MQA_LOGITS: ("ops/triton/attention/pa_mqa_logits.py",),
}
CALLED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "fp8_mqa_logits.fp8_mqa_logits": ("Q", "KV", "kv_scales", "weights", "cu_starts", "cu_ends",
                                      "clean_logits"),
    "pa_mqa_logits.deepgemm_fp8_paged_mqa_logits": (
        "q_fp8", "kv_cache", "weights", "out_logits", "context_lens", "kv_indices",
        "max_model_len", "Preshuffle", "KVBlockSize", "ChunkK"),
}
ENTRIES = {Op.MQA_LOGITS: "fp8_mqa_logits.fp8_mqa_logits",
           Op.PAGED_MQA_LOGITS: "pa_mqa_logits.deepgemm_fp8_paged_mqa_logits"}
# The kernels each wrapper launches with AMD-only keywords (module attribute names).
LAUNCHED_KERNELS = {Op.MQA_LOGITS: (MOD_FP8_MQA, "_fp8_mqa_logits_kernel"),
                    Op.PAGED_MQA_LOGITS: (MOD_PA_MQA, "_deepgemm_fp8_paged_mqa_logits")}
CHUNK_K = 256  # deepgemm_fp8_paged_mqa_logits' default


class LaunchKeyFilter:
    """A Triton kernel as its wrapper launches it (`kernel[grid](**kwargs)`), with the launch
    keywords passed through `compat.launch_config` (off ROCm: AMD-only keys the kernel does
    not declare are dropped); every other attribute is the kernel's."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            return launch(*args, **compat.launch_config(self.kernel, kwargs, amd=False))

        return run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def install_import_shims() -> list[str]:
    """What `pa_mqa_logits` needs to import in a Triton-only build off ROCm (module
    docstring); returns what was installed (nothing where AITER imports as is)."""
    installed = []
    aiter = importlib.import_module("aiter")
    if not hasattr(aiter, "dtypes") and "aiter.dtypes" not in sys.modules:
        dtypes = types.ModuleType("aiter.dtypes")
        dtypes.fp8 = compat.fp8_e4m3_dtype()  # type: ignore[attr-defined]
        for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16),
                         ("fp32", torch.float32), ("i32", torch.int32), ("i8", torch.int8),
                         ("u8", torch.uint8)):
            setattr(dtypes, name, dt)
        sys.modules["aiter.dtypes"] = dtypes
        aiter.dtypes = dtypes  # type: ignore[attr-defined]
        installed.append("aiter.dtypes (fp8 = float8_e4m3fn)")
    try:
        importlib.import_module("aiter.jit.utils.chip_info")
    except ModuleNotFoundError as e:
        if e.name not in ("build_targets", "cpp_extension", "torch_guard"):
            raise
        chip = types.ModuleType("aiter.jit.utils.chip_info")
        target = _nvidia_target()
        chip.get_gfx = lambda: target  # type: ignore[attr-defined]
        chip.get_gfx_runtime = lambda: target  # type: ignore[attr-defined]
        chip.get_cu_num = _sm_count  # type: ignore[attr-defined]
        sys.modules["aiter.jit.utils.chip_info"] = chip
        installed.append(f"aiter.jit.utils.chip_info (get_gfx() = {target!r}: no "
                         f"{e.name}, a module of AITER's JIT build)")
    return installed


def _nvidia_target() -> str:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return "sm_90"


def _sm_count() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).multi_processor_count
    return compat.INTERPRETER_NUM_SMS


def load_into(loaded: Any, root: Any) -> None:
    """Import both indexer modules into `loaded` (aiter_triton.Loaded): per op, the module or
    a one-line problem (a missing file, an import or signature failure)."""
    for op, mod_name in ((Op.MQA_LOGITS, MOD_FP8_MQA), (Op.PAGED_MQA_LOGITS, MOD_PA_MQA)):
        missing = [f for f in OP_FILES[op] if not (root / f).is_file()]
        if missing:
            loaded.problems[op] = f"installed aiter {loaded.version} lacks aiter/{missing[0]}"
            continue
        try:
            if op == Op.PAGED_MQA_LOGITS and not compat.on_rocm():
                loaded.notes += install_import_shims()
            loaded.modules[op] = importlib.import_module(mod_name)
        except Exception as e:  # an AITER import failure is this op's SKIP reason
            first = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            loaded.problems[op] = f"importing {mod_name} failed: {first}"
            continue
        key = ENTRIES[op]
        fn = getattr(loaded.modules[op], key.rsplit(".", 1)[1], None)
        why = (f"installed aiter {loaded.version} has no {key}" if fn is None
               else signature_problem(fn, key, CALLED_PARAMETERS[key]))
        if why:
            loaded.problems[op] = why


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pow2_rule(case: Case) -> str | None:
    if not _pow2(case.num_heads) or not _pow2(case.head_dim):  # type: ignore[union-attr]
        return ("AITER's indexer kernels take power-of-two head counts and head dims "
                "(tl.arange(0, NUM_HEADS) / (0, HEAD_SIZE), _triton_kernels/attention/"
                "fp8_mqa_logits.py:46-47, AITER e4048607a5), not "
                f"{case.num_heads} x {case.head_dim}")  # type: ignore[union-attr]
    return None


# One FP8 e4m3 format per chip, read in AITER e4048607a5: the paged kernel's cache is viewed as
# `dtypes.fp8` (attention/pa_mqa_logits.py:219), "gfx942 uses the AMD fnuz e4m3 variant; gfx950
# and gfx1250 use the OCP/IEEE e4m3 variant, matching utils.types.get_fp8_dtypes" (:290-291).
FP8_FORMAT_REASON = ("one FP8 e4m3 format per chip: Q / KV 'dtype float8' (attention/"
                     "fp8_mqa_logits.py:93-94), the paged cache viewed as AITER's dtypes.fp8 "
                     "(attention/pa_mqa_logits.py:219, :290-291; utils/types.py:25-31: fnuz on "
                     "gfx942 only), float8_e4m3fn on NVIDIA")
FP8_REASONS = {"q_formats": FP8_FORMAT_REASON, "kv_formats": FP8_FORMAT_REASON}


def capabilities(problems: dict[str, str], devices: tuple[str, ...],
                 fp8_format: str) -> dict[str, Capability]:
    fmt = (fp8_format,)
    return {
        Op.MQA_LOGITS: Capability(
            q_formats=fmt, kv_formats=fmt, per_token_scales=True, empty_requests=True,
            reasons=FP8_REASONS,
            rules=(_pow2_rule,), devices=devices, refusal=problems.get(Op.MQA_LOGITS),
            notes="fp8_mqa_logits (clean_logits=True); off ROCm its launch keys filtered"),
        Op.PAGED_MQA_LOGITS: Capability(
            q_formats=fmt, kv_formats=fmt, per_token_scales=True,
            page_sizes=tuple(2**i for i in range(9)), rules=(_pow2_rule,), devices=devices,
            reasons=FP8_REASONS,
            refusal=problems.get(Op.PAGED_MQA_LOGITS),
            notes="deepgemm_fp8_paged_mqa_logits (Preshuffle=False, KVBlockSize = page size, "
                  "ChunkK 256; out_logits initialised to -inf); off ROCm: import shims and "
                  "launch keys filtered (aiter_triton_indexer)"),
    }


def _patches(loaded: Any, op: str) -> compat.RuntimePatches:
    p = compat.RuntimePatches()
    if compat.on_rocm():
        return p
    mod_name, attr = LAUNCHED_KERNELS[op]
    mod = loaded.modules[op]
    p.add(mod, attr, LaunchKeyFilter(getattr(mod, attr)),
          f"{attr} launched without the AMD-only keys it does not declare")
    return p


def run(loaded: Any, case: Case, inputs: Any) -> Output:
    out = inputs.out.out
    if case.op == Op.PAGED_MQA_LOGITS:
        return Output(out, metadata=paged_logits(loaded, case, inputs, out),
                      wrote_into_guarded=True)
    patches = _patches(loaded, case.op)
    with patches:
        q = inputs.query
        logits = loaded.modules[case.op].fp8_mqa_logits(
            Q=q.q, KV=inputs.keys.values, kv_scales=inputs.keys.scales, weights=q.weights,
            cu_starts=inputs.k_start, cu_ends=inputs.k_end, clean_logits=True)
        out.copy_(logits)
    return Output(out, metadata=_metadata(loaded, patches), wrote_into_guarded=True)


def paged_logits(loaded: Any, case: Case, inputs: Any, out: torch.Tensor) -> dict[str, Any]:
    """deepgemm_fp8_paged_mqa_logits into `out` [B * next_n, W] (filled with -inf first: the
    kernel writes only the chunks covering each context); returns the verdict's metadata."""
    op = Op.PAGED_MQA_LOGITS
    patches = _patches(loaded, op)
    b, nn = len(case.requests), case.next_n  # type: ignore[union-attr]
    out.fill_(float("-inf"))
    with patches:
        loaded.modules[op].deepgemm_fp8_paged_mqa_logits(
            q_fp8=inputs.query.q.view(b, nn, case.num_heads, case.head_dim),  # type: ignore[union-attr]
            kv_cache=inputs.pool.data, weights=inputs.query.weights, out_logits=out,
            context_lens=inputs.context_lens, kv_indices=inputs.block_table,
            max_model_len=out.shape[1], Preshuffle=False,
            KVBlockSize=inputs.pool.page_size, ChunkK=CHUNK_K)
    return _metadata(loaded, patches)


def _metadata(loaded: Any, patches: compat.RuntimePatches) -> dict[str, Any]:
    return {"aiter_triton": {"patches": patches.describe(), "notes": list(loaded.notes)}}
