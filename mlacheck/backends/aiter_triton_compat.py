"""Compatibility layer for running AMD AITER's Triton MLA kernels where Triton runs.

On ROCm the kernels run as shipped: nothing here changes anything. On other Triton targets
(NVIDIA; the CPU interpreter, `TRITON_INTERPRET=1`) AITER's own choices do not fit, and this
module supplies explicit replacements. It never edits an AITER file: every intervention is a
named, reversible attribute replacement on an imported AITER module object
(`RuntimePatches`), applied only for the duration of one backend call and undone afterwards,
so AITER behaves as shipped outside mlacheck's calls. docs/aiter-triton.md lists each one.

What AITER gets wrong off ROCm, and the replacement:

1. Launch configs carry AMD-only keys (`waves_per_eu`, `matrix_instr_nonkdim`, `kpack`).
   Triton on CUDA rejects an undeclared launch option (`KeyError: Keyword argument
   waves_per_eu was specified but unrecognised`), while a kernel that DECLARES such a key as a
   parameter (`waves_per_eu: tl.constexpr`) needs it passed. `launch_config` decides per key by
   what the kernel declares (its `arg_names`): declared -> kept (a neutral value is supplied if
   missing), undeclared -> dropped. `num_warps` is raised to 8 for the MLA attention kernels
   (their 512-wide fp32 accumulator spills at AITER's 2 warps).
2. FP8 dtype selection: AITER picks `float8_e4m3fnuz` on any arch it does not know (its tables
   list AMD archs only) and refuses FP8 on them (`supports_fp8` / `is_fp8_avail`). Off ROCm the
   OCP `float8_e4m3fn` is the FP8 format (`fp8_e4m3_dtype`), and the module-level selections
   the kernels use are replaced by it for the duration of a call.
3. No GPU (CPU interpreter, compile-only checks): AITER queries the active Triton driver at
   import (`arch_info.get_arch()`); with no GPU there is none. `ensure_interpreter_target`
   (interpreter) / `set_compile_only_target` install a stub driver reporting a CUDA sm_90
   target (the kernels then take their NVIDIA paths, which the interpreter executes on the
   CPU, or which Triton compiles without launching), and `get_num_sms` gets a fixed count.

Importing this module imports neither triton nor aiter.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

# Launch options only the ROCm Triton backend knows.
AMD_ONLY_LAUNCH_KEYS: tuple[str, ...] = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")
# What a kernel that declares one of them as a parameter gets when the config lacks it.
# (On ROCm these are the "no hint" values; off ROCm they are plain constexpr arguments.)
NEUTRAL_AMD_VALUES: dict[str, Any] = {"waves_per_eu": 0, "matrix_instr_nonkdim": 16, "kpack": 1}

# num_warps for AITER's MLA attention kernels off ROCm (BLOCK_M x 512 fp32 accumulators).
DEFAULT_MLA_NUM_WARPS = 8
NUM_WARPS_ENV = "MLACHECK_AITER_TRITON_NUM_WARPS"

# Interpreter: the SM count AITER's split heuristics see when there is no GPU.
INTERPRETER_NUM_SMS = 8
# The target the interpreter stub driver reports: CUDA sm_90 (H100), warp size 32.
INTERPRETER_TARGET = ("cuda", 90, 32)


# --------------------------------------------------------------------------- environment


def on_rocm() -> bool:
    """True on a ROCm build of torch (AITER's kernels then run as shipped)."""
    return torch.version.hip is not None


def interpreting() -> bool:
    """True when Triton kernels run on its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def mla_num_warps() -> int:
    value = os.environ.get(NUM_WARPS_ENV, "").strip()
    return int(value) if value else DEFAULT_MLA_NUM_WARPS


def fp8_e4m3_dtype(aiter_selection: Callable[[], torch.dtype] | None = None) -> torch.dtype:
    """The FP8 e4m3 dtype of this machine: AITER's own choice on ROCm (gfx942 fnuz, gfx950 fn),
    the OCP `float8_e4m3fn` elsewhere (AITER would say fnuz, which NVIDIA does not have)."""
    if on_rocm() and aiter_selection is not None:
        return aiter_selection()
    return torch.float8_e4m3fn


# --------------------------------------------------------------------------- launch configs


def declared_params(kernel: Any) -> frozenset[str]:
    """Parameter names a Triton kernel declares.

    Works for `JITFunction`, the interpreter's `InterpretedFunction`, `Autotuner` and
    `Heuristics` wrappers (all expose `arg_names`, or wrap one that does in `.fn`), and falls
    back to `inspect.signature` for a plain Python function.
    """
    obj = kernel
    for _ in range(8):
        names = getattr(obj, "arg_names", None)
        if names is not None:
            return frozenset(str(n) for n in names)
        inner = getattr(obj, "fn", None)
        if inner is None or inner is obj:
            break
        obj = inner
    target = getattr(obj, "fn", obj)
    return frozenset(inspect.signature(target).parameters)


def launch_config(
    kernel: Any,
    config: Mapping[str, Any],
    *,
    amd: bool,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The launch keywords `kernel` accepts on this target, from AITER's `config`.

    On ROCm the config is kept as is (plus `overrides`). Elsewhere each AMD-only key is kept
    if the kernel declares it as a parameter (and supplied with a neutral value if the config
    lacks it), and dropped otherwise; `overrides` (e.g. num_warps) are applied last.
    """
    out = dict(config)
    if overrides:
        out.update(overrides)
    if amd:
        return out
    declared = declared_params(kernel)
    for key in AMD_ONLY_LAUNCH_KEYS:
        if key in declared:
            out.setdefault(key, NEUTRAL_AMD_VALUES[key])
        else:
            out.pop(key, None)
    return out


def autotune_configs(kernel: Any, configs: list[Any], *, amd: bool,
                     overrides: Mapping[str, Any] | None = None) -> list[Any]:
    """`triton.Config` objects with their kwargs passed through `launch_config`."""
    import triton

    res = []
    for cfg in configs:
        opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        for k in ("num_warps", "num_stages"):
            if overrides and k in overrides:
                opts[k] = overrides[k]
        rest = {k: v for k, v in (overrides or {}).items() if k not in opts}
        kwargs = launch_config(kernel, cfg.kwargs, amd=amd, overrides=rest)
        res.append(triton.Config(kwargs, num_warps=opts["num_warps"], num_stages=opts["num_stages"],
                                 num_ctas=cfg.num_ctas, maxnreg=cfg.maxnreg, pre_hook=cfg.pre_hook))
    return res


# --------------------------------------------------------------------------- runtime patches

_MISSING = object()


@dataclass
class Patch:
    target: Any
    attr: str
    value: Any
    why: str

    @property
    def where(self) -> str:
        name = getattr(self.target, "__name__", None) or type(self.target).__name__
        return f"{name}.{self.attr}"


@dataclass
class RuntimePatches:
    """Reversible attribute replacements on AITER module objects (never on files).

    `with patches:` applies them and restores the originals on exit, exceptions included.
    """

    patches: list[Patch] = field(default_factory=list)
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)

    def add(self, target: Any, attr: str, value: Any, why: str) -> None:
        if not hasattr(target, attr):
            raise AttributeError(f"cannot patch {getattr(target, '__name__', target)}.{attr}: "
                                 "no such attribute in the installed AITER")
        self.patches.append(Patch(target, attr, value, why))

    def describe(self) -> list[str]:
        return [f"{p.where}: {p.why}" for p in self.patches]

    def __bool__(self) -> bool:
        return bool(self.patches)

    def __enter__(self) -> RuntimePatches:
        if self._saved:
            raise RuntimeError("RuntimePatches is not re-entrant")
        try:
            for p in self.patches:
                self._saved.append((p.target, p.attr, getattr(p.target, p.attr, _MISSING)))
                setattr(p.target, p.attr, p.value)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        while self._saved:
            target, attr, old = self._saved.pop()
            if old is _MISSING:
                delattr(target, attr)
            else:
                setattr(target, attr, old)


def mla_decode_patches(mla: ModuleType, *, amd: bool, num_sms: int | None = None
                       ) -> RuntimePatches:
    """Patches for `aiter.ops.triton.attention.mla` (mla_decode_fwd / mla_prefill_fwd).

    `num_sms`: the SM count AITER's split heuristic sees where there is no GPU to ask.
    `mla` is the wrapper module: its `select_3d_config` / `select_2d_config` build the launch
    configs (with `waves_per_eu`) that its kernels `triton_mla_decode_fwd_kernel` (declares
    `waves_per_eu`), `triton_mla_decode_fwd_reduce_kernel` and `triton_mla_prefill_fwd_kernel`
    (both do not) receive; `e4m3_dtype` decides which dtype counts as FP8.
    """
    p = RuntimePatches()
    if num_sms is not None:
        p.add(mla, "get_num_sms", lambda: num_sms,
              f"no GPU to count SMs on (interpreter / compile-only): AITER sees {num_sms}")
    if amd:
        return p
    warps = {"num_warps": mla_num_warps()}
    attn_k = mla.triton_mla_decode_fwd_kernel
    red_k = mla.triton_mla_decode_fwd_reduce_kernel
    orig_3d = mla.select_3d_config

    def select_3d_config(*args: Any, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        attn, red = orig_3d(*args, **kwargs)
        return (launch_config(attn_k, attn, amd=False, overrides=warps),
                launch_config(red_k, red, amd=False))

    p.add(mla, "select_3d_config", select_3d_config,
          "decode launch configs filtered by what each kernel declares (attention kernel "
          f"keeps waves_per_eu, reduce kernel drops it), attention num_warps={warps['num_warps']}")
    if hasattr(mla, "select_2d_config") and hasattr(mla, "triton_mla_prefill_fwd_kernel"):
        pre_k = mla.triton_mla_prefill_fwd_kernel
        orig_2d = mla.select_2d_config

        def select_2d_config(*args: Any, **kwargs: Any) -> dict[str, Any]:
            return launch_config(pre_k, orig_2d(*args, **kwargs), amd=False, overrides=warps)

        p.add(mla, "select_2d_config", select_2d_config,
              "prefill launch config without waves_per_eu (the kernel does not declare it)")
    p.add(mla, "e4m3_dtype", fp8_e4m3_dtype(),
          "FP8 inputs are float8_e4m3fn (AITER selects fnuz on a non-AMD arch)")
    return p


def mha_prefill_patches(fwd_prefill: ModuleType, mha_v3: ModuleType | None, *,
                        amd: bool) -> RuntimePatches:
    """Patches for the Triton FlashAttention-v3 prefill (`mha_v3` -> `fwd_prefill.attn_fwd`).

    `attn_fwd` is an `Autotuner` whose configs (chosen at import by arch; the non-AMD branch
    still carries `waves_per_eu`, which `attn_fwd` does not declare) are replaced by filtered
    copies; `get_arch` (used for the FP8 support check) reports FP8 support on a non-AMD arch.
    """
    p = RuntimePatches()
    if amd:
        return p
    kernel = fwd_prefill.attn_fwd
    p.add(kernel, "configs", autotune_configs(kernel, list(kernel.configs), amd=False),
          "autotune configs without waves_per_eu (attn_fwd does not declare it)")
    orig_get_arch = fwd_prefill.get_arch
    arch = orig_get_arch()
    arch_cls = type(arch)

    class CompatArch(arch_cls):  # type: ignore[misc, valid-type]
        """AITER's arch record, reporting FP8 support (NVIDIA sm_89+ computes e4m3fn)."""

        @property
        def supports_fp8(self) -> bool:
            return True

    compat = CompatArch(name=str(arch.name), family=getattr(arch, "family", None))
    p.add(fwd_prefill, "get_arch", lambda: compat,
          f"arch {arch.name} reported as FP8-capable (AITER lists AMD archs only)")
    if mha_v3 is not None and hasattr(mha_v3, "get_fp8_e4m3_dtype"):
        p.add(mha_v3, "get_fp8_e4m3_dtype", fp8_e4m3_dtype,
              "flash_attn_*_fp8_func quantise to float8_e4m3fn (AITER selects fnuz)")
    return p


# --------------------------------------------------------------------------- interpreter


class _InterpreterDriver:
    """Stands in for Triton's active driver when the interpreter runs on a machine with no
    GPU driver: AITER asks it for the target arch at import, the interpreter never uses it."""

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(*INTERPRETER_TARGET)

    def get_current_device(self) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


class _CompileOnlyDriver(_InterpreterDriver):
    """A driver for compiling (never launching) kernels for a target with no GPU present."""

    def __init__(self, target: tuple[str, int, int]) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(*self.target)

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


_COMPILE_ONLY_TARGET: tuple[str, int, int] | None = None


def compile_only() -> bool:
    """Whether this process compiles for another GPU and never launches a kernel."""
    return _COMPILE_ONLY_TARGET is not None


class CudaLookingTensor(torch.Tensor):
    """Compile-only: a CPU tensor that passes AITER's prefill `q.is_cuda` check (nothing is
    launched, so no kernel ever reads it)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def set_compile_only_target(target: tuple[str, int, int] = INTERPRETER_TARGET) -> str:
    """Make Triton compile for `target` on a machine without that GPU (nothing can launch).

    Used by `python -m mlacheck.tools.aiter_triton_check --compile-only` before AITER is
    imported (AITER caches the arch at import).
    """
    global _COMPILE_ONLY_TARGET
    if interpreting():
        raise RuntimeError("compile-only needs TRITON_INTERPRET unset")
    from triton.runtime import driver

    driver.set_active(_CompileOnlyDriver(target))  # type: ignore[arg-type]
    _COMPILE_ONLY_TARGET = target
    return "compile-only driver: target {}:{} (warp {})".format(*target)


def ensure_interpreter_target() -> str | None:
    """Under TRITON_INTERPRET=1 with no GPU driver, install the stub driver (once).

    Returns a description of what was done, or None when nothing was needed. The stub stays
    for the process: AITER caches the arch it reported at import.
    """
    if not interpreting():
        return None
    from triton.runtime import driver

    try:
        driver.active  # noqa: B018 - the property raises when no driver is active
        return None
    except RuntimeError:
        pass
    driver.set_active(_InterpreterDriver())  # type: ignore[arg-type]
    return "interpreter stub driver: target {}:{} (warp {})".format(*INTERPRETER_TARGET)


@contextmanager
def combined(*patch_sets: RuntimePatches) -> Iterator[None]:
    """Apply several patch sets together (restored in reverse order)."""
    applied: list[RuntimePatches] = []
    try:
        for ps in patch_sets:
            ps.__enter__()
            applied.append(ps)
        yield
    finally:
        for ps in reversed(applied):
            ps.__exit__(None, None, None)
