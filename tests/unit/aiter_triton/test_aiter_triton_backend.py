"""The aiter-triton backend without kernels: import isolation, clean SKIPs where AITER or a
GPU is missing, the signature check, capability rules, and the pure helpers (top-k slot
conversion, LSE from AITER's segment / split statistics). Runs with neither triton nor aiter
installed (the CI machine has neither)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlacheck.backends import aiter_triton as at
from mlacheck.backends.base import skip_reason
from mlacheck.backends.registry import BUILTIN, resolve
from mlacheck.backends.toolkit import signature_problem
from mlacheck.harness import RunOptions, run_case
from mlacheck.kvcache import PageTable
from mlacheck.spec import DecodeCase, Paging, PrefillCase, Quant, Request, Segment, SparseDecodeCase
from mlacheck.verdict import SKIP


def test_importing_the_backend_imports_neither_triton_nor_aiter() -> None:
    code = ("import sys; import mlacheck.backends.aiter_triton as m; m.factory(); "
            "bad = [k for k in sys.modules if k.split('.')[0] in ('aiter', 'triton')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_registered_as_a_builtin() -> None:
    assert BUILTIN["aiter-triton"] == "mlacheck.backends.aiter_triton:factory"
    b = resolve("aiter-triton")
    assert b.name == "aiter-triton"
    rope = resolve("mlacheck.backends.aiter_triton:grouped_rope_factory")
    assert rope.name == "aiter-triton-rope"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(at, "_LOADED", None)
    return monkeypatch


def _no_aiter(monkeypatch: pytest.MonkeyPatch) -> None:
    real = at.importlib.util.find_spec

    def find_spec(name: str, *a: object, **k: object) -> object:
        return None if name == "aiter" else real(name, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(at.importlib.util, "find_spec", find_spec)


def test_skips_cleanly_when_aiter_is_absent(fresh: pytest.MonkeyPatch) -> None:
    _no_aiter(fresh)
    b = at.factory()
    why = b.unavailable()
    assert why is not None
    if at.importlib.util.find_spec("triton") is None:
        assert why.startswith("triton not installed")
    else:
        assert why.startswith("aiter not installed")
    case = DecodeCase((Request(1, 64),))
    v = run_case(case, b, RunOptions("cpu"))
    assert v.status == SKIP and v.reason == f"unavailable: {why}"
    caps = b.capabilities()
    assert set(caps) == {"mla_decode", "mla_prefill", "mla_sparse_decode", "paged_prefill",
                         "mqa_logits", "paged_mqa_logits", "topk_indices", "mla_sparse_prefill",
                         "sparse_pipeline", "index_conversion"}
    assert all(c.why_not(case, "cpu") == why for c in caps.values())


def test_reason_when_triton_is_missing(fresh: pytest.MonkeyPatch) -> None:
    real = at.importlib.util.find_spec
    fresh.setattr(at.importlib.util, "find_spec",
                  lambda name, *a, **k: None if name == "triton" else real(name, *a, **k))
    assert at.factory().unavailable() == (
        "triton not installed (pip install triton; ROCm: the ROCm Triton wheel)")


def _fake_aiter(tmp_path: Path, files: list[str]) -> Path:
    root = tmp_path / "aiter"
    (root / "ops" / "triton").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("")
    return root


def _with_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    real = at.importlib.util.find_spec
    monkeypatch.setattr(at.importlib.util, "find_spec",
                        lambda name, *a, **k: object() if name == "triton" else real(name, *a, **k))


@pytest.mark.parametrize(("files", "env", "gpu", "interp", "expect"), [
    ([], {}, True, False, "has no aiter/ops/triton/attention kernels"),
    (["ops/triton/attention/mla.py"], {}, True, False, "AITER_TRITON_ONLY=1 needed"),
    (["ops/triton/attention/mla.py"], {"AITER_TRITON_ONLY": "1"}, False, False,
     "needs a GPU (or TRITON_INTERPRET=1)"),
    (["ops/triton/attention/mla.py"], {"AITER_TRITON_ONLY": "1"}, False, True, None),
    (["ops/triton/attention/mla.py"], {"AITER_TRITON_ONLY": "1"}, True, False, None),
])
def test_environment_reasons(fresh: pytest.MonkeyPatch, tmp_path: Path, files: list[str],
                             env: dict[str, str], gpu: bool, interp: bool,
                             expect: str | None) -> None:
    root = _fake_aiter(tmp_path, files)
    _with_triton(fresh)
    fresh.setattr(at, "_aiter_dir", lambda: root)
    fresh.setattr(at.compat, "on_rocm", lambda: False)
    fresh.setattr(at.torch.cuda, "is_available", lambda: gpu)
    fresh.delenv("AITER_TRITON_ONLY", raising=False)
    fresh.setenv("TRITON_INTERPRET", "1" if interp else "0")
    for k, v in env.items():
        fresh.setenv(k, v)
    why = at.environment_problem()
    if expect is None:
        assert why is None
    else:
        assert why is not None and expect in why


def test_asyncio_aiter_is_named(fresh: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = tmp_path / "aiter"
    root.mkdir()
    _with_triton(fresh)
    fresh.setattr(at, "_aiter_dir", lambda: root)
    why = at.environment_problem()
    assert why is not None and "no Triton modules" in why and "amd-aiter" in why


def test_rocm_does_not_need_triton_only(fresh: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = _fake_aiter(tmp_path, ["ops/triton/attention/mla.py"])
    _with_triton(fresh)
    fresh.setattr(at, "_aiter_dir", lambda: root)
    fresh.setattr(at.compat, "on_rocm", lambda: True)
    fresh.setattr(at.torch.cuda, "is_available", lambda: True)
    fresh.delenv("AITER_TRITON_ONLY", raising=False)
    assert at.environment_problem() is None


# --------------------------------------------------------------------------- signatures


def _head_decode(q, kv_buffer, out, cu_seqlens_q, seqused_k, max_seqlen_kv, block_tables,  # noqa: ANN001, ANN202
                 softmax_scale, kv_lora_rank, qk_rope_head_dim, causal, q_descale, kv_descale,
                 q_scales=None, out_scale=None, shuffled_kv_cache=False, skip_reduce=False):
    raise NotImplementedError


def test_signature_check_accepts_head_and_names_changes() -> None:
    key = "mla.mla_decode_fwd"
    passed = at.CALLED_PARAMETERS[key]
    assert signature_problem(_head_decode, key, passed) is None

    def renamed(q, kv_buffer, o, cu_seqlens_q, seqused_k, max_seqlen_kv, block_tables,  # noqa: ANN001, ANN202
                softmax_scale, kv_lora_rank, qk_rope_head_dim, causal, q_descale, kv_descale,
                skip_reduce=False):
        raise NotImplementedError

    why = signature_problem(renamed, key, passed)
    assert why == f"{key} has no parameter 'out' (renamed or removed)"

    def new_required(q, kv_buffer, out, cu_seqlens_q, seqused_k, max_seqlen_kv, block_tables,  # noqa: ANN001, ANN202
                     softmax_scale, kv_lora_rank, qk_rope_head_dim, causal, q_descale,
                     kv_descale, page_size, skip_reduce=False):
        raise NotImplementedError

    why = signature_problem(new_required, key, passed)
    assert why == f"{key} requires parameter 'page_size', which this adapter does not pass"

    def kwargs_only(**kw):  # noqa: ANN003, ANN202
        raise NotImplementedError

    assert signature_problem(kwargs_only, key, passed) is None


# --------------------------------------------------------------------------- capabilities


def test_capability_rules() -> None:
    from mlacheck.backends.base import Capability

    cap = Capability(format_pairs=frozenset({("bf16", "bf16"), ("bf16", "fp8_e4m3fn")}),
                     heads_multiple_of=16, uniform_q_len=True,
                     rules=(at.sparse_rows_nonempty,), devices=("cuda",))
    ok = DecodeCase((Request(2, 64), Request(2, 80)))
    assert cap.why_not(ok, "cuda") is None
    assert cap.why_not(ok, "cpu") == "device cpu not supported (devices: cuda)"
    mixed = DecodeCase((Request(1, 64), Request(2, 80)))
    assert "mixed q_len" in (cap.why_not(mixed, "cuda") or "")
    fp8_q = DecodeCase(quant=Quant("fp8_e4m3fn", "bf16"))
    assert cap.why_not(fp8_q, "cuda") == (
        "q/kv formats fp8_e4m3fn/bf16 not in {bf16/bf16, bf16/fp8_e4m3fn}")
    assert cap.why_not(DecodeCase(num_heads=24), "cuda") == "24 heads not a multiple of 16"
    empty = SparseDecodeCase((Request(1, 100),), topk=64, valid_cap=0)
    assert "no valid top-k index" in (cap.why_not(empty, "cuda") or "")
    assert cap.why_not(SparseDecodeCase((Request(1, 100),), topk=64), "cuda") is None
    refused = Capability(refusal="installed aiter lacks x")
    assert refused.why_not(ok, "cuda") == "installed aiter lacks x"


def test_capabilities_of_a_loaded_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capabilities as declared on an NVIDIA GPU, from a fake load (no aiter needed)."""
    loaded = at.Loaded("0.1.21.dev46+ge4048607a")
    loaded.problems["mla_sparse_decode"] = "installed aiter lacks sparse"
    monkeypatch.setattr(at, "load", lambda: loaded)
    monkeypatch.setattr(at.compat, "on_rocm", lambda: False)
    monkeypatch.setattr(at.compat, "interpreting", lambda: False)
    monkeypatch.setattr(at.torch.cuda, "is_available", lambda: True)
    b = at.factory()
    assert b.unavailable() is None
    caps = b.capabilities()
    dec = caps["mla_decode"]
    assert skip_reason(b, DecodeCase(page_size=16), "cuda") is None
    assert "page size 1 not in" in (dec.why_not(DecodeCase(page_size=1), "cuda") or "")
    # 256 = 2 tiles of 128, 48 = 3 of 16: run as a view; 1 is no tile at all (a kernel limit)
    assert dec.why_not(DecodeCase(page_size=256), "cuda") is None
    assert dec.why_not(DecodeCase(page_size=48), "cuda") is None
    assert "adapter:" not in (dec.why_not(DecodeCase(page_size=1), "cuda") or "adapter:")
    fp8 = Quant("fp8_e4m3fn", "fp8_e4m3fn")
    assert dec.why_not(DecodeCase(quant=fp8, page_size=64), "cuda") is None
    assert dec.why_not(DecodeCase(quant=fp8, page_size=512), "cuda") is None  # 128-token view
    assert "K >= 32" in (dec.why_not(DecodeCase(quant=fp8, page_size=16), "cuda") or "")
    assert "page size 48 (run as 16-token pages) with FP8 q" in (
        dec.why_not(DecodeCase(quant=fp8, page_size=48), "cuda") or "")
    assert dec.why_not(DecodeCase(quant=Quant("bf16", "fp8_e4m3fn")), "cuda") is None
    fnuz = dec.why_not(DecodeCase(quant=Quant("fp8_e4m3fnuz", "fp8_e4m3fnuz")), "cuda")
    assert fnuz is not None and "fp8_e4m3fnuz" in fnuz
    pre = caps["mla_prefill"]
    assert pre.why_not(PrefillCase((Segment(30, 20),), causal=False), "cuda") is None
    assert (pre.why_not(PrefillCase(soft_cap=30.0), "cuda") or "").startswith(
        "soft cap not supported ('softcap not implemented in varlen v3 yet'")
    mixed = pre.why_not(PrefillCase(quant=Quant("bf16", "fp8_e4m3fn")), "cuda")
    assert mixed is not None and "q/kv formats" in mixed
    assert caps["mla_sparse_decode"].why_not(SparseDecodeCase(), "cuda") == (
        "installed aiter lacks sparse")
    paged = caps["paged_prefill"]
    lse = paged.why_not(PrefillCase(paging=Paging(16)), "cuda")  # return_lse by default
    assert lse is not None and lse.startswith("LSE output not supported (extend_attention_fwd")
    no_lse = PrefillCase(segments=(Segment(20, 44), Segment(0, 9)), paging=Paging(1),
                         return_lse=False, soft_cap=30.0, causal=False)
    assert paged.why_not(no_lse, "cuda") is None
    assert "fp8_e4m3fn" in (paged.why_not(dataclasses.replace(no_lse, quant=fp8), "cuda") or "")
    # mixed q_len and empty requests run (split launches); any page size for sparse (a view)
    assert dec.why_not(DecodeCase((Request(1, 64), Request(0, 9), Request(3, 80))), "cuda") is None


def test_interpreter_capabilities(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(at, "load", lambda: at.Loaded("x"))
    monkeypatch.setattr(at.compat, "on_rocm", lambda: False)
    monkeypatch.setattr(at.compat, "interpreting", lambda: True)
    monkeypatch.setattr(at.torch.cuda, "is_available", lambda: False)
    caps = at.factory().capabilities()
    f32 = DecodeCase(quant=Quant("fp32", "fp32"))
    assert caps["mla_decode"].why_not(f32, "cpu") is None
    bf = caps["mla_decode"].why_not(DecodeCase(), "cpu")
    assert bf is not None and "bf16" in bf
    assert caps["mla_prefill"].why_not(PrefillCase(quant=Quant("fp32", "fp32")), "cpu") == (
        "device cpu not supported (devices: )")


# --------------------------------------------------------------------------- pure helpers


def _table() -> PageTable:
    # request 0: 37 tokens on pages 5, 2, 7; request 1: 16 tokens on page 0 (page size 16)
    return PageTable(16, torch.tensor([0, 3, 4]), torch.tensor([5, 2, 7, 0]),
                     torch.tensor([37, 16]))


def test_topk_logical_to_global_slots() -> None:
    table = _table()
    qo = torch.tensor([0, 2, 3], dtype=torch.int32)  # request 0 has 2 query tokens
    topk = torch.tensor([[0, 15, 16, 36, -1], [33, -1, -1, -1, -1], [15, 0, -1, 3, -1]],
                        dtype=torch.int32)
    got = at.topk_to_global_slots(topk, qo, table)
    assert got.dtype == torch.int32
    expect = [[80, 95, 32, 7 * 16 + 4, -1], [7 * 16 + 1, -1, -1, -1, -1], [15, 0, -1, 3, -1]]
    assert got.tolist() == expect
    # every valid entry equals the page table's own slot of that logical position
    for t, r in enumerate([0, 0, 1]):
        for j, pos in enumerate(topk[t].tolist()):
            if pos >= 0:
                assert int(got[t, j]) == int(table.slots_of(r)[pos])


def test_topk_conversion_rejects_bad_input() -> None:
    table = _table()
    with pytest.raises(ValueError, match="past its request's kv_len"):
        at.topk_to_global_slots(torch.tensor([[37], [0], [0]], dtype=torch.int32),
                                torch.tensor([0, 2, 3]), table)
    with pytest.raises(ValueError, match="rows for"):
        at.topk_to_global_slots(torch.zeros(2, 4, dtype=torch.int32), torch.tensor([0, 2, 3]),
                                table)


def _segments_like_aiter(logits: torch.Tensor, seg: int, tile: int) -> tuple[torch.Tensor,
                                                                                torch.Tensor]:
    """Per-segment (max, expsum) in base 2 the way mla_decode_fwd's kernel writes them, with
    the never-written segments holding garbage (NaN)."""
    length = logits.shape[-1]
    tps = -(-length // (seg * tile))
    x2 = logits * (1 / math.log(2.0))
    mx = torch.full((*logits.shape[:-1], seg), float("nan"))
    sm = torch.full_like(mx, float("nan"))
    for s in range(seg):
        lo, hi = s * tps * tile, min(length, (s + 1) * tps * tile)
        if lo >= length:
            break  # the kernel returns early: nothing written
        part = x2[..., lo:hi]
        mx[..., s] = part.amax(-1)
        sm[..., s] = torch.exp2(part - mx[..., s : s + 1]).sum(-1)
    return mx, sm


@pytest.mark.parametrize("length", [1, 16, 37, 200, 1000])
def test_lse_from_segments_matches_logsumexp(length: int) -> None:
    g = torch.Generator().manual_seed(length)
    logits = torch.randn(2, 3, length, generator=g, dtype=torch.float64).float() * 3
    mx, sm = _segments_like_aiter(logits, seg=8, tile=16)
    lse = at.lse_from_segments(mx, sm, torch.tensor([length, length]), tile=16)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)


def test_lse_from_segments_empty_segment_in_range() -> None:
    # a segment inside the active range that saw no tile (causal MTP) keeps M=-inf, L=1
    mx = torch.tensor([[[2.0, float("-inf"), float("nan")]]])
    sm = torch.tensor([[[3.0, 1.0, float("nan")]]])
    # 20 tokens, tile 16, 3 segments: 1 tile per segment, segments 0-1 active, 2 never written
    lse = at.lse_from_segments(mx, sm, torch.tensor([20]), tile=16)
    assert math.isclose(float(lse), (2.0 + math.log2(3.0)) * math.log(2.0), rel_tol=1e-6)


def test_lse_from_splits_ignores_unwritten_splits() -> None:
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([3, 40])
    s = 8
    logits = [torch.randn(4, n, generator=g) for n in lens.tolist()]
    split = torch.full((2, 4, s), float("nan"))
    for b, x in enumerate(logits):
        per = -(-x.shape[-1] // s)
        for i in range(s):
            lo, hi = i * per, min(x.shape[-1], (i + 1) * per)
            if hi > lo:
                split[b, :, i] = torch.logsumexp(x[:, lo:hi], -1)
    got = at.lse_from_splits(split, lens)
    expect = torch.stack([torch.logsumexp(x, -1) for x in logits])
    torch.testing.assert_close(got, expect)


def test_check_tool_lives_apart_and_says_why_nothing_ran(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """The smoke / compile-only tool is its own module; without AITER it names the reason."""
    from mlacheck.backends import aiter_triton
    from mlacheck.tools import aiter_triton_check

    assert not hasattr(aiter_triton, "main") and not hasattr(aiter_triton, "compile_check")
    if not isinstance(aiter_triton.load(), str):
        pytest.skip("AITER's Triton kernels are importable here")
    assert aiter_triton_check.main(["--device", "cpu"]) == 0
    assert "SKIP all: " in capsys.readouterr().out
    assert aiter_triton_check.main(["--device", "tpu"]) == 2  # the suite's one device check
    assert "unknown device 'tpu'" in capsys.readouterr().err
