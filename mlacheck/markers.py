"""The pytest markers a matrix case can carry, defined once and importable without torch.

A matrix may set them (a typo fails the load instead of silently creating an unregistered
marker), the pytest plugin registers them with these descriptions, and `-m "not large_kv"`
selects on them. Kept apart from the matrix loader so the pytest controller process (which
registers markers but builds no case) does not import torch: ~0.15 GB less in every
`mlacheck run` and xdist controller.
"""

from __future__ import annotations

MARKERS: dict[str, str] = {
    "fp8": "FP8 formats",
    "sparse": "sparse top-k decode",
    "multiseg": "multi-segment varlen prefill",
    "large_kv": "KV pools over 2 GB / 4 GB (deselected by CPU gates)",
    "persistent": "persistent (work-stealing) decode",
    "gpu": "needs a GPU",
    "slow": "long-running (matrix cases: nightly only; mlacheck's own tests: the slow tier, "
            "docs/ci.md)",
}
KNOWN_MARKERS = tuple(MARKERS)
