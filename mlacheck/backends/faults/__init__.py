"""The fault catalogue: every bug class of mlacheck/bugclasses.py (and a few generic mistakes) planted in a
correct backend, reproducing the *mechanism* of the real bug, so that `mlacheck selftest` can
show, on every CI run, that the suite catches each one and no correct backend fails.

This module is data only (importing it imports neither a fault nor torch): the registry merges
BUILTIN_NAMES (`fault:<name>` -> `module:factory`) into its built-ins, and a
fault's module is imported when the fault is built. One module per family:

    generic.py     perturb-row, default-softmax-scale, lse-base2, causal-top-left,
                   last-page-off-by-one, write-past-output, nondeterministic
    decode.py      class 1 (decode over num_actual_tokens), class 9 (MTP, q_len-1 metadata)
    sparse.py      class 2 (ragged written, row-major read), class 3 (dense metadata)
    prefill.py     class 4 (multi-segment as one / first only), class 8 (context-chunk LSE)
    heads.py       class 5 (16 // H padding), class 12 (output unpadding)
    paging.py      class 6 (32-bit offset wrap, reads past the live page), class 11
    fp8.py         class 7 (unit-scale FP8 re-cast)
    persistent.py  class 10 (stale persistent metadata)
    boundary.py    the boundary classes of mlacheck/boundaries.py (tile multiples, long kv,
                   wide page ids, empty requests/segments, one-token segments, soft cap,
                   per-token scales, narrow accumulation)
    pipeline.py    the DeepSeek-V3.2 sparse path: classes 13 (indexer logits), 14 (top-k),
                   15 (index conversion, -1 as a slot), 2 and 9 across the path, generic
    precision.py   small systematic errors: partial low-precision accumulation, a scale error
                   on the RoPE / nope part of q or k, a wrong log2(e), a rounded softmax
                   scale, a key masked at a tile edge past 8192

Each FaultSpec names the selftest-matrix groups (mlacheck/matrices/selftest.yaml) meant to
expose it, the checks expected to fire there ("crash" for a refused call), the Hypothesis
strategy its minimal-case search draws from (mlacheck.backends.faults.search), and where it
must NOT fail (the contrast that shows the mechanism, asserted by the unit tests).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from mlacheck import bugclasses
from mlacheck.ops import Op

PREFIX = "fault:"


@dataclass(frozen=True)
class FaultSpec:
    name: str
    bug_class: int | str  # in mlacheck.bugclasses: a number, a boundary class name, "generic"
    mechanism: str  # one line
    factory: str  # "module:function"; the function takes an optional `inner` backend name
    inner: str  # the correct backend it is planted in (registry name)
    ops: tuple[str, ...]  # the ops it acts on (its capabilities are restricted to them)
    groups: tuple[str, ...]  # selftest-matrix groups that must expose it
    expect: tuple[str, ...]  # checks of which at least one fires there ("crash": refused)
    search: str  # strategy factory in mlacheck.backends.faults.search
    stateful: bool = False  # only a sequence of calls on one instance shows it
    determinism: bool = False  # only a repeated run (RunOptions(repeat=2)) shows it
    contrast: str = ""  # where the same fault must PASS: proof it is the mechanism

    def __post_init__(self) -> None:
        if not bugclasses.is_class(self.bug_class, generic=True):
            raise ValueError(f"fault {self.name}: bug class {self.bug_class!r} is not one of "
                             f"the catalogue: {bugclasses.what_may_be_cited()}, or "
                             f"{bugclasses.GENERIC!r}")

    @property
    def backend_name(self) -> str:
        return PREFIX + self.name

    @property
    def class_label(self) -> str:
        return str(self.bug_class)

    def build(self, inner: str | None = None) -> Any:
        """A fresh instance (stateful faults keep state per instance)."""
        mod, _, fn = self.factory.partition(":")
        factory = getattr(importlib.import_module(mod), fn)
        return factory() if inner is None else factory(inner=inner)


_M = "mlacheck.backends.faults"
DECODE = (Op.DECODE,)
SPARSE = (Op.SPARSE_DECODE,)
PREFILL = (Op.PREFILL,)
INDEXER = (Op.MQA_LOGITS, Op.PAGED_MQA_LOGITS)
PAGED_INDEXER = (Op.PAGED_MQA_LOGITS,)
ALL_OPS = (Op.PREFILL, Op.PAGED_PREFILL, Op.DECODE, Op.SPARSE_DECODE)

_SPECS = (
    FaultSpec("decode-num-actual-tokens", 1,
              "decode launched over prefill+decode tokens: extra rows read stale index entries "
              "(free pages) and write past the decode output",
              f"{_M}.decode:decode_num_actual_tokens", "aiter-model", DECODE,
              ("decode-mixed",), ("guards",), "decode_any"),
    FaultSpec("sparse-ragged-rowmajor", 2,
              "sparse kv_indices written ragged (cu_seqlens[t] + i), read row-major "
              "(t * topk + i)",
              f"{_M}.sparse:sparse_ragged_rowmajor", "aiter-model", SPARSE,
              ("sparse-topk",), ("row_error", "nonfinite"), "sparse_short",
              contrast="passes when every token has topk valid indices"),
    FaultSpec("sparse-dense-metadata", 3,
              "buffers sized for the sparse layout, filled by get_mla_metadata_v1 with its "
              "default topk=-1 (dense)",
              f"{_M}.sparse:sparse_dense_metadata", "aiter-model", SPARSE,
              ("sparse-topk",), ("metadata", "row_error"), "sparse_short",
              contrast="passes when every token has topk valid indices"),
    FaultSpec("multiseg-as-one", 4,
              "multi-segment varlen prefill run as one segment (cu_seqlens collapsed)",
              f"{_M}.prefill:multiseg_as_one", "torch", (Op.PREFILL,),
              ("prefill-segments",), ("row_error",), "prefill_multiseg",
              contrast="passes on a one-segment batch"),
    FaultSpec("multiseg-first-only", 4,
              "multi-segment varlen prefill: only the first segment is computed",
              f"{_M}.prefill:multiseg_first_only", "torch", (Op.PREFILL,),
              ("prefill-segments",), ("row_error",), "prefill_multiseg",
              contrast="passes on a one-segment batch"),
    FaultSpec("pad-heads-floor-div", 5,
              "q padded with repeat_interleave(16 // H): 12 heads stay 12, AITER refuses them",
              f"{_M}.heads:pad_heads_floor_div", "aiter-model", DECODE + SPARSE,
              ("decode-heads",), ("crash",), "decode_heads",
              contrast="passes with 8 heads (16 // 8 == 2 is right)"),
    FaultSpec("offset-wrap-int32", 6,
              "page byte offset page * page_bytes held in int32: pages past 2^31 read "
              "memory before the pool",
              f"{_M}.paging:offset_wrap_int32", "aiter-model", DECODE + SPARSE,
              ("decode-large-kv",), ("nonfinite",), "decode_large_kv31",
              contrast="passes when every live page sits below 2^31"),
    FaultSpec("offset-wrap-uint32", 6,
              "page byte offset held in uint32: pages past 2^32 read the pool's bottom",
              f"{_M}.paging:offset_wrap_uint32", "aiter-model", DECODE + SPARSE,
              ("decode-large-kv",), ("nonfinite",), "decode_large_kv32",
              contrast="passes on a pool past 2^31 that ends below 2^32"),
    FaultSpec("read-past-page-end", 6,
              "the last page read whole (kv_last_page_lens = page_size): a partial page's "
              "poisoned tail is used",
              f"{_M}.paging:read_past_page_end", "aiter-model", (Op.DECODE, Op.PAGED_PREFILL),
              ("decode-mixed", "decode-tail-sentinel"), ("nonfinite", "row_error"),
              "decode_paged",
              contrast="passes at page size 1 (no partial pages)"),
    FaultSpec("fp8-unit-scale", 7,
              "FP8 inputs re-cast from the unquantised values with unit scale (ignoring the "
              "amax scales): e4m3fn saturates, e4m3fnuz gives NaN",
              f"{_M}.fp8:fp8_unit_scale", "torch", (Op.DECODE, Op.PREFILL),
              ("fp8-outliers", "prefill-fp8"), ("nonfinite", "row_error"), "decode_fp8_outliers"),
    FaultSpec("context-chunk-lse", 8,
              "chunked prefill: non-causal context chunk + causal own chunk merged by LSE, the "
              "context LSE in base 2",
              f"{_M}.prefill:context_chunk_lse", "torch", (Op.PREFILL, Op.PAGED_PREFILL),
              ("prefill-segments", "prefill-paged"), ("row_error", "lse"), "prefill_context",
              contrast="passes when no segment has context"),
    FaultSpec("mtp-metadata-qlen1", 9,
              "MTP decode with persistent metadata built for q_len 1 (max_seqlen_qo = "
              "uni_seqlen_qo = 1)",
              f"{_M}.decode:mtp_metadata_qlen1", "aiter-model", DECODE,
              ("decode-mtp",), ("metadata", "row_error"), "decode_mtp",
              contrast="passes on q_len-1 decode"),
    FaultSpec("stale-metadata", 10,
              "persistent buffers kept across calls but refilled only when they grow: another "
              "batch shape runs on an old schedule",
              f"{_M}.persistent:stale_metadata", "aiter-model", DECODE + SPARSE,
              ("decode-mixed", "decode-reshape"), ("metadata", "row_error", "crash"),
              "decode_any",
              stateful=True, contrast="passes on the first call of an instance"),
    FaultSpec("last-page-lens-one", 11,
              "kv_last_page_lens of all 1s (what page size 1 always has) at page size > 1",
              f"{_M}.paging:last_page_lens_one", "aiter-model", (Op.DECODE, Op.PAGED_PREFILL),
              ("decode-mixed", "prefill-paged"), ("row_error",), "decode_paged",
              contrast="passes at page size 1"),
    FaultSpec("unpad-heads-slice", 12,
              "heads padded by repeating each (8 -> 16), output unpadded by slicing the first H",
              f"{_M}.heads:unpad_heads_slice", "aiter-model", DECODE + SPARSE,
              ("decode-heads",), ("row_error",), "decode_heads",
              contrast="passes with 12 heads (zero-padded) and 16 (no padding)"),
    FaultSpec("indexer-key-scale-ignored", 13,
              "indexer keys used as stored FP8 values: the per-token scale is never applied",
              f"{_M}.pipeline:indexer_key_scale_ignored", "torch", INDEXER,
              ("indexer-prefill", "indexer-paged"), ("logit_error",), "indexer_any"),
    FaultSpec("indexer-key-scale-neighbour", 13,
              "each indexer key's scale read one token on (the next token's 4 scale bytes)",
              f"{_M}.pipeline:indexer_key_scale_neighbour", "torch", INDEXER,
              ("indexer-prefill", "indexer-paged"), ("logit_error",), "indexer_any"),
    FaultSpec("indexer-q-scale-twice", 13,
              "the q scale folded into the indexer weights a second time",
              f"{_M}.pipeline:indexer_q_scale_twice", "torch", INDEXER,
              ("indexer-prefill", "indexer-paged"), ("logit_error",), "indexer_any"),
    FaultSpec("indexer-relu-dropped", 13,
              "indexer logits sum_h w (q . k) without the ReLU: negative head scores count",
              f"{_M}.pipeline:indexer_relu_dropped", "torch", INDEXER,
              ("indexer-prefill", "indexer-paged"), ("logit_error",), "indexer_any"),
    FaultSpec("indexer-window-off-by-one", 13,
              "each row's causal window end one position too far (ke + 1, visible + 1)",
              f"{_M}.pipeline:indexer_window_off_by_one", "torch", INDEXER,
              ("indexer-prefill", "indexer-paged"), ("mask",), "indexer_any"),
    FaultSpec("indexer-page-tail-read", 13,
              "the paged indexer reads each request's last page whole: the poisoned tail past "
              "the context length becomes visible positions",
              f"{_M}.pipeline:indexer_page_tail_read", "torch", PAGED_INDEXER,
              ("indexer-paged",), ("mask",), "indexer_paged",
              contrast="passes when every kv length is a multiple of the page size"),
    FaultSpec("indexer-mtp-full-context", 9,
              "MTP indexer rows given the request's context length (1-D) instead of their own "
              "(2-D [batch, next_n]): every row sees the whole context",
              f"{_M}.pipeline:indexer_mtp_full_context", "torch", PAGED_INDEXER,
              ("indexer-paged",), ("mask",), "indexer_paged",
              contrast="passes with next_n 1"),
    FaultSpec("topk-masked-chosen", 14,
              "rows that see fewer than k positions filled with masked ones (torch.topk over "
              "-inf) instead of -1",
              f"{_M}.pipeline:topk_masked_chosen", "torch", (Op.TOPK,),
              ("topk",), ("selection",), "topk_any",
              contrast="passes when every row sees at least k positions"),
    FaultSpec("topk-not-localised", 14,
              "prefill top-k returns batch-wide positions, not relative to the row's window "
              "start (ks)",
              f"{_M}.pipeline:topk_not_localised", "torch", (Op.TOPK,),
              ("topk",), ("selection",), "topk_prefill",
              contrast="passes in the decode form and on a one-request batch (ks = 0)"),
    FaultSpec("conversion-minus1-to-slot", 15,
              "top-k -1 padding converted as position 0: a valid-looking slot of the request",
              f"{_M}.pipeline:conversion_minus1_to_slot", "torch", (Op.INDEX_CONVERSION,),
              ("conversion",), ("slots", "indptr"), "conversion_any",
              contrast="passes when every token has topk valid positions"),
    FaultSpec("conversion-contiguous-base", 15,
              "slot = the request's first slot + position: assumes a request's pages are "
              "contiguous",
              f"{_M}.pipeline:conversion_contiguous_base", "torch", (Op.INDEX_CONVERSION,),
              ("conversion",), ("slots",), "conversion_any",
              contrast="passes on a packed pool (each request's pages contiguous, in order)"),
    FaultSpec("conversion-ragged-indptr", 2,
              "a ragged slot buffer published with row-major offsets (t * topk)",
              f"{_M}.pipeline:conversion_ragged_indptr", "torch", (Op.INDEX_CONVERSION,),
              ("conversion",), ("indptr",), "conversion_ragged",
              contrast="passes when every token has topk valid positions"),
    FaultSpec("sparse-prefill-minus1-slot0", 15,
              "sparse prefill reads index -1 as row 0 of the latent KV",
              f"{_M}.pipeline:sparse_prefill_minus1_slot0", "torch", (Op.SPARSE_PREFILL,),
              ("sparse-prefill",), ("row_error", "lse", "nonfinite"), "sparse_prefill_any",
              contrast="passes when every row has topk valid indices"),
    FaultSpec("sparse-prefill-max-logits-unscaled", "generic",
              "sparse prefill's max_logits returned without the softmax scale",
              f"{_M}.pipeline:sparse_prefill_max_logits_unscaled", "torch",
              (Op.SPARSE_PREFILL,), ("sparse-prefill",), ("max_logits",),
              "sparse_prefill_any"),
    FaultSpec("pipeline-ragged-rowmajor", 2,
              "the composed path's slots written ragged (each token's valid slots back to "
              "back) and read row-major (t * topk) by the sparse attention",
              f"{_M}.pipeline:pipeline_ragged_rowmajor", "torch", (Op.SPARSE_PIPELINE,),
              ("pipeline",), ("selection", "row_error", "nonfinite"), "pipeline_any",
              contrast="passes when every token selects topk positions"),
    FaultSpec("pipeline-local-as-global", 15,
              "the composed path hands the attention request-local top-k positions as global "
              "slots (the conversion through the block table skipped)",
              f"{_M}.pipeline:pipeline_local_as_global", "torch", (Op.SPARSE_PIPELINE,),
              ("pipeline",), ("selection", "row_error"), "pipeline_any",
              contrast="passes with one request on a packed pool (slot = position)"),
    FaultSpec("perturb-row", "generic",
              "one (token, head) output row scaled by 1.02",
              f"{_M}.generic:perturb_row", "torch",
              (Op.PREFILL, Op.PAGED_PREFILL, Op.DECODE, Op.SPARSE_DECODE, Op.SPARSE_PREFILL,
               Op.SPARSE_PIPELINE),
              ("decode-mixed", "prefill-segments"), ("row_error",), "decode_bf16"),
    FaultSpec("default-softmax-scale", "generic",
              "sm_scale not passed: AITER decode's default 1/sqrt(576) instead of the model's",
              f"{_M}.generic:default_softmax_scale", "aiter-model", DECODE + SPARSE,
              ("decode-mixed",), ("row_error",), "decode_any"),
    FaultSpec("lse-base2", "generic",
              "LSE returned in base 2",
              f"{_M}.generic:lse_base2", "torch",
              (Op.PREFILL, Op.PAGED_PREFILL, Op.DECODE, Op.SPARSE_DECODE, Op.SPARSE_PREFILL,
               Op.SPARSE_PIPELINE),
              ("decode-mixed", "prefill-segments"), ("lse",), "decode_any"),
    FaultSpec("causal-top-left", "generic",
              "causal mask aligned top-left (query i sees kv j <= i)",
              f"{_M}.generic:causal_top_left", "torch", (Op.PREFILL, Op.PAGED_PREFILL),
              ("prefill-segments", "prefill-paged"), ("row_error",), "prefill_context",
              contrast="passes when no segment has context"),
    FaultSpec("last-page-off-by-one", "generic",
              "kv_last_page_lens = kv_len % page_size: a full last page is dropped",
              f"{_M}.generic:last_page_off_by_one", "aiter-model",
              (Op.DECODE, Op.PAGED_PREFILL),
              ("decode-mixed",), ("row_error",), "decode_page_boundary",
              contrast="passes when every last page is partial"),
    FaultSpec("write-past-output", "generic",
              "the last output tile writes the row after the output",
              f"{_M}.generic:write_past_output", "torch",
              (Op.PREFILL, Op.PAGED_PREFILL, Op.DECODE, Op.SPARSE_DECODE, Op.SPARSE_PREFILL,
               Op.SPARSE_PIPELINE),
              ("decode-mixed", "prefill-segments"), ("guards",), "decode_any"),
    FaultSpec("tile-multiple-drops-last", "kv-multiple-of-256",
              "a tile loop bound < instead of <= : a kv length that is an exact multiple of 256 "
              "never visits its last 256-key tile",
              f"{_M}.boundary:tile_multiple_drops_last", "torch", DECODE + PREFILL,
              ("decode-tile-boundary",), ("row_error",), "decode_tile_boundary",
              contrast="passes when no kv length is a multiple of 256"),
    FaultSpec("tile-multiple-drops-last-64", "kv-multiple-of-64",
              "the same loop bound with 64-key tiles: a kv length that is an exact multiple "
              "of 64 never visits its last 64-key tile",
              f"{_M}.boundary:tile_multiple_drops_last_64", "torch", DECODE + PREFILL,
              ("decode-tile-boundary",), ("row_error", "lse"), "decode_tile_boundary",
              contrast="passes when no kv length is a multiple of 64"),
    FaultSpec("tile-multiple-drops-last-128", "kv-multiple-of-128",
              "the same loop bound with 128-key tiles: a kv length that is an exact multiple "
              "of 128 never visits its last 128-key tile",
              f"{_M}.boundary:tile_multiple_drops_last_128", "torch", DECODE + PREFILL,
              ("decode-tile-boundary",), ("row_error", "lse"), "decode_tile_boundary",
              contrast="passes when no kv length is a multiple of 128"),
    FaultSpec("tile-ceil-off-by-one", "kv-tile-off-by-one",
              "first 256-key tile peeled, the rest counted (kv_len - 2) // 256: a kv longer "
              "than 256 with one key in its last tile (kv_len % 256 == 1) drops that key",
              f"{_M}.boundary:tile_ceil_off_by_one", "torch", DECODE + PREFILL,
              ("decode-tile-boundary",), ("row_error", "lse"), "decode_tile_off_by_one",
              contrast="passes at multiples of 256 and one below them"),
    FaultSpec("kv-clamp-8k", "kv-longer-than-8192",
              "kv_len clamped to 8192 (a 13-bit length, a buffer sized for 8k): longer "
              "requests attend to their first 8192 keys",
              f"{_M}.boundary:kv_clamp_8k", "torch", DECODE,
              ("decode-long-kv",), ("row_error",), "decode_long_kv",
              contrast="passes up to 8192 tokens"),
    FaultSpec("kv-clamp-16k", "kv-longer-than-16384",
              "kv_len clamped to 16384 (a 14-bit length, a buffer sized for 16k): longer "
              "requests attend to their first 16384 keys",
              f"{_M}.boundary:kv_clamp_16k", "torch", DECODE,
              ("decode-long-kv",), ("row_error",), "decode_long_kv",
              contrast="passes up to 16384 tokens"),
    FaultSpec("kv-clamp-64k", "kv-longer-than-65536",
              "kv_len clamped to 65536 (a 16-bit length, a buffer sized for 64k): longer "
              "requests attend to their first 65536 keys",
              f"{_M}.boundary:kv_clamp_64k", "torch", DECODE,
              ("decode-long-kv",), ("row_error",), "decode_long_kv",
              contrast="passes up to 65536 tokens"),
    FaultSpec("page-id-int16", "page-id-past-2^15",
              "page ids held in int16: ids >= 2^15 turn negative and read memory before the "
              "pool",
              f"{_M}.boundary:page_id_int16", "torch", DECODE,
              ("decode-long-kv",), ("nonfinite",), "decode_long_kv",
              contrast="passes while every page id is below 2^15"),
    FaultSpec("page-id-uint16", "page-id-past-2^16",
              "page ids held in uint16: ids >= 2^16 wrap and read another page",
              f"{_M}.boundary:page_id_uint16", "torch", DECODE,
              ("decode-long-kv",), ("row_error", "nonfinite"), "decode_long_kv",
              contrast="passes while every page id is below 2^16"),
    FaultSpec("empty-request-shift", "empty-request",
              "empty decode requests dropped from qo_indptr but not from the page table: "
              "requests after one read their predecessor's pages (sparse: resolve their "
              "top-k positions through its page-table row)",
              f"{_M}.boundary:empty_request_shift", "torch", DECODE + SPARSE,
              ("decode-empty", "sparse-empty"), ("row_error", "quantisation_loss", "nonfinite"),
              "decode_empty",
              contrast="passes when empty requests come last"),
    FaultSpec("empty-segment-shift", "empty-segment",
              "empty prefill segments dropped from cu_seqlens_q but not from cu_seqlens_k "
              "(or the paged K/V page table): later segments attend to another segment's K/V",
              f"{_M}.boundary:empty_segment_shift", "torch", PREFILL + (Op.PAGED_PREFILL,),
              ("prefill-empty",), ("row_error", "quantisation_loss"), "prefill_empty",
              contrast="passes when empty segments come last"),
    FaultSpec("single-token-no-context", "single-token-segment",
              "a one-token segment in a prefill batch takes a decode-like path that forgets "
              "its context: it attends to itself only",
              f"{_M}.boundary:single_token_no_context", "torch", PREFILL,
              ("prefill-single-token",), ("row_error",), "prefill_context",
              contrast="passes when no one-token segment has context"),
    FaultSpec("soft-cap-ignored", "soft-cap",
              "the soft cap (cap * tanh(s / cap)) is not applied",
              f"{_M}.boundary:soft_cap_ignored", "torch", PREFILL,
              ("prefill-soft-cap",), ("row_error", "lse"), "prefill_soft_cap",
              contrast="passes without a soft cap"),
    FaultSpec("per-token-scale-ignored", "per-token-scale",
              "per-token q scales read as one per-tensor scale (the first row's)",
              f"{_M}.boundary:per_token_scale_ignored", "torch", PREFILL,
              ("prefill-per-token",), ("row_error", "nonfinite", "lse"), "prefill_per_token",
              contrast="passes with per-tensor scales"),
    FaultSpec("narrow-accumulation", "kv-narrow-accumulation",
              "the running output (P.V accumulator) kept in bf16 between 64-key kv tiles",
              f"{_M}.boundary:narrow_accumulation", "torch",
              ALL_OPS, ("decode-long-kv",), ("row_error",), "decode_long_kv",
              contrast="passes on short kv"),
    # Small systematic errors (precision.py): every row a little wrong, judged together.
    *(FaultSpec(name, "generic", mech, f"{_M}.precision:{name.replace('-', '_').replace('.', '')}",
                "torch", ALL_OPS, ("decode-precision", "prefill-precision"),
                ("rms_error", "max_abs_error", "row_error", "lse"), "decode_fp16",
                contrast="passes on fp8 KV (the e4m3 P rounding hides it)")
      for name, mech in (
          ("pv-bf16-tiles", "the P.V product of every other 64-key tile kept in bf16 before it "
                            "joins the fp32 accumulator"),
          ("qk-bf16-tiles", "the scores (Q.K) of every other 64-key tile rounded to bf16"),
          ("qk-rope-bf16", "the RoPE part of every score (q_pe . k_pe, its own MMA) in bf16"),
          ("narrow-accumulation-fp16", "the running output (P.V accumulator) kept in fp16 "
                                       "between 64-key tiles"),
          ("split-lse-bf16", "split-KV partial LSEs stored in bf16 before the merge"),
          ("q-rope-scale", "the RoPE part of q x 1.03 in the score product"),
          ("k-rope-scale", "the RoPE part of k x 0.97 in the score product"),
          ("q-nope-scale", "the nope (latent) part of q x 1.02 in the score product"),
          ("k-nope-scale", "the nope (latent) part of k x 0.98 in the score product (V unchanged)"),
          ("log2e-bf16", "exp2 with log2(e) rounded to bf16 (1.4453125, +0.18%)"),
          ("log2e-truncated", "exp2 with log2(e) = 1.44 (-0.19%)"),
          ("log2e-1.45", "exp2 with log2(e) = 1.45 (+0.51%)"),
          ("sm-scale-bf16", "the softmax scale passed as bf16 (-0.35%)"),
          ("sm-scale-log2e-bf16", "the fused exp2 constant scale x log2(e) passed as bf16 "
                                  "(+0.11%)"),
          ("sm-scale-base-bf16", "1/sqrt(192) rounded to bf16 before the YaRN mscale^2 "
                                 "(+0.13%)"),
      )),
    *(FaultSpec(name, "kv-longer-than-8192", mech,
                f"{_M}.precision:{name.replace('-', '_')}", "torch", DECODE,
                ("decode-8k-edge",), ("row_error", "rms_error", "max_abs_error", "lse"),
                "decode_8k_edge", contrast="passes up to 8192 tokens")
      for name, mech in (
          ("mask-edge-8192", "key 8192 masked: the tile starting at 8192 tests > instead of >="),
          ("mask-edge-every-8192", "the first key of every 8192-key chunk past the first masked"),
          ("mask-edge-tiles-8192", "the first key of every 64-key tile at or past 8192 masked"),
      )),
    FaultSpec("nondeterministic", "generic",
              "KV split count varies from run to run: accurate, but not bitwise reproducible",
              f"{_M}.generic:nondeterministic", "torch",
              (Op.PREFILL, Op.PAGED_PREFILL, Op.DECODE, Op.SPARSE_DECODE),
              ("decode-mixed", "prefill-segments"), ("determinism",), "decode_any",
              determinism=True, contrast="passes without a repeated run"),
)

FAULTS: dict[str, FaultSpec] = {s.name: s for s in _SPECS}

# The axis each fault acts along: what the first line of its failure card must name
# (mlacheck.localise.diagnose; tests/unit/faults/test_localisation.py). "crash": the fault
# is a refused call, whose card is the exception. "semantics": the kernel computed another
# convention, which the card names (mlacheck.counterfactual). A tuple: any of these axes. A
# global cause of small errors (GLOBAL) is named by any of its faces: every request (all),
# rows spread over the requests beyond their bound (rows), or the LSE alone with the outputs
# right (lse); a masked key at a long kv by its request, or the rows of it over their bound.
GLOBAL = ("all", "rows", "lse")
AXES: dict[str, str | tuple[str, ...]] = {
    "decode-num-actual-tokens": "output", "sparse-ragged-rowmajor": "rows",
    "sparse-dense-metadata": "schedule", "multiseg-as-one": "segments",
    "multiseg-first-only": "segments", "pad-heads-floor-div": "crash",
    "offset-wrap-int32": "pool", "offset-wrap-uint32": "pool", "read-past-page-end": "kv",
    "fp8-unit-scale": "semantics", "context-chunk-lse": "segments", "mtp-metadata-qlen1": "schedule",
    "stale-metadata": "schedule", "unpad-heads-slice": "heads",
    # where a request's KV fits one page, its one token read of the last page is what a
    # top-left causal mask gives a q_len-1 query (token 0 only): the same output, and the
    # counterfactual (issue 33) names that face first; the card's KV positions follow
    "last-page-lens-one": ("kv", "semantics"),
    "perturb-row": "heads", "default-softmax-scale": "semantics", "lse-base2": "semantics",
    "causal-top-left": "semantics", "last-page-off-by-one": "kv", "write-past-output": "output",
    "nondeterministic": "runs", "tile-multiple-drops-last": "kv", "kv-clamp-16k": "kv",
    "tile-multiple-drops-last-64": "kv", "tile-multiple-drops-last-128": "kv",
    "tile-ceil-off-by-one": "kv", "kv-clamp-8k": "kv", "kv-clamp-64k": "kv",
    "page-id-int16": "requests", "page-id-uint16": "requests",
    "empty-request-shift": "requests", "empty-segment-shift": "segments",
    "single-token-no-context": "segments", "soft-cap-ignored": "semantics",
    "per-token-scale-ignored": "rows", "narrow-accumulation": "requests",
    "indexer-key-scale-ignored": "all", "indexer-key-scale-neighbour": "all",
    "indexer-q-scale-twice": "all", "indexer-relu-dropped": "all",
    "indexer-window-off-by-one": "window", "indexer-page-tail-read": "window",
    "indexer-mtp-full-context": "window", "topk-masked-chosen": "selection",
    "topk-not-localised": "selection", "conversion-minus1-to-slot": "slots",
    "conversion-contiguous-base": "slots", "conversion-ragged-indptr": "slots",
    "sparse-prefill-minus1-slot0": "rows", "sparse-prefill-max-logits-unscaled": "max_logits",
    "pipeline-ragged-rowmajor": "selection", "pipeline-local-as-global": "selection",
    **{n: GLOBAL for n in (
        "pv-bf16-tiles", "qk-bf16-tiles", "qk-rope-bf16", "narrow-accumulation-fp16",
        "split-lse-bf16", "q-rope-scale", "k-rope-scale", "q-nope-scale", "k-nope-scale",
        "log2e-bf16", "log2e-truncated", "log2e-1.45", "sm-scale-bf16", "sm-scale-log2e-bf16",
        "sm-scale-base-bf16")},
    **{n: ("requests", "rows") for n in (
        "mask-edge-8192", "mask-edge-every-8192", "mask-edge-tiles-8192")},
}

# What the registry merges into its built-ins: `fault:<name>` -> "module:factory".
BUILTIN_NAMES: dict[str, str] = {s.backend_name: s.factory for s in _SPECS}


def spec_of(backend_name: str) -> FaultSpec:
    """The spec of `fault:<name>` (or of `<name>`)."""
    name = backend_name[len(PREFIX):] if backend_name.startswith(PREFIX) else backend_name
    try:
        return FAULTS[name]
    except KeyError:
        raise KeyError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}") from None


def make(name: str, inner: str | None = None) -> Any:
    """A fresh instance of a fault, optionally planted in another backend (`inner`)."""
    return spec_of(name).build(inner)


__all__ = ["AXES", "BUILTIN_NAMES", "FAULTS", "GLOBAL", "PREFIX", "FaultSpec", "make", "spec_of"]
