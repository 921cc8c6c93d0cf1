"""Checks of AITER's Triton MLA kernels without pytest, for bringing the aiter-triton backend
up on a new machine: a smoke run of a few cases through mlacheck's harness, and a
compile-only mode that needs no GPU (compiles the kernels for sm_90 through the backend's own
code path and reports shared memory; nothing launches). Usage: docs/aiter-triton.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mlacheck.backends import aiter_triton_compat as compat
from mlacheck.backends.aiter_triton import (
    H100_MAX_SHARED_BYTES,
    AiterTritonBackend,
    aiter_version,
    factory,
    grouped_rope_factory,
    load,
)
from mlacheck.preflight import PreflightError, resolve_device
from mlacheck.spec import Case, DecodeCase, Op, PrefillCase, SparseDecodeCase

# --------------------------------------------------------------------------- compile-only


class _WarmupProxy:
    """Stands in for one AITER kernel object: `kernel[grid](...)` compiles (Triton's
    `warmup`) instead of launching, and records the kernel's static shared memory."""

    _OWN = ("kernel", "name", "sink", "context")

    def __init__(self, kernel: Any, name: str, sink: list[dict[str, Any]],
                 context: dict[str, str]) -> None:
        self.kernel, self.name, self.sink, self.context = kernel, name, sink, context

    def __getattr__(self, attr: str) -> Any:  # arg_names, configs: the compat layer uses them
        return getattr(self.kernel, attr)

    def __setattr__(self, attr: str, value: Any) -> None:  # e.g. an Autotuner's `configs`
        if attr in self._OWN:
            object.__setattr__(self, attr, value)
        else:
            setattr(self.kernel, attr, value)

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def compile_only(*args: Any, **kwargs: Any) -> None:
            keys = ("BLOCK_M", "TILE_SIZE", "BLOCK_N", "BLOCK_H", "num_warps", "num_stages")
            rec: dict[str, Any] = {"case": self.context.get("case", ""), "kernel": self.name,
                                   **{k: kwargs[k] for k in keys if k in kwargs}}
            try:
                compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
                if isinstance(compiled, list):  # an Autotuner compiles each config
                    compiled = compiled[-1]
                    cfg = self.kernel.configs[-1]
                    rec.update({k: v for k, v in cfg.kwargs.items() if k in keys},
                               num_warps=cfg.num_warps)
                rec["shared"] = int(compiled.metadata.shared)
                rec["status"] = ("ok" if rec["shared"] <= H100_MAX_SHARED_BYTES
                                 else f"over the {H100_MAX_SHARED_BYTES} B shared-memory limit")
            except Exception as e:  # the compile error is the finding
                lines = [x for x in str(e).splitlines() if x.strip()]
                rec["status"] = f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]
            self.sink.append(rec)

        return compile_only


COMPILED_KERNELS = (
    ("fwd_prefill", "attn_fwd"),
    ("mla", "triton_mla_decode_fwd_kernel"), ("mla", "triton_mla_decode_fwd_reduce_kernel"),
    ("sparse", "_kernel_unified_attention_sparse_mla_2d"),
    ("rope", "_fwd_grouped_kernel_stage1_rope"), ("rope", "_fwd_kernel_stage2"),
    ("extend", "_fwd_kernel"),
)


def compile_check(cases: list[tuple[str, Case, AiterTritonBackend]],
                  force: bool = False) -> list[dict[str, Any]]:
    """Compile (never launch) the kernels each case would launch, through the backend's own
    code path, for the compile-only target; one record per kernel compile (or per refusal).

    Needs `set_compile_only_target()` before AITER is imported (see `main`). The mha_v3
    prefill wrapper asserts `q.is_cuda` and `q.device.index == torch.cuda.current_device()`:
    q is passed as a `compat.CudaLookingTensor` and `torch.cuda.current_device` answers None.
    """
    from mlacheck import inputs as inputs_mod

    got = load()
    if isinstance(got, str):
        raise RuntimeError(got)
    sink: list[dict[str, Any]] = []
    context: dict[str, str] = {}
    proxies = compat.RuntimePatches()
    for mod, attr in COMPILED_KERNELS:
        module = got.modules.get(mod)
        if module is not None and hasattr(module, attr):
            proxies.add(module, attr, _WarmupProxy(getattr(module, attr), attr, sink, context),
                        "compile-only: compile instead of launching")
    proxies.add(torch.cuda, "current_device", lambda: None,
                "compile-only: the CPU tensors' device index (None)")
    with proxies:
        for name, case, backend in cases:
            context["case"] = name
            cap = backend.capabilities().get(case.op)
            why = cap.why_not(case, "cuda") if cap is not None else f"no op {case.op}"
            if why and not force:
                sink.append({"case": name, "kernel": "-", "status": f"refused: {why}"})
                continue
            before = len(sink)
            try:
                backend.run(case, inputs_mod.build(case, "cpu"))
            except Exception as e:  # a wrapper-level failure before any compile
                sink.append({"case": name, "kernel": "-",
                             "status": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            if why:
                for rec in sink[before:]:
                    rec["refused"] = why
    return sink


def compile_cases() -> list[tuple[str, Case]]:
    """The GPU smoke cases plus the page-size / FP8 limits the capabilities encode."""
    from mlacheck.spec import Placement, Quant, Request

    bf, fp = Quant("bf16", "bf16"), Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax")
    sent = Placement(tail_poison="sentinel")
    extra: list[tuple[str, Case]] = [
        ("decode bf16 h128 p128", DecodeCase((Request(1, 300),), 128, 128, bf, sent)),
        ("decode bf16 h16 p256 (beyond capability)", DecodeCase((Request(1, 600),), 16, 256, bf)),
        ("decode fp8 h16 p16 (beyond capability)", DecodeCase((Request(1, 150),), 16, 16, fp)),
        ("decode fp8 h128 p128", DecodeCase((Request(1, 300),), 128, 128, fp, sent)),
        ("sparse bf16 h16 p128", SparseDecodeCase((Request(1, 3000),), topk=2048, page_size=128)),
    ]
    from mlacheck.spec import Segment

    extra.append(("prefill fp16 h128 2 segments", PrefillCase(
        (Segment(48, 0), Segment(33, 17)), 128, True, Quant("fp16", "fp16"))))
    return smoke_cases(False) + extra


# --------------------------------------------------------------------------- smoke check


def smoke_cases(interp: bool) -> list[tuple[str, Case]]:
    """A few small cases per entry point (names say what each one shows)."""
    from mlacheck.spec import Paging, Placement, Quant, Request, Segment

    sentinel = Placement(tail_poison="sentinel")
    if interp:  # what the CPU interpreter can run in seconds: fp32 / fp16, tiny
        f32, f16 = Quant("fp32", "fp32"), Quant("fp16", "fp16")
        return [
            ("decode fp32 h16 p16 full pages", DecodeCase(
                (Request(1, 32), Request(1, 48)), 16, 16, f32)),
            ("decode fp16 h8 p16 sentinel tails", DecodeCase(
                (Request(1, 40), Request(1, 21)), 8, 16, f16, sentinel)),
            ("decode fp32 h16 p16 NaN tails", DecodeCase(
                (Request(1, 40), Request(1, 21)), 16, 16, f32)),
            ("decode MTP2 fp32 h16 p16", DecodeCase(
                (Request(2, 32), Request(2, 47)), 16, 16, f32, sentinel)),
            ("sparse fp32 h16 p16 topk 32", SparseDecodeCase(
                (Request(1, 50), Request(2, 40)), topk=32, num_heads=16, page_size=16,
                quant=f32)),
            # split launches: mixed q_len, an empty request between two of the same q_len
            ("decode mixed q_len + empty fp32 h16 p16", DecodeCase(
                (Request(1, 40), Request(2, 33), Request(0, 20), Request(2, 21),
                 Request(1, 17)), 16, 16, f32, sentinel)),
            # pages the sparse kernel cannot tile, through the tile view; an empty request
            ("sparse fp32 h16 p1 topk 32 + empty", SparseDecodeCase(
                (Request(1, 50), Request(0, 9), Request(2, 40)), topk=32, num_heads=16,
                page_size=1, quant=f32)),
            ("sparse fp16 h16 p53 topk 48", SparseDecodeCase(
                (Request(2, 120), Request(1, 61)), topk=48, num_heads=16, page_size=53,
                quant=f16)),
            # paged prefill through extend_attention_fwd (no LSE), page 1 and 16
            ("paged prefill fp16 h8 p1 causal", PrefillCase(
                (Segment(20, 44), Segment(0, 9), Segment(7, 0)), 8, True, f16,
                return_lse=False, paging=Paging(1))),
            ("paged prefill fp16 h8 p16 non-causal soft cap", PrefillCase(
                (Segment(19, 30),), 8, False, f16, soft_cap=30.0, return_lse=False,
                paging=Paging(16), placement=sentinel)),
        ]
    bf, fp = Quant("bf16", "bf16"), Quant("fp8_e4m3fn", "fp8_e4m3fn", "amax")
    return [
        ("decode bf16 h16 p64 full pages", DecodeCase(
            (Request(1, 128), Request(1, 192)), 16, 64, bf)),
        ("decode bf16 h16 p16 NaN tails", DecodeCase(
            (Request(1, 150), Request(1, 33)), 16, 16, bf)),
        ("decode bf16 h16 p16 sentinel tails", DecodeCase(
            (Request(1, 150), Request(1, 33)), 16, 16, bf, sentinel)),
        ("decode bf16 h128 p64 sentinel", DecodeCase(
            (Request(1, 300), Request(1, 129)), 128, 64, bf, sentinel)),
        ("decode MTP3 bf16 h16 p16 sentinel", DecodeCase(
            (Request(3, 64), Request(3, 200)), 16, 16, bf, sentinel)),
        ("decode fp8 h16 p32 sentinel", DecodeCase(
            (Request(1, 150), Request(1, 33)), 16, 32, fp, sentinel)),
        ("decode bf16-q fp8-kv h128 p16 sentinel", DecodeCase(
            (Request(1, 300), Request(1, 129)), 128, 16, Quant("bf16", "fp8_e4m3fn", "amax"),
            sentinel)),
        ("decode fp8 h128 p64 sentinel", DecodeCase(
            (Request(1, 300), Request(1, 129)), 128, 64, fp, sentinel)),
        ("sparse bf16 h16 p64 topk2048", SparseDecodeCase(
            (Request(1, 2047), Request(2, 2600)), topk=2048, num_heads=16, page_size=64)),
        ("sparse bf16 h128 p64 topk2048", SparseDecodeCase(
            (Request(1, 3000),), topk=2048, num_heads=128, page_size=64)),
        ("prefill bf16 h16 2 segments", PrefillCase(
            (Segment(48, 0), Segment(33, 17)), 16, True, bf)),
        ("prefill bf16 h16 context non-causal", PrefillCase(
            (Segment(40, 88),), 16, False, bf)),
        ("prefill fp8 h16 2 segments", PrefillCase(
            (Segment(48, 0), Segment(33, 17)), 16, True, fp)),
        ("decode mixed q_len + empty bf16 h16 p16", DecodeCase(
            (Request(1, 150), Request(3, 64), Request(0, 20), Request(3, 99), Request(1, 33)),
            16, 16, bf, sentinel)),
        ("sparse bf16 h16 p1 topk 256 + empty", SparseDecodeCase(
            (Request(1, 700), Request(0, 9), Request(2, 300)), topk=256, num_heads=16,
            page_size=1)),
        ("sparse bf16 h16 p1024 topk 2048", SparseDecodeCase(
            (Request(1, 2500), Request(2, 1100)), topk=2048, num_heads=16, page_size=1024)),
        ("paged prefill bf16 h16 p16 causal", PrefillCase(
            (Segment(37, 0), Segment(20, 45), Segment(64, 64)), 16, True, bf,
            return_lse=False, paging=Paging(16))),
        ("paged prefill bf16 h16 p1024 non-causal soft cap", PrefillCase(
            (Segment(21, 50), Segment(5, 0)), 16, False, bf, soft_cap=30.0, return_lse=False,
            paging=Paging(1024), placement=sentinel)),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the smoke cases through mlacheck's harness; print one line per case."""
    from mlacheck.harness import RunOptions, run_case

    p = argparse.ArgumentParser(prog="python -m mlacheck.tools.aiter_triton_check",
                                description="aiter-triton smoke check (no pytest needed)")
    p.add_argument("--device", default="auto", help="cuda | cpu | auto")
    p.add_argument("--only", default="", help="run cases whose name contains this text")
    p.add_argument("--rope", action="store_true", help="also run aiter-triton-rope decode")
    p.add_argument("--json", default=os.environ.get("OUT", ""),
                   help="directory for results.jsonl (default: $OUT if set)")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU needed: compile the decode/sparse kernels for CUDA sm_90 "
                        "through the backend and report shared memory (nothing launches)")
    p.add_argument("--as-shipped", action="store_true",
                   help="with --compile-only: call AITER without the compatibility layer")
    p.add_argument("--force", action="store_true",
                   help="with --compile-only: also compile cases the capabilities refuse")
    args = p.parse_args(argv)
    if args.compile_only:
        return _compile_main(args)
    try:
        device = resolve_device(args.device)
    except PreflightError as e:
        print(f"aiter_triton_check: {e}", file=sys.stderr)
        return 2
    backends = [factory()] + ([grouped_rope_factory()] if args.rope else [])
    got = load()
    info = {"torch": torch.__version__, "hip": torch.version.hip, "device": device,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "triton": _version("triton"), "aiter": aiter_version(),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
            "AITER_TRITON_ONLY": os.environ.get("AITER_TRITON_ONLY")}
    print("aiter-triton smoke:", json.dumps(info), flush=True)
    if isinstance(got, str):
        print(f"SKIP all: {got}")
        return 0
    for note in got.notes:
        print("note:", note)
    for op, why in got.problems.items():
        print(f"op {op} unavailable: {why}")
    cases = [(n, c) for n, c in smoke_cases(compat.interpreting()) if args.only in n]
    if args.rope:
        cases += [("rope " + n, c) for n, c in cases if c.op == Op.DECODE
                  and c.max_q_len == 1 and not c.quant.is_fp8]
    lines = []
    counts: dict[str, int] = {}
    for name, case in cases:
        backend = backends[1] if name.startswith("rope ") else backends[0]
        t0 = time.perf_counter()
        v = run_case(case, backend, RunOptions(device=device, ideal=False))
        wall = time.perf_counter() - t0
        counts[v.status] = counts.get(v.status, 0) + 1
        m = v.metrics
        err = (f" | worst row {m['worst_row']:.3g} (bound {m['bound']:.3g}), max abs "
               f"{m['max_abs']:.3g}" if "worst_row" in m else "")
        print(f"{v.status:5s} {wall:6.1f}s {name:38s} {case.id}{err}", flush=True)
        if v.status != "PASS":
            print("      " + v.summary().replace("\n", "\n      ")[:2000], flush=True)
            if "traceback" in m:
                print("      " + str(m["traceback"]).replace("\n", "\n      ")[-3000:])
        record = {k: x for k, x in v.to_dict().items() if k != "metrics"}
        record["metrics"] = {k: x for k, x in m.items() if not k.startswith("heatmap")}
        lines.append(json.dumps({"name": name, "wall": wall, **record}, default=str))
    print("summary:", json.dumps(counts))
    if args.json:
        out = Path(args.json)
        out.mkdir(parents=True, exist_ok=True)
        (out / "aiter_triton_smoke.jsonl").write_text("\n".join(lines) + "\n")
    return 0


def _compile_main(args: argparse.Namespace) -> int:
    print(compat.set_compile_only_target(), flush=True)
    got = load()
    if isinstance(got, str):
        print(f"SKIP all: {got}")
        return 0
    for op, why in got.problems.items():
        print(f"op {op} unavailable: {why}")
    main_b = AiterTritonBackend(compat_layer=not args.as_shipped)
    rope_b = AiterTritonBackend("aiter-triton-rope", "grouped_rope",
                                compat_layer=not args.as_shipped)
    cases: list[tuple[str, Case, AiterTritonBackend]] = []
    for name, case in compile_cases():
        if args.only in name:
            cases.append((name, case, main_b))
            if (args.rope and case.op == Op.DECODE and case.max_q_len == 1
                    and not case.quant.is_fp8):
                cases.append(("rope " + name, case, rope_b))
    records = compile_check(cases, force=args.force)
    for r in records:
        cfg = " ".join(f"{k}={r[k]}" for k in ("BLOCK_M", "TILE_SIZE", "BLOCK_N", "BLOCK_H",
                                                "num_warps") if k in r)
        shared = f"{r['shared']:>7d} B" if "shared" in r else " " * 9
        print(f"{r['case'][:44]:44s} {r['kernel'][:36]:36s} {cfg:34s} {shared} {r['status']}")
    if args.json:
        out = Path(args.json)
        out.mkdir(parents=True, exist_ok=True)
        (out / "aiter_triton_compile.jsonl").write_text(
            "\n".join(json.dumps(r, default=str) for r in records) + "\n")
    return 0


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
