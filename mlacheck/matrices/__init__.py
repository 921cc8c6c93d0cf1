"""Named matrices (smoke, premerge, nightly, full) as YAML data; see `loader` for the schema."""

from mlacheck.matrices.loader import (
    KNOWN_MARKERS,
    Matrix,
    MatrixCase,
    MatrixError,
    derived_markers,
    load,
    names,
)

__all__ = ["KNOWN_MARKERS", "Matrix", "MatrixCase", "MatrixError", "derived_markers", "load",
           "names"]
