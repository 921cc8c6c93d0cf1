"""Build every FlashInfer kernel the `flashinfer` / `flashinfer-fa3` backends use, at once, and
install them as FlashInfer's prebuilt (AOT) modules.

Why: FlashInfer 0.2.x compiles each kernel variant on first use. On a fresh GPU machine with
several xdist workers that took 15-20 minutes per premerge, and a copied JIT cache was
compiled again. Built in one ninja run (232-262 s on an H100 with 16 cores) and copied to the
paths FlashInfer loads prebuilt modules from (`JitSpec.aot_path`), they load without
compiling; `--archive` packs them (5-6 MB as tar.xz) to restore on the next machine. Measured
with flashinfer-python 0.2.14.post1 (docs/flashinfer.md).

    python -m mlacheck.backends.flashinfer_prebuild [--archive aot.tar.xz]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from mlacheck.backends.flashinfer import DECODE_FORMATS, PREFILL_FORMATS
from mlacheck.spec import MLADims

KERNELS = ("fa2", "fa3")  # the `flashinfer` and `flashinfer-fa3` backends


def variants(dims: MLADims | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(generator name, its keyword arguments) for every module the backends' calls select:
    kernel x dtype for MLA decode, and x soft cap off/on for the ragged prefill."""
    import torch

    dims = dims or MLADims()
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    out: list[tuple[str, dict[str, Any]]] = []
    for kernel in KERNELS:
        for fmt in DECODE_FORMATS:
            dt = dtypes[fmt]
            out.append(("gen_batch_mla_module", dict(
                backend=kernel, dtype_q=dt, dtype_kv=dt, dtype_o=dt, dtype_idx=torch.int32,
                head_dim_ckv=dims.kv_lora_rank, head_dim_kpe=dims.qk_rope, use_profiler=False)))
        for fmt in PREFILL_FORMATS:
            dt = dtypes[fmt]
            for soft_cap in (False, True):
                out.append(("gen_batch_prefill_module", dict(
                    backend=kernel, dtype_q=dt, dtype_kv=dt, dtype_o=dt, dtype_idx=torch.int32,
                    head_dim_qk=dims.qk_head, head_dim_vo=dims.v_head, pos_encoding_mode=0,
                    use_sliding_window=False, use_logits_soft_cap=soft_cap,
                    use_fp16_qk_reduction=False)))
    return out


def prebuild(archive: Path | None = None) -> list[Path]:
    """Build, install as prebuilt modules, optionally archive; returns the installed files."""
    import flashinfer.jit as jit

    specs = [getattr(jit, gen)(**kwargs) for gen, kwargs in variants()]
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
    ap = argparse.ArgumentParser(prog="python -m mlacheck.backends.flashinfer_prebuild",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--archive", type=Path, help="also write the prebuilt modules to this tar.xz")
    args = ap.parse_args(argv)
    try:
        prebuild(args.archive)
    except ImportError as e:
        print(f"flashinfer_prebuild: FlashInfer is not importable ({e}); docs/flashinfer.md",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
