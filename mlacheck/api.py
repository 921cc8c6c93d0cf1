"""mlacheck's public API: what a plug-in backend author and a test author import.

Everything here is supported across releases (a rename keeps the old name as an alias for a
release); every other module of the package is internal and may change. Importing it imports
torch, hypothesis and nothing optional. Documented, with examples that the tests execute,
in docs/backends.md.
"""

from __future__ import annotations

# Writing a backend: the contract, capabilities, and the shared toolkit every built-in uses.
from mlacheck.backends.base import ANY, Backend, Capability, Output, Range, skip_reason
from mlacheck.backends.registry import BackendError, available_names, resolve
from mlacheck.backends.toolkit import (
    Loaded,
    cuda_refusal,
    library_version,
    load_library,
    lse_natural,
    lse_tokens_heads,
    signature_problem,
)

# Cases, their inputs and the references.
from mlacheck.golden import reference
from mlacheck.harness import RunOptions, run_case
from mlacheck.inputs import DecodeInputs, PrefillInputs, Quantised
from mlacheck.inputs import build as build_inputs
from mlacheck.kvcache import KVPool, PageTable
from mlacheck.matrices.loader import Matrix, MatrixError
from mlacheck.matrices.loader import load as load_matrix
from mlacheck.matrices.loader import names as matrix_names
from mlacheck.search import find_failing_case
from mlacheck.spec import (
    DecodeCase,
    MLADims,
    Op,
    Paging,
    PrefillCase,
    Quant,
    Request,
    Segment,
    SparseDecodeCase,
    case_from_json,
)
from mlacheck.strategies import (
    cases,
    decode_cases,
    paged_prefill_cases,
    prefill_cases,
    sparse_cases,
)

# Verdicts and what a run's exit code means.
from mlacheck.verdict import CRASH, ERROR, FAIL, PASS, SKIP, Check, Verdict

__all__ = [
    # backends
    "ANY", "Backend", "BackendError", "Capability", "Loaded", "Output", "Range",
    "available_names", "cuda_refusal", "library_version", "load_library", "lse_natural",
    "lse_tokens_heads", "resolve", "signature_problem", "skip_reason",
    # cases and inputs
    "DecodeCase", "DecodeInputs", "KVPool", "MLADims", "Op", "PageTable", "Paging", "PrefillCase",
    "PrefillInputs", "Quant", "Quantised", "Request", "Segment", "SparseDecodeCase",
    "build_inputs", "case_from_json", "reference",
    # matrices and search
    "Matrix", "MatrixError", "cases", "decode_cases", "find_failing_case", "load_matrix",
    "matrix_names", "paged_prefill_cases", "prefill_cases", "sparse_cases",
    # running and verdicts
    "CRASH", "Check", "ERROR", "FAIL", "PASS", "RunOptions", "SKIP", "Verdict", "run_case",
]
