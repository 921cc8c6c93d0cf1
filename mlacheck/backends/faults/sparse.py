"""Sparse (DeepSeek-V3.2 top-k) decode faults: bug classes (mlacheck/bugclasses.py) 2 and 3.

Persistent sparse decode hands AITER kv_indices as a row-major [tokens, topk] table: token t's
valid entries at t * topk .. t * topk + n_t - 1 (n_t = its number of valid indices), -1
after them; the metadata (get_mla_metadata_v1 with topk) advances each token by topk.

sparse-ragged-rowmajor (class 2): the index buffer is written ragged (every token's valid
    entries packed back to back, `cu_seqlens[t] + i`, -1 after the last) while the kernel
    reads it row-major (`t * topk + i`). Identical only when every n_t == topk.
sparse-dense-metadata (class 3): the buffers are sized for the sparse layout
    (get_mla_metadata_info_v1 with is_sparse=True) but filled with the dense one
    (get_mla_metadata_v1 called with its default topk=-1): each token's kv range is then
    taken from kv_indptr (ragged offsets) in a row-major table. Identical only when every
    n_t == topk.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mlacheck.backends.aiter import DecodeSchedule
from mlacheck.backends.faults._base import AdapterFault, adapter
from mlacheck.inputs import DecodeInputs
from mlacheck.spec import Op, SparseDecodeCase

SPARSE_OPS = (Op.SPARSE_DECODE,)


class RaggedIndicesReadRowMajor(AdapterFault):
    """Class 2: kv_indices packed ragged, read by the kernel with a stride of topk."""

    fault_ops = SPARSE_OPS

    def sparse_schedule(self, case: SparseDecodeCase, inputs: DecodeInputs) -> DecodeSchedule:
        sched = super().sparse_schedule(case, inputs)
        if not self.persistent:  # non-persistent decode reads the ragged layout by design
            return sched
        table = sched.kv_indices
        valid = table[table >= 0]
        ragged = torch.full_like(table, -1)  # the buffer as initialised, then written ragged
        ragged[: valid.numel()] = valid
        return dataclasses.replace(sched, kv_indices=ragged)


class DenseMetadataInSparseBuffers(AdapterFault):
    """Class 3: get_mla_metadata_v1 called without topk (its default -1: dense)."""

    fault_ops = SPARSE_OPS

    def rewrite(self, qualname: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        if qualname == "get_mla_metadata_v1" and kwargs.get("topk", -1) >= 0:
            kwargs["topk"] = -1
        return kwargs


def sparse_ragged_rowmajor(inner: str = "aiter-model") -> AdapterFault:
    return adapter(RaggedIndicesReadRowMajor, "fault:sparse-ragged-rowmajor", inner)  # type: ignore[return-value]


def sparse_dense_metadata(inner: str = "aiter-model") -> AdapterFault:
    return adapter(DenseMetadataInSparseBuffers, "fault:sparse-dense-metadata", inner)  # type: ignore[return-value]
