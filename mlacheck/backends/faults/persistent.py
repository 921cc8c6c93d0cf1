"""Persistent-decode fault: bug class 10.

stale-metadata (class 10): the persistent-schedule buffers are kept across calls, as a serving
    engine keeps them, but refilled only when they had to grow (e.g. filled once at CUDA-graph
    capture): a later batch of another shape that fits the buffers runs on the schedule of an
    earlier one. Stateful: only a sequence of calls on one instance shows it (the selftest
    runs every fault as one instance over its whole matrix, the search primes each example).
"""

from __future__ import annotations

from typing import Any

import torch

from mlacheck.backends.aiter import AiterApi, MetadataBuffers
from mlacheck.backends.faults._base import AdapterFault, adapter
from mlacheck.spec import DecodeCase, Op, Request

# The first call of a fresh instance in a search: a large batch, so the buffers are big
# enough for the (smaller) examples that follow and get no refill.
PRIMING_CASE = DecodeCase(requests=(Request(1, 300), Request(1, 200), Request(1, 100),
                                    Request(1, 50)), num_heads=16, page_size=16)


class StaleMetadata(AdapterFault):
    """Class 10: get_mla_metadata_v1 runs only when a buffer was (re)allocated."""

    fault_ops = (Op.DECODE, Op.SPARSE_DECODE)

    def fill_metadata(self, api: AiterApi, cache: MetadataBuffers,
                      bufs: dict[str, torch.Tensor], grew: bool,
                      fill_args: dict[str, Any]) -> None:
        if cache.fills and not grew:
            return
        super().fill_metadata(api, cache, bufs, grew, fill_args)


def stale_metadata(inner: str = "aiter-model") -> AdapterFault:
    return adapter(StaleMetadata, "fault:stale-metadata", inner)  # type: ignore[return-value]
