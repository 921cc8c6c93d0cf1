"""The AITER adapter without kernels: import isolation, the SKIP reasons of a machine
without ROCm, signature checking against fake AITER versions and against the installed AITER
sources, chip-dependent capabilities, head padding, env pinning and buffer reuse."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _aiter_fakes import (  # noqa: I001  (test-local helper, on sys.path via rootdir insertion)
    get_mla_metadata_v1_0_1_7,
    install_fake_aiter,
    mla_decode_fwd_0_1_7,
)

from mlacheck.backends.aiter import (
    AiterAdapter,
    MetadataBuffers,
    capability,
    head_padding,
    load_api,
)
from mlacheck.backends.aiter import api as adapter_mod
from mlacheck.backends.aiter.api import CALLED_PARAMETERS, pinned_environment
from mlacheck.backends.registry import BUILTIN, DEFAULT_BACKENDS, resolve
from mlacheck.backends.toolkit import signature_problem
from mlacheck.harness import run_case
from mlacheck.spec import DecodeCase, Paging, PrefillCase, Quant, Request, Segment
from mlacheck.verdict import SKIP

SMALL_DECODE = DecodeCase(requests=(Request(1, 40),), num_heads=16, page_size=16)


# --------------------------------------------------------------------------- isolation


def test_importing_mlacheck_and_the_adapter_never_imports_aiter() -> None:
    code = (
        "import sys, mlacheck, mlacheck.backends.aiter, mlacheck.backends.registry as r\n"
        "for n in ('aiter', 'aiter-nonpersistent', 'aiter-model', 'aiter-model-nonpersistent'):\n"
        "    r.resolve(n)\n"
        "bad = sorted(m for m in sys.modules if m == 'aiter' or m.startswith('aiter.'))\n"
        "print('IMPORTED', bad)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "IMPORTED []" in res.stdout, res.stdout + res.stderr


def test_registry_names_and_default() -> None:
    assert BUILTIN["aiter"] == "mlacheck.backends.aiter:factory"
    assert BUILTIN["aiter-nonpersistent"] == "mlacheck.backends.aiter:nonpersistent_factory"
    assert BUILTIN["aiter-model"] == "mlacheck.backends.aiter:model_factory"
    assert BUILTIN["aiter-model-nonpersistent"] == (
        "mlacheck.backends.aiter:model_nonpersistent_factory")
    # the embedded default: the model on both chips, pinned whatever the environment says
    assert DEFAULT_BACKENDS == ("aiter-model-gfx942", "aiter-model-gfx950")
    for name in DEFAULT_BACKENDS:
        pinned = resolve(name)
        assert pinned.name == name and pinned.env["MLACHECK_AITER_MODEL_GFX"] == name[-6:]
        assert pinned._load().gfx == name[-6:]
    real, model = resolve("aiter"), resolve("aiter-model")
    assert (real.name, real.persistent, real.api_module_name) == ("aiter", True, "aiter")
    assert (model.name, model.api_module_name) == ("aiter-model", "mlacheck.backends.aiter_model")
    assert not resolve("aiter-nonpersistent").persistent
    assert "cpu" in model.devices and real.devices == ("cuda",)


# --------------------------------------------------------------------------- SKIP here


def test_real_aiter_skips_here_with_a_clear_reason() -> None:
    """No ROCm on this machine: every case SKIPs, the reason names aiter and why."""
    backend = resolve("aiter")
    why = backend.unavailable()
    assert why, "the real aiter cannot be usable on a machine without ROCm"
    assert "aiter" in why and ("not installed" in why or "failed to import" in why
                               or "not AMD AITER" in why), why
    for case in (SMALL_DECODE, PrefillCase(segments=(Segment(8),))):
        v = run_case(case, backend)
        assert v.status == SKIP and v.reason.startswith("unavailable: "), v.reason


def test_not_installed_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str, package: str | None = None) -> Any:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(adapter_mod, "_distribution_of", lambda top: [])
    monkeypatch.setattr(adapter_mod.importlib, "import_module", missing)
    assert load_api("aiter") == "aiter not installed (pip install mlacheck[rocm] -> amd-aiter)"


def test_asyncio_aiter_is_recognised_by_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter_mod, "_distribution_of", lambda top: ["aiter"])
    why = load_api("aiter")
    assert isinstance(why, str) and "not AMD AITER" in why and "asyncio" in why


def test_asyncio_aiter_is_recognised_by_missing_mla(monkeypatch: pytest.MonkeyPatch) -> None:
    """An importable `aiter` with no distribution record and no `mla` submodule."""
    import types

    monkeypatch.setattr(adapter_mod, "_distribution_of", lambda top: [])
    monkeypatch.setitem(sys.modules, "aiter", types.ModuleType("aiter"))
    monkeypatch.setitem(sys.modules, "aiter.mla", None)  # import of aiter.mla fails
    why = load_api("aiter")
    assert isinstance(why, str) and "no 'mla' submodule" in why and "asyncio" in why


# --------------------------------------------------------------------------- signatures


def test_head_fake_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    name = install_fake_aiter(monkeypatch, "fake_aiter_head")
    adapter = AiterAdapter(name, devices=("cpu",))
    assert adapter.unavailable() is None
    api = adapter._load()
    assert not isinstance(api, str) and api.problems == {}
    assert all(getattr(c, "refusal", None) is None for c in adapter.capabilities().values())


@pytest.mark.parametrize(("qualname", "mutated", "expect"), [
    # a renamed parameter (sm_scale -> softmax_scale)
    ("mla.mla_decode_fwd",
     lambda q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
     page_size=1, nhead_kv=1, softmax_scale=None, logit_cap=0.0, num_kv_splits=None,
     num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None, work_info_set=None,
     reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None, q_scale=None,
     kv_scale=None, return_lse=False, causal=True: None,
     "mla.mla_decode_fwd has no parameter 'sm_scale'"),
    # a removed parameter (return_lse)
    ("mla.mla_decode_fwd",
     lambda q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
     page_size=1, nhead_kv=1, sm_scale=None, logit_cap=0.0, num_kv_splits=None,
     num_kv_splits_indptr=None, work_meta_data=None, work_indptr=None, work_info_set=None,
     reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None, q_scale=None,
     kv_scale=None, causal=True: None,
     "mla.mla_decode_fwd has no parameter 'return_lse'"),
    # a new required parameter
    ("get_mla_metadata_info_v1",
     lambda batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse, cu_count,
     fast_mode=True, num_kv_splits=32, intra_batch_mode=False, max_split_per_batch=-1: None,
     "get_mla_metadata_info_v1 requires parameter 'cu_count'"),
    # a missing function
    ("get_mla_metadata_v1", None, "has no get_mla_metadata_v1"),
])
def test_incompatible_decode_api_makes_the_backend_unavailable(
        monkeypatch: pytest.MonkeyPatch, qualname: str, mutated: Callable[..., Any] | None,
        expect: str) -> None:
    name = install_fake_aiter(monkeypatch, f"fake_aiter_{abs(hash(expect)) % 10**6}",
                              replace={qualname: mutated})
    adapter = AiterAdapter(name, devices=("cpu",))
    why = adapter.unavailable()
    assert why is not None and expect in why, why
    assert "\n" not in why
    v = run_case(SMALL_DECODE, adapter)
    assert v.status == SKIP and expect in v.reason


def test_aiter_0_1_7_api_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    name = install_fake_aiter(monkeypatch, "fake_aiter_017", replace={
        "mla.mla_decode_fwd": mla_decode_fwd_0_1_7,
        "get_mla_metadata_v1": get_mla_metadata_v1_0_1_7,
        "mla.mla_prefill_ps_fwd": None, "get_ps_metadata_info_v1": None,
        "get_ps_metadata_v1": None})
    for persistent in (True, False):
        why = AiterAdapter(name, persistent=persistent, devices=("cpu",)).unavailable()
        assert why is not None and "0.1.7" in why, why
    assert "mla_decode_fwd has no parameter 'page_size'" in (
        AiterAdapter(name, persistent=False, devices=("cpu",)).unavailable() or "")


def test_incompatible_prefill_api_skips_only_that_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A renamed mha_batch_prefill_func parameter: paged prefill SKIPs naming it, decode stays."""
    def renamed(q, k, v, cu_seqlens_q, kv_indptr, kv_page_indices, max_seqlen_q,  # noqa: ANN001, ANN202
                max_seqlen_k, dropout_p=0.0, softmax_scale=None, soft_cap=0.0, causal=False,
                window_size=(-1, -1), return_lse=False, out=None, kv_last_page_lens=None,
                q_descale=None, k_descale=None, v_descale=None):
        raise NotImplementedError

    name = install_fake_aiter(monkeypatch, "fake_aiter_ck", replace={
        "mha_batch_prefill_func": renamed})
    adapter = AiterAdapter(name, devices=("cpu",))
    assert adapter.unavailable() is None
    case = PrefillCase(segments=(Segment(8, 8),), paging=Paging(16, "linear"))
    v = run_case(case, adapter)
    assert v.status == SKIP
    assert "mha_batch_prefill_func has no parameter 'logits_soft_cap'" in v.reason, v.reason


def _stub_from_ast(fn: ast.FunctionDef) -> Callable[..., Any]:
    """A callable whose inspect.signature is the parameter list of a parsed `def`."""
    P = inspect.Parameter
    args = fn.args
    params: list[inspect.Parameter] = []
    positional = [(a, P.POSITIONAL_ONLY) for a in args.posonlyargs] + [
        (a, P.POSITIONAL_OR_KEYWORD) for a in args.args]
    first_default = len(positional) - len(args.defaults)
    for i, (a, kind) in enumerate(positional):
        params.append(P(a.arg, kind, default=None if i >= first_default else P.empty))
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None))
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))

    def stub(*a: Any, **k: Any) -> None:
        raise NotImplementedError

    stub.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return stub


INSTALLED_SOURCES = {
    "get_mla_metadata_info_v1": "ops/attention.py",
    "get_mla_metadata_v1": "ops/attention.py",
    "get_ps_metadata_info_v1": "ops/attention.py",
    "get_ps_metadata_v1": "ops/attention.py",
    "mla.mla_decode_fwd": "mla.py",
    "mla.mla_prefill_ps_fwd": "mla.py",
    "mha_batch_prefill_func": "ops/mha.py",
}


def _aiter_source_root() -> Path | None:
    """The `aiter` package directory of an AITER source tree: $MLACHECK_AITER_SRC (a
    checkout's root) or the installed amd-aiter."""
    env = os.environ.get("MLACHECK_AITER_SRC")
    if env:
        return Path(env) / "aiter"
    spec = importlib.util.find_spec("aiter")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def test_adapter_matches_the_aiter_sources() -> None:
    """The keywords the adapter passes fit AITER's real signatures, read from its source files
    with `ast` (importing aiter needs ROCm): the installed amd-aiter, or the checkout named by
    MLACHECK_AITER_SRC (run with AITER main at e4048607, the adapter's target)."""
    root = _aiter_source_root()
    if root is None:
        pytest.skip("no AITER sources (install amd-aiter or set MLACHECK_AITER_SRC)")
    if not (root / "mla.py").exists():
        pytest.skip(f"{root} is not AMD AITER's package directory")
    checked = []
    for qualname, rel in INSTALLED_SOURCES.items():
        tree = ast.parse((root / rel).read_text())
        name = qualname.rpartition(".")[2]
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
        assert defs, f"{name} not defined in aiter/{rel}"
        problem = signature_problem(_stub_from_ast(defs[-1]), f"aiter.{qualname}",
                                    CALLED_PARAMETERS[qualname])
        assert problem is None, problem
        checked.append(qualname)
    assert sorted(checked) == sorted(CALLED_PARAMETERS)


def test_signature_problem_accepts_kwargs_and_uninspectable() -> None:
    def anything(**kwargs: Any) -> None: ...

    assert signature_problem(anything, "f", ("x", "y")) is None
    signature_problem(len, "len", ("obj",))  # a builtin: inspectable or not, no exception

    def positional_only(a: int, /, b: int = 0) -> None: ...

    assert "positionally only" in (signature_problem(positional_only, "f", ("a", "b")) or "")


# --------------------------------------------------------------------------- chips


@pytest.mark.parametrize(("gfx", "fmt"), [("gfx942", "fp8_e4m3fnuz"), ("gfx950", "fp8_e4m3fn")])
def test_capabilities_follow_the_chip(monkeypatch: pytest.MonkeyPatch, gfx: str, fmt: str) -> None:
    name = install_fake_aiter(monkeypatch, f"fake_aiter_{gfx}", gfx=gfx)
    adapter = AiterAdapter(name, devices=("cpu",))
    caps = adapter.capabilities()
    other = "fp8_e4m3fn" if fmt == "fp8_e4m3fnuz" else "fp8_e4m3fnuz"
    for op in ("mla_decode", "mla_sparse_decode", "paged_prefill"):
        assert fmt in caps[op].q_formats and other not in caps[op].q_formats  # type: ignore[operator]
    fp8_decode = DecodeCase(requests=(Request(1, 40),), quant=Quant(other, other))
    assert "not in" in (caps["mla_decode"].why_not(fp8_decode, "cpu") or "")
    prefill = PrefillCase(segments=(Segment(8),), quant=Quant(fmt, fmt))
    why = caps["mla_prefill"].why_not(prefill, "cpu")
    bf16_why = caps["mla_prefill"].why_not(PrefillCase(segments=(Segment(8),)), "cpu") or ""
    if gfx == "gfx942":
        assert why is not None and "gfx942" in why and "refuses" in why
        assert bf16_why == why
    else:
        assert why is None
        assert "q format bf16" in bf16_why


def test_inconsistent_chip_and_fp8_dtype_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    name = install_fake_aiter(monkeypatch, "fake_aiter_badchip", gfx="gfx950")
    monkeypatch.setattr(sys.modules[f"{name}.dtypes"], "fp8", torch.float8_e4m3fnuz)
    why = AiterAdapter(name, devices=("cpu",)).unavailable()
    assert why is not None and "inconsistent" in why


def test_unsupported_chip(monkeypatch: pytest.MonkeyPatch) -> None:
    name = install_fake_aiter(monkeypatch, "fake_aiter_gfx90a", gfx="gfx90a")
    assert "gfx90a" in (AiterAdapter(name, devices=("cpu",)).unavailable() or "")


def test_nonpersistent_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    name = install_fake_aiter(monkeypatch, "fake_aiter_np")
    caps = AiterAdapter(name, persistent=False, devices=("cpu",)).capabilities()
    fn = Quant("fp8_e4m3fn", "fp8_e4m3fn")
    assert caps["mla_decode"].why_not(DecodeCase(num_heads=32, quant=fn), "cpu")
    assert caps["mla_decode"].why_not(DecodeCase(num_heads=128, quant=fn), "cpu") is None
    assert caps["mla_decode"].why_not(DecodeCase(num_heads=8, quant=fn), "cpu") is None
    assert caps["mla_decode"].why_not(DecodeCase(num_heads=48), "cpu") is None  # bf16 -> 64
    mixed = DecodeCase(quant=Quant("bf16", "fp8_e4m3fn"))
    assert "bf16/fp8_e4m3fn" in (caps["mla_decode"].why_not(mixed, "cpu") or "")
    persistent = AiterAdapter(name, devices=("cpu",)).capabilities()
    assert persistent["mla_decode"].why_not(mixed, "cpu") is None
    assert persistent["mla_decode"].why_not(DecodeCase(page_size=48), "cpu")


# --------------------------------------------------------------------------- head padding


@pytest.mark.parametrize(("heads", "padded", "repeat"), [
    (1, 16, 16), (2, 16, 8), (4, 16, 4), (8, 16, 2), (12, 16, 1), (3, 16, 1), (16, 16, 1),
    (24, 32, 1), (48, 48, 1), (100, 112, 1), (128, 128, 1)])
def test_persistent_head_padding(heads: int, padded: int, repeat: int) -> None:
    plan = head_padding(heads)
    assert (plan.padded, plan.repeat) == (padded, repeat)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        x = torch.randn(5, heads, 8).to(dtype)
        p = plan.pad(x)
        assert p.shape == (5, padded, 8) and p.dtype == dtype and p.is_contiguous()
        assert torch.equal(plan.unpad(p).float(), x.float())
        if repeat > 1:  # vLLM's repeat_interleave: each head `repeat` times in a row
            assert torch.equal(p[:, 1].float(), x[:, 0].float())
        elif padded > heads:
            assert torch.equal(p[:, heads:].float(), torch.zeros(5, padded - heads, 8))


def test_twelve_heads_are_not_padded_with_16_over_12() -> None:
    """16 // 12 == 1: a repeat-based pad would leave 12 heads (bug class 5)."""
    assert 16 // 12 == 1
    plan = head_padding(12)
    assert plan.padded == 16 and plan.repeat == 1 and plan.pad(torch.zeros(1, 12, 4)).shape[1] == 16


@pytest.mark.parametrize(("gfx", "max_q", "heads", "padded"), [
    ("gfx950", 1, 8, 16), ("gfx950", 1, 24, 32), ("gfx950", 1, 48, 64), ("gfx950", 1, 64, 64),
    ("gfx950", 1, 80, 128), ("gfx942", 2, 48, 64), ("gfx942", 1, 48, 128),
    ("gfx942", 1, 12, 16)])
def test_nonpersistent_head_padding(gfx: str, max_q: int, heads: int, padded: int) -> None:
    targets = capability.nonpersistent_head_targets(gfx, False, max_q)
    assert head_padding(heads, targets).padded == padded


# --------------------------------------------------------------------------- env, buffers


def test_environment_is_pinned_during_the_call_and_restored() -> None:
    key_set, key_unset = "AITER_MLA_USE_OPUS", "AITER_MLA_REDUCE_FLYDSL"
    saved = {k: os.environ.get(k) for k in (key_set, key_unset)}
    os.environ[key_set] = "1"
    os.environ.pop(key_unset, None)
    try:
        with pinned_environment(adapter_mod.AITER_ENV_CONTROLS):
            assert os.environ[key_set] == "0" and os.environ[key_unset] == "0"
            assert os.environ["AITER_MLA_DECODE_PERSISTENT_MAX_BATCH"] == "0"
            assert os.environ["AITER_ENABLE_EXPERIMENTAL"] == "0"
        assert os.environ[key_set] == "1" and key_unset not in os.environ
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_metadata_buffers_grow_only_when_needed() -> None:
    cache = MetadataBuffers()
    dev = torch.device("cpu")
    sizes = [((2,), torch.uint64), (81, torch.int32), ((100, 8), torch.int32),
             (11, torch.int32), ((10, 2), torch.int32), (50, torch.int32)]
    bufs, grew = cache.ensure(sizes, dev)
    assert grew and cache.allocations == 6
    first = {n: t.data_ptr() for n, t in bufs.items()}
    smaller = [((2,), torch.uint64), (81, torch.int32), ((60, 8), torch.int32),
               (5, torch.int32), ((4, 2), torch.int32), (20, torch.int32)]
    bufs, grew = cache.ensure(smaller, dev)
    assert not grew and {n: t.data_ptr() for n, t in bufs.items()} == first
    larger = [((2,), torch.uint64), (81, torch.int32), ((300, 8), torch.int32),
              (11, torch.int32), ((10, 2), torch.int32), (50, torch.int32)]
    bufs, grew = cache.ensure(larger, dev)
    assert grew and cache.allocations == 7 and bufs["work_info_set"].shape == (300, 8)
    assert bufs["reduce_indptr"].data_ptr() == first["reduce_indptr"]
