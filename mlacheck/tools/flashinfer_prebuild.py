"""Build every FlashInfer kernel the `flashinfer` / `flashinfer-fa3` backends use, at once, and
install them as FlashInfer's prebuilt (AOT) modules.

Why: FlashInfer 0.2.x compiles each kernel variant on first use. On a fresh GPU machine with
several xdist workers that took 15-20 minutes per premerge, and a copied JIT cache was
compiled again. Built in one ninja run (232-262 s on an H100 with 16 cores) and copied to the
paths FlashInfer loads prebuilt modules from (`JitSpec.aot_path`), they load without
compiling; `--archive` packs them (5-6 MB as tar.xz) to restore on the next machine. Measured
with flashinfer-python 0.2.14.post1 (docs/flashinfer.md). The generators follow the installed
release: 0.7.x builds its fa2 batch prefill as two modules (`prefill._gen_batch_prefill_
primary_module` and, for paged K/V caches of unequal strides, `_gen_batch_prefill_
independent_paged_module`), its MLA decode has an fp8_e4m3fn-KV variant under bf16 q, and its
fa2 prefill runs fp8_e4m3fn K/V under bf16 q (modules of their own). Modules already installed
(an unpacked archive) are not built again (`build_jit_specs(skip_prebuilt=True)`), so a new
variant costs only its own build, and `--archive` then packs old and new together.

Where the release has a top-k (0.7.x: `flashinfer/jit/topk.py`, one module `topk` that every
function of `flashinfer/topk.py` loads), that module is built and installed the same way: its
loader (`get_topk_module`, topk.py:66-67: `gen_topk_module().build_and_load()`) looks at the
same AOT path first, and the adapter runs `topk_indices` only where it is installed (its JIT
build takes minutes, a7167f4). `--topk-only` builds it alone, to time it.

    python -m mlacheck.tools.flashinfer_prebuild [--archive aot.tar.xz]
        [--kv-format fp8_e4m3fn] [--prefill-only] | [--topk-only]   # a subset
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from mlacheck.backends.flashinfer import DECODE_FORMATS, PREFILL_FORMATS, TOP_K_MODULE
from mlacheck.spec import MLADims

KERNELS = ("fa2", "fa3")  # the `flashinfer` and `flashinfer-fa3` backends


MLA = "jit.gen_batch_mla_module"
PREFILL = "jit.gen_batch_prefill_module"
# 0.7.x: what `prefill.get_batch_prefill_module` builds for fa2 instead of PREFILL
FA2_PREFILL_07 = ("prefill._gen_batch_prefill_primary_module",
                  "prefill._gen_batch_prefill_independent_paged_module")
# 0.7.x: the top-k's one module (jit/topk.py:21, no arguments); absent from 0.2.14.post1
TOPK = TOP_K_MODULE


def variants(dims: MLADims | None = None, *, split_fa2_prefill: bool = False,
             fp8_kv: bool = False, fp8_kv_prefill: bool = False,
             topk: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """(generator, its keyword arguments) for every module the backends' calls select:
    kernel x dtype for MLA decode (+ bf16 q over fp8_e4m3fn KV where the release has it), and
    x soft cap off/on for the batch prefill (ragged and paged runs share a module; 0.7.x's fa2
    splits it in two: `split_fa2_prefill`; + fa2's bf16 q over fp8_e4m3fn K/V: `fp8_kv_prefill`,
    the pair mlacheck's matrices draw), + the top-k module (`topk`, 0.7.x; shared by both
    backends). A generator is a dotted name under `flashinfer`."""
    import torch

    dims = dims or MLADims()
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    mla_pairs = [(dtypes[f], dtypes[f]) for f in DECODE_FORMATS]
    if fp8_kv:
        mla_pairs.append((torch.bfloat16, torch.float8_e4m3fn))
    out: list[tuple[str, dict[str, Any]]] = []
    for kernel in KERNELS:
        for dq, dkv in mla_pairs:
            out.append((MLA, dict(
                backend=kernel, dtype_q=dq, dtype_kv=dkv, dtype_o=dq, dtype_idx=torch.int32,
                head_dim_ckv=dims.kv_lora_rank, head_dim_kpe=dims.qk_rope, use_profiler=False)))
        generators = FA2_PREFILL_07 if split_fa2_prefill and kernel == "fa2" else (PREFILL,)
        prefill_pairs = [(dtypes[f], dtypes[f]) for f in PREFILL_FORMATS]
        if fp8_kv_prefill and kernel == "fa2":
            prefill_pairs.append((torch.bfloat16, torch.float8_e4m3fn))
        for dq, dkv in prefill_pairs:
            for soft_cap in (False, True):
                for gen in generators:
                    out.append((gen, dict(
                        backend=kernel, dtype_q=dq, dtype_kv=dkv, dtype_o=dq,
                        dtype_idx=torch.int32, head_dim_qk=dims.qk_head, head_dim_vo=dims.v_head,
                        pos_encoding_mode=0, use_sliding_window=False,
                        use_logits_soft_cap=soft_cap, use_fp16_qk_reduction=False)))
    if topk:
        out.append((TOPK, {}))
    return out


def adapter_module() -> Any:
    """mlacheck.backends.flashinfer (what the backends call decides what is built)."""
    from mlacheck.backends import flashinfer as adapter

    return adapter


def installed_variants() -> list[tuple[str, dict[str, Any]]]:
    """`variants` for the FlashInfer installed here."""
    import importlib

    adapter = adapter_module()
    prefill = importlib.import_module("flashinfer.prefill")
    got = adapter.load()
    fp8_kv = not isinstance(got, str) and adapter.takes_fp8_kv(got)
    fp8_kv_prefill = not isinstance(got, str) and adapter.takes_fp8_kv_prefill(got)
    return variants(split_fa2_prefill=all(hasattr(prefill, g.split(".")[1]) for g in FA2_PREFILL_07),
                    fp8_kv=fp8_kv, fp8_kv_prefill=fp8_kv_prefill, topk=has_generator(TOPK))


def has_generator(generator: str) -> bool:
    """The installed release has this generator (`flashinfer.jit.topk` is 0.7.x's)."""
    try:
        resolve(generator)
    except (ImportError, AttributeError):
        return False
    return True


def resolve(generator: str) -> Any:
    """A dotted name under `flashinfer` (jit.gen_batch_mla_module, prefill._gen_...)."""
    import importlib

    module, attr = generator.rsplit(".", 1)
    return getattr(importlib.import_module(f"flashinfer.{module}"), attr)


def selected(chosen: list[tuple[str, dict[str, Any]]], kv_format: str | None = None,
             prefill_only: bool = False, topk_only: bool = False
             ) -> list[tuple[str, dict[str, Any]]]:
    """The variants of one K/V format (an mlacheck format name) and / or of the prefills only
    (neither selects the top-k module: it has no K/V format), or the top-k module only."""
    from mlacheck import fp8

    if topk_only:
        return [(g, kw) for g, kw in chosen if g == TOPK]
    kv_dtype = fp8.fmt(kv_format).dtype if kv_format else None
    return [(g, kw) for g, kw in chosen
            if not ((kv_format or prefill_only) and g == TOPK)
            and (kv_dtype is None or kw["dtype_kv"] == kv_dtype)
            and not (prefill_only and g == MLA)]


def prebuild(archive: Path | None = None, kv_format: str | None = None,
             prefill_only: bool = False, topk_only: bool = False) -> list[Path]:
    """Build, install as prebuilt modules, optionally archive; returns the installed files."""
    import flashinfer.jit as jit

    specs = [resolve(gen)(**kwargs) for gen, kwargs
             in selected(installed_variants(), kv_format, prefill_only, topk_only)]
    if not specs:
        raise SystemExit("flashinfer_prebuild: no module of the installed release fits the selection")
    start = time.monotonic()
    jit.build_jit_specs(specs, verbose=False)
    print(f"built {len(specs)} modules in {time.monotonic() - start:.0f} s", flush=True)
    installed = []
    for spec in specs:
        aot = Path(spec.aot_path)
        if not aot.exists():
            aot.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(spec.jit_library_path, aot)
        installed.append(aot)
        print(f"{aot.stat().st_size:>10}  {aot.name}")
    if archive is not None:
        root = installed[0].parent.parent  # .../flashinfer/data/aot
        with tarfile.open(archive, "w:xz") as tar:
            tar.add(root, arcname=root.name)
        print(f"{archive}: {archive.stat().st_size} bytes; unpack into {root.parent}")
    return installed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlacheck.tools.flashinfer_prebuild",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--archive", type=Path, help="also write the prebuilt modules to this tar.xz")
    ap.add_argument("--kv-format", help="only the modules of this K/V format (e.g. fp8_e4m3fn)")
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill modules")
    ap.add_argument("--topk-only", action="store_true",
                    help="only the top-k module (0.7.x; not with --kv-format / --prefill-only)")
    args = ap.parse_args(argv)
    if args.topk_only and (args.kv_format or args.prefill_only):
        ap.error("--topk-only selects one module: not with --kv-format / --prefill-only")
    try:
        prebuild(args.archive, args.kv_format, args.prefill_only, args.topk_only)
    except ImportError as e:
        print(f"flashinfer_prebuild: FlashInfer is not importable ({e}); docs/flashinfer.md",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
