"""The compatibility layer on fake kernels and fake AITER modules: launch-config filtering by
what each kernel declares, reversible runtime patches, FP8 dtype selection. No GPU, no aiter;
the two tests that build `triton.Config` objects skip without triton."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mlacheck.backends import aiter_triton_compat as compat


class FakeJIT:
    """What a `triton.jit` kernel exposes: `arg_names` (and `fn`, the Python function)."""

    def __init__(self, *names: str) -> None:
        self.arg_names = list(names)
        self.fn = lambda: None


class FakeAutotuner:
    """`triton.autotune` wraps the JIT kernel in `.fn` and keeps `configs`."""

    def __init__(self, inner: FakeJIT, configs: list[Any]) -> None:
        self.fn = inner
        self.configs = configs


DECLARES_WAVES = FakeJIT("q", "out", "TILE_SIZE", "num_warps", "waves_per_eu", "num_stages")
PLAIN = FakeJIT("q", "out", "TILE_SIZE")
AITER_ATTN = {"TILE_SIZE": 16, "NUM_SEGMENTS_PER_SEQ": 8, "num_warps": 2, "waves_per_eu": 1,
              "num_stages": 1}
AITER_STAGE1_ROPE = {"BLOCK_N": 32, "BLOCK_H": 16, "num_stages": 1, "waves_per_eu": 1,
                     "matrix_instr_nonkdim": 16, "kpack": 2}


def test_declared_params_unwraps() -> None:
    assert compat.declared_params(DECLARES_WAVES) >= {"waves_per_eu", "TILE_SIZE"}
    assert compat.declared_params(FakeAutotuner(PLAIN, [])) == {"q", "out", "TILE_SIZE"}

    def python_kernel(a, b, waves_per_eu=0):  # noqa: ANN001, ANN202
        return a

    assert compat.declared_params(python_kernel) == {"a", "b", "waves_per_eu"}


def test_declared_key_is_kept_undeclared_is_dropped() -> None:
    attn = compat.launch_config(DECLARES_WAVES, AITER_ATTN, amd=False, overrides={"num_warps": 8})
    assert attn == {**AITER_ATTN, "num_warps": 8}  # waves_per_eu kept: the kernel needs it
    red = compat.launch_config(PLAIN, AITER_ATTN, amd=False)
    assert "waves_per_eu" not in red and red["TILE_SIZE"] == 16 and red["num_warps"] == 2
    rope = compat.launch_config(PLAIN, AITER_STAGE1_ROPE, amd=False)
    assert rope == {"BLOCK_N": 32, "BLOCK_H": 16, "num_stages": 1}


def test_declared_key_missing_from_config_gets_a_neutral_value() -> None:
    got = compat.launch_config(DECLARES_WAVES, {"TILE_SIZE": 16}, amd=False)
    assert got["waves_per_eu"] == compat.NEUTRAL_AMD_VALUES["waves_per_eu"]


def test_rocm_keeps_the_config_as_shipped() -> None:
    assert compat.launch_config(PLAIN, AITER_STAGE1_ROPE, amd=True) == AITER_STAGE1_ROPE
    assert compat.launch_config(PLAIN, AITER_ATTN, amd=True, overrides={"num_warps": 4}) == {
        **AITER_ATTN, "num_warps": 4}
    assert AITER_ATTN["num_warps"] == 2  # the caller's dict is never mutated


def test_num_warps_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compat.NUM_WARPS_ENV, raising=False)
    assert compat.mla_num_warps() == 8
    monkeypatch.setenv(compat.NUM_WARPS_ENV, "4")
    assert compat.mla_num_warps() == 4


def test_fp8_dtype_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "on_rocm", lambda: False)
    assert compat.fp8_e4m3_dtype(lambda: torch.float8_e4m3fnuz) == torch.float8_e4m3fn
    monkeypatch.setattr(compat, "on_rocm", lambda: True)
    assert compat.fp8_e4m3_dtype(lambda: torch.float8_e4m3fnuz) == torch.float8_e4m3fnuz


def test_runtime_patches_restore_even_on_error() -> None:
    mod = types.ModuleType("fake_aiter_mod")
    mod.x = 1  # type: ignore[attr-defined]
    p = compat.RuntimePatches()
    p.add(mod, "x", 2, "why")
    assert p.describe() == ["fake_aiter_mod.x: why"]
    with p:
        assert mod.x == 2  # type: ignore[attr-defined]
    assert mod.x == 1  # type: ignore[attr-defined]
    with pytest.raises(ZeroDivisionError), p:
        assert mod.x == 2  # type: ignore[attr-defined]
        _ = 1 / 0
    assert mod.x == 1  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no such attribute in the installed AITER"):
        p.add(mod, "missing", 3, "why")


def _fake_mla_module() -> types.ModuleType:
    """The shape of aiter.ops.triton.attention.mla at e4048607: config builders + kernels."""
    mod = types.ModuleType("aiter.ops.triton.attention.mla")
    mod.triton_mla_decode_fwd_kernel = DECLARES_WAVES  # type: ignore[attr-defined]
    mod.triton_mla_decode_fwd_reduce_kernel = PLAIN  # type: ignore[attr-defined]
    mod.triton_mla_prefill_fwd_kernel = PLAIN  # type: ignore[attr-defined]
    mod.e4m3_dtype = torch.float8_e4m3fnuz  # type: ignore[attr-defined]
    mod.get_num_sms = lambda: 304  # type: ignore[attr-defined]

    def select_3d_config(*a: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        red = {"TILE_SIZE": 16, "NUM_SEGMENTS_PER_SEQ": 8, "num_warps": 1, "waves_per_eu": 2,
               "num_stages": 1}
        return dict(AITER_ATTN), red

    def select_2d_config(*a: Any) -> dict[str, Any]:
        return {"TILE_SIZE": 16, "num_warps": 8, "num_stages": 1, "waves_per_eu": 1}

    mod.select_3d_config = select_3d_config  # type: ignore[attr-defined]
    mod.select_2d_config = select_2d_config  # type: ignore[attr-defined]
    return mod


def test_mla_decode_patches_off_rocm() -> None:
    mod = _fake_mla_module()
    orig = (mod.select_3d_config, mod.select_2d_config, mod.e4m3_dtype, mod.get_num_sms)
    p = compat.mla_decode_patches(mod, amd=False, num_sms=compat.INTERPRETER_NUM_SMS)
    with p:
        attn, red = mod.select_3d_config(16, 256)
        assert attn["waves_per_eu"] == 1 and attn["num_warps"] == 8  # declared: kept
        assert "waves_per_eu" not in red and red["num_warps"] == 1  # undeclared: dropped
        assert "waves_per_eu" not in mod.select_2d_config()
        assert mod.e4m3_dtype == torch.float8_e4m3fn
        assert mod.get_num_sms() == compat.INTERPRETER_NUM_SMS
    assert (mod.select_3d_config, mod.select_2d_config, mod.e4m3_dtype, mod.get_num_sms) == orig
    assert "waves_per_eu" in mod.select_3d_config()[1]


def test_mla_decode_patches_on_rocm_change_nothing() -> None:
    assert not compat.mla_decode_patches(_fake_mla_module(), amd=True)


@dataclass(frozen=True)
class FakeGpuArch:
    """AITER's flash_attn_triton_amd GpuArch: FP8 only on the AMD archs it lists."""

    name: str
    family: str | None = None

    @property
    def supports_fp8(self) -> bool:
        return self.name in ("gfx942", "gfx950")


def test_mha_prefill_patches_off_rocm() -> None:
    triton = pytest.importorskip("triton")
    cfg = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "waves_per_eu": 2, "PRE_LOAD_V": False},
                        num_stages=1, num_warps=4)
    kernel = FakeAutotuner(FakeJIT("Q", "K", "BLOCK_M", "BLOCK_N", "PRE_LOAD_V"), [cfg])
    fwd = types.ModuleType("fwd_prefill")
    fwd.attn_fwd = kernel  # type: ignore[attr-defined]
    fwd.get_arch = lambda: FakeGpuArch(name=90)  # type: ignore[attr-defined, arg-type]
    v3 = types.ModuleType("mha_v3")
    v3.get_fp8_e4m3_dtype = lambda: torch.float8_e4m3fnuz  # type: ignore[attr-defined]
    p = compat.mha_prefill_patches(fwd, v3, amd=False)
    with p:
        (new,) = kernel.configs
        assert new.kwargs == {"BLOCK_M": 64, "BLOCK_N": 64, "PRE_LOAD_V": False}
        assert (new.num_warps, new.num_stages) == (4, 1)
        assert fwd.get_arch().supports_fp8 and fwd.get_arch().name == "90"  # type: ignore[attr-defined]
        assert v3.get_fp8_e4m3_dtype() == torch.float8_e4m3fn  # type: ignore[attr-defined]
    assert kernel.configs == [cfg] and not fwd.get_arch().supports_fp8  # type: ignore[attr-defined]


def test_autotune_configs_overrides() -> None:
    triton = pytest.importorskip("triton")
    cfg = triton.Config({"BLOCK_M": 64, "waves_per_eu": 2}, num_stages=1, num_warps=4)
    (new,) = compat.autotune_configs(DECLARES_WAVES, [cfg], amd=False,
                                     overrides={"num_warps": 8})
    assert new.kwargs == {"BLOCK_M": 64, "waves_per_eu": 2} and new.num_warps == 8


def test_interpreting_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, expect in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert compat.interpreting() is expect
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert compat.ensure_interpreter_target() is None  # not interpreting: nothing to do
