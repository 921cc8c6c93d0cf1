"""The validation matrix as a pytest module (collected by `mlacheck run` and tests/kernels)."""
