"""The ops mlacheck checks: one string-valued enum, the one list of them.

`Op.DECODE == "mla_decode"`: a member is its string, so results files, case ids, matrices,
`--require-ops` and the capability tables keep the strings they always had; code names a
member, never a literal. Per-op facts live here too (`unit`: what a failure location names).

What a new op touches (as issue 29's indexer logits, top-k and sparse prefill did):
1. here: a member (its string is what results, matrices and `--require-ops` say), and its
   `unit` in `_UNITS`;
2. mlacheck/spec.py: its case type (a frozen dataclass with `kind`, `op`, `slug` and the shared
   accessors every case has: `units`, `q_lengths`, `kv_lengths`, `paging`, `total_q`,
   `has_empty`, `visible_lengths`, `attended_lengths`, `with_units`; the facts a kind may lack,
   `causal`, `soft_cap`, `topk`, `valid_cap`, `sparse`, `requires_lse`, have their "none"
   values unless the type sets them), and its kind in `case_from_dict`; the generic readers
   (capabilities, cost, coverage, footprint, boundaries, localisation, probes, backends) then
   need nothing new for the shared facts;
3. mlacheck/inputs.py (its tensors: `build`'s table) and mlacheck/golden/ (its reference:
   `_REFERENCES`): each a table keyed by `case.op`, one entry;
4. every backend that provides it: an entry in `capabilities()` and in its `run` table (keyed
   by `case.op`); the fault catalogue (mlacheck/backends/faults) names it in the faults
   that act on it;
5. data: matrix groups (`kind:`), boundary classes and bug classes that cover it
   (mlacheck/boundaries.py, mlacheck/bugclasses.py), strategies (mlacheck/strategies.py).
The judge, the verdict, the gate (mlacheck.session / mlacheck.outcome), the report and the
pytest plugin read ops as strings and need no change.
"""

from __future__ import annotations

from enum import Enum


class Op(str, Enum):
    PREFILL = "mla_prefill"  # MHA-form prefill over ragged segments
    DECODE = "mla_decode"  # absorbed-MQA decode over a paged latent pool
    SPARSE_DECODE = "mla_sparse_decode"  # DeepSeek-V3.2: each query token's own top-k kv
    PAGED_PREFILL = "paged_prefill"  # prefill reading K/V from pages (CK batch prefill)
    # The DeepSeek-V3.2 sparse path (docs/sparse-pipeline.md): indexer logits in both forms,
    # top-k, local positions -> global slots, sparse prefill, the decode path composed.
    MQA_LOGITS = "mqa_logits"  # indexer logits, prefill form (fp8_mqa_logits)
    PAGED_MQA_LOGITS = "paged_mqa_logits"  # indexer logits, decode form over a paged key cache
    TOPK = "topk_indices"  # top-k of each row's logits, request-local, -1 padded
    INDEX_CONVERSION = "index_conversion"  # request-local positions -> global KV slots
    SPARSE_PREFILL = "mla_sparse_prefill"  # sparse MLA over a flat latent KV (flash_mla_sparse_fwd)
    SPARSE_PIPELINE = "sparse_pipeline"  # logits -> top-k -> slots -> sparse decode

    # print / format / JSON as the plain string (Python 3.10 and 3.12 agree)
    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def unit(self) -> str:
        """What one independent part of a batch is called: "segment" or "request"."""
        return _UNITS[self]


_UNITS = {Op.PREFILL: "segment", Op.PAGED_PREFILL: "segment", Op.DECODE: "request",
          Op.SPARSE_DECODE: "request", Op.MQA_LOGITS: "segment",
          Op.PAGED_MQA_LOGITS: "request", Op.TOPK: "request", Op.INDEX_CONVERSION: "request",
          Op.SPARSE_PREFILL: "segment", Op.SPARSE_PIPELINE: "request"}

OPS: tuple[Op, ...] = tuple(Op)


def unit_of(op: str) -> str:
    """The unit of an op read back from a results file ("request" for one mlacheck does not
    know: an older or newer file)."""
    try:
        return Op(op).unit
    except ValueError:
        return "request"
