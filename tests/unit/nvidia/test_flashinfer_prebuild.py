"""The FlashInfer prebuild tool against a stand-in `flashinfer.jit` with 0.2.14.post1's
generator signatures (copied from flashinfer/jit/attention/pytorch.py and jit/core.py)."""

from __future__ import annotations

import inspect
import sys
import tarfile
import types
from pathlib import Path

from mlacheck.backends import flashinfer_prebuild


def _fake_jit(root: Path) -> types.ModuleType:
    jit = types.ModuleType("flashinfer.jit")
    built: list[str] = []

    def spec(name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(name=name, jit_library_path=root / "cache" / f"{name}.so",
                                     aot_path=root / "data" / "aot" / name / f"{name}.so")

    def gen_batch_mla_module(backend, dtype_q, dtype_kv, dtype_o, dtype_idx,  # noqa: ANN001, ANN202
                             head_dim_ckv, head_dim_kpe, use_profiler):
        return spec(f"mla_{backend}_{dtype_q}_{head_dim_ckv}_{head_dim_kpe}".replace("torch.", ""))

    def gen_batch_prefill_module(backend, dtype_q, dtype_kv, dtype_o, dtype_idx,  # noqa: ANN001, ANN202
                                 head_dim_qk, head_dim_vo, pos_encoding_mode, use_sliding_window,
                                 use_logits_soft_cap, use_fp16_qk_reduction):
        return spec(f"prefill_{backend}_{dtype_q}_{head_dim_qk}_{head_dim_vo}_cap"
                    f"{use_logits_soft_cap}".replace("torch.", ""))

    def build_jit_specs(specs, verbose=False, skip_prebuilt=True):  # noqa: ANN001, ANN202
        for s in specs:
            s.jit_library_path.parent.mkdir(parents=True, exist_ok=True)
            s.jit_library_path.write_bytes(s.name.encode())
            built.append(s.name)

    jit.gen_batch_mla_module = gen_batch_mla_module
    jit.gen_batch_prefill_module = gen_batch_prefill_module
    jit.build_jit_specs = build_jit_specs
    jit.built = built
    return jit


def test_builds_each_variant_the_backends_select_and_archives_them(tmp_path: Path,
                                                                   monkeypatch) -> None:  # noqa: ANN001
    jit = _fake_jit(tmp_path)
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.jit", jit)
    for gen, kwargs in flashinfer_prebuild.variants():
        inspect.signature(getattr(jit, gen)).bind(**kwargs)  # every keyword is a real parameter
    installed = flashinfer_prebuild.prebuild(tmp_path / "aot.tar.xz")
    assert len(installed) == len(set(jit.built)) == 12  # fa2/fa3 x bf16/fp16 x (decode + 2 prefill)
    assert {p.read_bytes().decode() for p in installed} == set(jit.built)
    assert "mla_fa3_bfloat16_512_64" in jit.built and "prefill_fa2_float16_192_128_capTrue" in jit.built
    with tarfile.open(tmp_path / "aot.tar.xz") as tar:
        assert sum(n.endswith(".so") for n in tar.getnames()) == 12
        assert all(n.startswith("aot") for n in tar.getnames())


def test_without_flashinfer_it_says_so_with_exit_2(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert flashinfer_prebuild.main([]) == 2
    assert "FlashInfer is not importable" in capsys.readouterr().err

