"""The error heat map's data: per-row errors (tokens x heads) pooled to a size a report can
draw, stored in a verdict's metrics (JSON has no tensors, no inf).

The judge records this grid for a FAIL (from the kernel's and the golden's rows); it draws
nothing: mlacheck/report/plots.py draws it from the results file. torch is only a type here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_CELLS = (256, 128)  # rows x heads kept in a report heat map (max-pooled beyond that)
NONFINITE = 1e30  # a non-finite row's cell (JSON has no inf); plots.NONFINITE reads it


def block(shape: tuple[int, ...]) -> list[int]:
    """(tokens, heads) pooled into one heat-map cell."""
    return [-(-shape[0] // MAX_CELLS[0]), -(-shape[1] // MAX_CELLS[1])]


def grid(err: torch.Tensor) -> list[list[float]]:
    """Per-row errors [T, H] max-pooled down to MAX_CELLS; a non-finite row (NaN/Inf in the
    kernel's or the golden's row) is NONFINITE and wins its cell."""
    t, h = err.shape
    ft, fh = block(tuple(err.shape))
    e = err.detach().float().cpu()
    e = e.masked_fill(~e.isfinite(), math.inf)
    if ft > 1 or fh > 1:
        padded = e.new_zeros((ft * -(-t // ft), fh * -(-h // fh)))
        padded[:t, :h] = e
        e = padded.reshape(padded.shape[0] // ft, ft, padded.shape[1] // fh, fh).amax(dim=(1, 3))
    return [[x if math.isfinite(x) else NONFINITE for x in row] for row in e.tolist()]


def metrics(err: torch.Tensor) -> dict[str, Any]:
    """What a verdict's metrics carry for the report's heat map."""
    return {"heatmap": grid(err), "heatmap_block": block(tuple(err.shape))}
