"""The FlashInfer prebuild tool against a stand-in `flashinfer.jit` with 0.2.14.post1's
generator signatures (copied from flashinfer/jit/attention/pytorch.py and jit/core.py)."""

from __future__ import annotations

import inspect
import sys
import tarfile
import types
from pathlib import Path

import pytest

from mlacheck.tools import flashinfer_prebuild


def _fake_jit(root: Path) -> types.ModuleType:
    jit = types.ModuleType("flashinfer.jit")
    built: list[str] = []

    def spec(name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(name=name, jit_library_path=root / "cache" / f"{name}.so",
                                     aot_path=root / "data" / "aot" / name / f"{name}.so")

    def gen_batch_mla_module(backend, dtype_q, dtype_kv, dtype_o, dtype_idx,  # noqa: ANN001, ANN202
                             head_dim_ckv, head_dim_kpe, use_profiler):
        return spec(f"mla_{backend}_{dtype_q}_{dtype_kv}_{head_dim_ckv}_{head_dim_kpe}".replace("torch.", ""))

    def gen_batch_prefill_module(backend, dtype_q, dtype_kv, dtype_o, dtype_idx,  # noqa: ANN001, ANN202
                                 head_dim_qk, head_dim_vo, pos_encoding_mode, use_sliding_window,
                                 use_logits_soft_cap, use_fp16_qk_reduction):
        kv = "" if dtype_kv == dtype_q else f"_kv_{dtype_kv}"
        return spec(f"prefill_{backend}_{dtype_q}{kv}_{head_dim_qk}_{head_dim_vo}_cap"
                    f"{use_logits_soft_cap}".replace("torch.", ""))

    def build_jit_specs(specs, verbose=False, skip_prebuilt=True):  # noqa: ANN001, ANN202
        for s in specs:
            if skip_prebuilt and s.aot_path.exists():  # as 0.7.2's jit/core.py:838 does
                continue
            s.jit_library_path.parent.mkdir(parents=True, exist_ok=True)
            s.jit_library_path.write_bytes(s.name.encode())
            built.append(s.name)

    jit.gen_batch_mla_module = gen_batch_mla_module
    jit.gen_batch_prefill_module = gen_batch_prefill_module
    jit.build_jit_specs = build_jit_specs
    jit.built = built
    jit.spec = spec
    return jit


def _fake_jit_topk(jit: types.ModuleType) -> types.ModuleType:
    """0.7.2.post1's flashinfer/jit/topk.py: gen_topk_module() takes nothing, module `topk`."""
    topk = types.ModuleType("flashinfer.jit.topk")
    topk.gen_topk_module = lambda: jit.spec("topk")
    return topk


def _install(monkeypatch, jit: types.ModuleType, prefill: types.ModuleType,  # noqa: ANN001
             topk: types.ModuleType | None = None) -> None:
    """A 0.7-like flashinfer with `topk` (flashinfer.jit.topk), else a 0.2.14-like one: that
    import fails (None in sys.modules)."""
    root = types.ModuleType("flashinfer")
    root.jit, root.prefill = jit, prefill
    for name, mod in (("flashinfer", root), ("flashinfer.jit", jit),
                      ("flashinfer.prefill", prefill), ("flashinfer.jit.topk", topk)):
        monkeypatch.setitem(sys.modules, name, mod)


def test_builds_each_variant_the_backends_select_and_archives_them(tmp_path: Path,
                                                                   monkeypatch) -> None:  # noqa: ANN001
    jit = _fake_jit(tmp_path)
    _install(monkeypatch, jit, types.ModuleType("flashinfer.prefill"))
    for gen, kwargs in flashinfer_prebuild.installed_variants():
        # every keyword is a real parameter of the generator it goes to
        inspect.signature(flashinfer_prebuild.resolve(gen)).bind(**kwargs)
    assert flashinfer_prebuild.TOPK not in dict(flashinfer_prebuild.installed_variants())
    installed = flashinfer_prebuild.prebuild(tmp_path / "aot.tar.xz")
    assert len(installed) == len(set(jit.built)) == 12  # fa2/fa3 x bf16/fp16 x (decode + 2 prefill)
    assert "topk" not in jit.built  # 0.2.14 has no top-k module
    with pytest.raises(SystemExit):  # nothing to build: said, not an empty archive
        flashinfer_prebuild.main(["--topk-only"])
    assert {p.read_bytes().decode() for p in installed} == set(jit.built)
    assert "mla_fa3_bfloat16_bfloat16_512_64" in jit.built and "prefill_fa2_float16_192_128_capTrue" in jit.built
    with tarfile.open(tmp_path / "aot.tar.xz") as tar:
        assert sum(n.endswith(".so") for n in tar.getnames()) == 12
        assert all(n.startswith("aot") for n in tar.getnames())


def test_without_flashinfer_it_says_so_with_exit_2(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert flashinfer_prebuild.main([]) == 2
    assert "FlashInfer is not importable" in capsys.readouterr().err



def test_07_builds_fa2_prefill_as_its_two_modules_and_the_fp8_kv_decode(tmp_path: Path,
                                                                        monkeypatch) -> None:  # noqa: ANN001
    """0.7.x: fa2's batch prefill is a primary + an independent-stride paged module (both
    built), and the MLA decode has a bf16-q / fp8_e4m3fn-KV variant."""
    jit = _fake_jit(tmp_path)
    prefill = types.ModuleType("flashinfer.prefill")
    for gen in flashinfer_prebuild.FA2_PREFILL_07:
        name = gen.split(".")[1]

        def make(tag: str):  # noqa: ANN202
            def generator(backend, **kw):  # noqa: ANN001, ANN202
                return jit.gen_batch_prefill_module(backend + tag, **kw)
            return generator
        setattr(prefill, name, make("_independent" if "independent" in name else "_primary"))
    _install(monkeypatch, jit, prefill)
    monkeypatch.setattr(flashinfer_prebuild.adapter_module(), "load", lambda: object())
    monkeypatch.setattr(flashinfer_prebuild.adapter_module(), "takes_fp8_kv", lambda got: True)
    installed = flashinfer_prebuild.prebuild()
    # fa2: 3 MLA + 2 x 4 prefill; fa3: 3 MLA + 4 prefill
    assert len(installed) == len(set(jit.built)) == 18
    assert "mla_fa2_bfloat16_float8_e4m3fn_512_64" in jit.built
    assert sum(n.startswith("prefill_fa2_independent") for n in jit.built) == 4


def test_07_fp8_kv_prefill_adds_fa2_modules_and_builds_only_what_is_missing(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Where the installed prefill run() takes k_scale / v_scale, fa2 gets bf16-q / fp8_e4m3fn-K/V
    prefill modules (x soft cap, ragged/paged-equal primary + independent-stride paged); fa3 none
    (its FP8 prefill needs FP8 q and equal head dims). Installed modules are not rebuilt."""
    import torch

    vs = flashinfer_prebuild.variants(split_fa2_prefill=True, fp8_kv=True, fp8_kv_prefill=True)
    fp8 = [(g, kw) for g, kw in vs if g != flashinfer_prebuild.MLA
           and kw["dtype_kv"] == torch.float8_e4m3fn]
    assert len(fp8) == 4 and {kw["backend"] for _, kw in fp8} == {"fa2"}
    assert {g for g, _ in fp8} == set(flashinfer_prebuild.FA2_PREFILL_07)
    assert all(kw["dtype_q"] == kw["dtype_o"] == torch.bfloat16 for _, kw in fp8)
    assert len(vs) == 22
    jit = _fake_jit(tmp_path)
    _install(monkeypatch, jit, types.ModuleType("flashinfer.prefill"))
    monkeypatch.setattr(flashinfer_prebuild.adapter_module(), "load", lambda: object())
    monkeypatch.setattr(flashinfer_prebuild.adapter_module(), "takes_fp8_kv_prefill", lambda got: True)
    first = flashinfer_prebuild.prebuild()
    assert "prefill_fa2_bfloat16_kv_float8_e4m3fn_192_128_capTrue" in jit.built
    jit.built.clear()
    assert flashinfer_prebuild.prebuild() == first and jit.built == []


def test_a_selection_builds_only_its_modules(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`--kv-format fp8_e4m3fn --prefill-only`: the FP8-K/V prefill modules, nothing else (what
    a GPU check of that path needs without the whole archive)."""
    jit = _fake_jit(tmp_path)
    _install(monkeypatch, jit, types.ModuleType("flashinfer.prefill"))
    adapter = flashinfer_prebuild.adapter_module()
    monkeypatch.setattr(adapter, "load", lambda: object())
    monkeypatch.setattr(adapter, "takes_fp8_kv", lambda got: True)
    monkeypatch.setattr(adapter, "takes_fp8_kv_prefill", lambda got: True)
    assert flashinfer_prebuild.main(["--kv-format", "fp8_e4m3fn", "--prefill-only"]) == 0
    assert sorted(jit.built) == ["prefill_fa2_bfloat16_kv_float8_e4m3fn_192_128_capFalse",
                                 "prefill_fa2_bfloat16_kv_float8_e4m3fn_192_128_capTrue"]
    jit.built.clear()
    assert flashinfer_prebuild.main(["--kv-format", "fp8_e4m3fn"]) == 0  # + the MLA fp8-KV decode
    assert len(jit.built) == 2 and all(n.startswith("mla_") for n in jit.built)  # prefill: installed
    monkeypatch.setattr(adapter, "takes_fp8_kv_prefill", lambda got: False)
    monkeypatch.setattr(adapter, "takes_fp8_kv", lambda got: False)
    with pytest.raises(SystemExit):
        flashinfer_prebuild.main(["--kv-format", "fp8_e4m3fn"])


def test_07_builds_and_installs_the_topk_module_alone_or_with_the_rest(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """0.7.x's top-k module is in the full build, installed at its aot_path like the attention
    modules (where the adapter looks for it); `--topk-only` builds it alone, and the format /
    prefill selections leave it out (it has no K/V format)."""
    from mlacheck.backends import flashinfer

    jit = _fake_jit(tmp_path)
    _install(monkeypatch, jit, types.ModuleType("flashinfer.prefill"), _fake_jit_topk(jit))
    adapter = flashinfer_prebuild.adapter_module()
    monkeypatch.setattr(adapter, "load", lambda: object())
    monkeypatch.setattr(adapter, "takes_fp8_kv", lambda got: True)
    monkeypatch.setattr(adapter, "takes_fp8_kv_prefill", lambda got: True)
    assert (flashinfer_prebuild.TOPK, {}) in flashinfer_prebuild.installed_variants()
    assert flashinfer_prebuild.main(["--kv-format", "fp8_e4m3fn", "--prefill-only"]) == 0
    assert flashinfer_prebuild.main(["--prefill-only"]) == 0
    assert "topk" not in jit.built
    assert flashinfer_prebuild.main(["--topk-only"]) == 0
    assert jit.built[-1] == "topk" and jit.built.count("topk") == 1
    aot = tmp_path / "data" / "aot" / "topk" / "topk.so"
    assert aot.read_bytes() == b"topk"
    loaded = types.SimpleNamespace(module=sys.modules["flashinfer"])
    assert flashinfer.top_k_module_missing(loaded) is None  # the adapter finds it there
    jit.built.clear()
    installed = flashinfer_prebuild.prebuild(tmp_path / "aot.tar.xz")
    assert aot in installed and "topk" not in jit.built  # installed already: not rebuilt
    assert len(jit.built) == 6  # the 6 MLA decode modules the selections above left out
    with tarfile.open(tmp_path / "aot.tar.xz") as tar:
        assert "aot/topk/topk.so" in tar.getnames()
    with pytest.raises(SystemExit):
        flashinfer_prebuild.main(["--topk-only", "--prefill-only"])


def test_the_full_07_build_includes_the_topk_module(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """One run, nothing installed before: the top-k module is built with the others."""
    jit = _fake_jit(tmp_path)
    _install(monkeypatch, jit, types.ModuleType("flashinfer.prefill"), _fake_jit_topk(jit))
    installed = flashinfer_prebuild.prebuild()
    assert len(installed) == 13 and "topk" in jit.built
    assert (tmp_path / "data" / "aot" / "topk" / "topk.so").exists()
