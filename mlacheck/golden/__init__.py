"""The golden reference layer: FP32 (or FP64) attention on the exact inputs a kernel saw.

variant "exact": dequantised inputs as the kernel received them (through the paged pool);
variant "ideal": the unquantised inputs, which measures what quantisation itself costs.
"""

from __future__ import annotations

import torch

from mlacheck.golden import decode, pipeline_ops, prefill
from mlacheck.golden.core import Result
from mlacheck.inputs import Inputs
from mlacheck.spec import Op

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp64": torch.float64}
VARIANTS = ("exact", "ideal")


def reference(inputs: Inputs, variant: str = "exact", precision: str = "fp32") -> Result:
    if variant not in VARIANTS:
        raise ValueError(f"golden variant must be one of {VARIANTS}, not {variant!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"golden precision must be fp32 or fp64, not {precision!r}")
    return _REFERENCES[inputs.case.op](inputs, variant, PRECISIONS[precision])  # type: ignore[operator]


# The reference of each op (a new op adds its own: mlacheck/ops.py; the sparse-pipeline
# ops' are in mlacheck.golden.pipeline_ops, None where an op has no such variant).
_REFERENCES = {Op.PREFILL: prefill.reference, Op.PAGED_PREFILL: prefill.reference,
               Op.DECODE: decode.reference, Op.SPARSE_DECODE: decode.sparse_reference,
               **pipeline_ops.REFERENCES}


__all__ = ["PRECISIONS", "VARIANTS", "Result", "reference"]
