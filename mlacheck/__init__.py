"""mlacheck: correctness and accuracy validation for MLA attention kernels.

Importing mlacheck imports torch and nothing optional (no aiter, flashinfer, lm-eval).
"""

__version__ = "0.1.0"
