"""The validation matrix from the repo: `pytest tests/kernels --mla-backend B --mla-matrix M`."""

from mlacheck.suite.test_mla import test_mla  # noqa: F401
