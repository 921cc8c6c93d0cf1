"""`torch`: a same-precision PyTorch implementation of every op.

It computes as an attention kernel does (mlacheck.backends.numerics: fp32 scores from the
stored inputs, online softmax over kv blocks, P in the kernel's P format, fp32 accumulation)
and rounds the output to its dtype. It is both a backend under test and the *baseline* of
the FlashAttention rule in the judge.

Variants change accumulation order and structure without changing precision, so they are
correct implementations that differ from the baseline (the false-alarm check needs those):
`kv_block` (online-softmax tile), `splits` (KV split into chunks, each normalised with its
LSE and merged, as persistent decode does) and `reverse` (blocks visited last to first).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from mlacheck import layouts
from mlacheck.backends import torch_pipeline as tp
from mlacheck.backends.base import Capability, Output
from mlacheck.backends.numerics import (
    DEFAULT_NUMERICS,
    Numerics,
    flash_attend,
    p_format_for,
)
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs
from mlacheck.spec import PIPELINE_OPS, Case, Op, PrefillCase


class TorchBackend:
    """Same-precision PyTorch implementation (see module docstring)."""

    def __init__(self, numerics: Numerics = DEFAULT_NUMERICS, name: str = "torch") -> None:
        self.numerics = numerics
        self.name = name

    def unavailable(self) -> str | None:
        return None

    def version(self) -> str:
        """mlacheck's own implementation, on the torch it runs with."""
        import mlacheck

        return f"mlacheck {mlacheck.__version__} (torch {torch.__version__})"

    def softmax_scale(self, case: Case) -> float:
        """The scale this implementation applies (always the case's; fault doubles override)."""
        return case.softmax_scale

    def score_operands(self, case: Case, q: torch.Tensor, k: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [Sq, H, D] and k [Sk, Hk, D] as the score product reads them (V is read apart,
        unchanged): the stored values here; fault doubles override (a scale on a part)."""
        return q, k

    def visible_keys(self, case: Case, kv_len: int) -> torch.Tensor | None:
        """Keys a decode request attends to besides the causal mask [kv_len] (None: all);
        fault doubles override (a key masked at a tile edge)."""
        return None

    def capabilities(self) -> dict[str, Capability]:
        # every layout: pools are read through KVPool.gather, which reads any layout back
        every = layouts.NAMES
        full = Capability(soft_cap=True, per_token_scales=True, empty_requests=True,
                          layouts=every)
        decode = Capability(causal=(True,), per_token_scales=True, empty_requests=True,
                            layouts=every)
        indexer = Capability(per_token_scales=True, empty_requests=True)
        sparse_prefill = Capability(empty_requests=True)
        pipeline = Capability(empty_requests=True, layouts=every)
        if self.numerics.p_normalised:  # 16-bit P only (P_NORMALISED_FORMATS): every op
            # whose attention rounds P with these numerics
            full, decode, sparse_prefill, pipeline = (
                replace(c, q_formats=P_NORMALISED_FORMATS, kv_formats=P_NORMALISED_FORMATS,
                        reasons={"q_formats": P_NORMALISED_FP8, "kv_formats": P_NORMALISED_FP8})
                for c in (full, decode, sparse_prefill, pipeline))
        return {Op.PREFILL: full, Op.PAGED_PREFILL: full, Op.DECODE: decode,
                Op.SPARSE_DECODE: decode,
                # the DeepSeek-V3.2 sparse pipeline (mlacheck.backends.torch_pipeline)
                Op.MQA_LOGITS: indexer, Op.PAGED_MQA_LOGITS: indexer,
                Op.TOPK: Capability(empty_requests=True),
                Op.INDEX_CONVERSION: Capability(empty_requests=True),
                Op.SPARSE_PREFILL: sparse_prefill,
                Op.SPARSE_PIPELINE: pipeline}

    def run(self, case: Case, inputs: Inputs) -> Output:
        if case.op in PIPELINE_OPS:
            return self.run_pipeline_op(case, inputs)
        op_run = {Op.PREFILL: self._prefill, Op.PAGED_PREFILL: self._prefill,
                  Op.DECODE: self._decode, Op.SPARSE_DECODE: self._sparse}[case.op]
        out, lse = op_run(inputs)
        inputs.out.out.copy_(out.to(inputs.out.out.dtype))
        return Output(inputs.out.out, lse, wrote_into_guarded=True)

    def run_pipeline_op(self, case: Case, inputs: Any) -> Output:
        """The sparse-pipeline ops: their kernel-precision implementations, written into the
        guarded output buffers."""
        op = case.op
        if op in (Op.MQA_LOGITS, Op.PAGED_MQA_LOGITS):
            logits = (tp.mqa_logits(inputs) if op == Op.MQA_LOGITS
                      else tp.paged_mqa_logits(inputs))
            return _written(inputs, logits)
        if op == Op.TOPK:
            return _written(inputs, tp.topk(inputs))
        if op == Op.INDEX_CONVERSION:
            slots, indptr = tp.convert(inputs)
            if indptr is None:
                return _written(inputs, slots)
            inputs.out.out[: slots.numel()] = slots.to(inputs.device)
            return Output(inputs.out.out, extra={"indptr": indptr}, wrote_into_guarded=True)
        if op == Op.SPARSE_PREFILL:
            out, lse, mx = tp.sparse_prefill(inputs, self.numerics,
                                             scale=self.softmax_scale(case))
            res = _written(inputs, out)
            res.lse, res.extra["max_logits"] = lse, mx
            return res
        assert op == Op.SPARSE_PIPELINE
        _, slots = tp.pipeline_selection(inputs)
        out, lse = tp.slots_attention(inputs, slots, self.numerics)
        res = _written(inputs, out)
        res.lse, res.extra["slots"] = lse, slots
        return res

    # -- ops
    def _prefill(self, inputs: PrefillInputs) -> tuple[torch.Tensor, torch.Tensor]:
        case: PrefillCase = inputs.case
        from mlacheck.golden.prefill import kv_tensors  # the same gather the kernel would do

        ks, vs = kv_tensors(inputs, "exact")
        q = inputs.q.dequant()
        qc = inputs.cu_seqlens_q.tolist()
        pf = p_format_for(case.quant.kv, self.numerics)
        res = [
            flash_attend(*self.score_operands(case, q[qc[i] : qc[i + 1]], ks[i]), vs[i],
                         self.softmax_scale(case), case.causal, pf, self.numerics, case.soft_cap)
            for i in range(len(case.segments))
        ]
        return torch.cat([r[0] for r in res]), torch.cat([r[1] for r in res])

    def _decode(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        q = inputs.q.dequant()
        qo = inputs.qo_indptr.tolist()
        pf = p_format_for(inputs.case.quant.kv, self.numerics)
        res = [self._decode_request(inputs, r, q[qo[r] : qo[r + 1]], pf)
               for r in range(len(inputs.case.requests))]
        return torch.cat([o for o, _ in res]), torch.cat([lse for _, lse in res])

    def _decode_request(self, inputs: DecodeInputs, r: int, q: torch.Tensor, p_format: str
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r's queries over its latents, read through the page table (causal
        bottom-right: MTP tokens see the keys up to their own)."""
        case = inputs.case
        kv = inputs.pool.gather(r)
        qr, k = self.score_operands(case, q, kv)
        return flash_attend(qr, k, kv[..., :case.dims.kv_lora_rank], self.softmax_scale(case),
                            True, p_format, self.numerics,
                            kv_valid=self.visible_keys(case, kv.shape[0]))

    def _sparse(self, inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor]:
        case = inputs.case
        assert inputs.topk_indices is not None
        rank = case.dims.kv_lora_rank
        q = inputs.q.dequant()
        pf = p_format_for(case.quant.kv, self.numerics)
        idx = inputs.topk_indices.long()
        outs, lses = [], []
        t = 0
        for r, req in enumerate(case.requests):
            kv = inputs.pool.gather(r)
            for _ in range(req.q_len):
                row = idx[t]
                valid = row >= 0
                sel = kv[row.clamp(min=0)]
                qt, k = self.score_operands(case, q[t : t + 1], sel)
                o, lse = flash_attend(qt, k, sel[..., :rank], self.softmax_scale(case), False, pf,
                                      self.numerics, kv_valid=valid)
                outs.append(o)
                lses.append(lse)
                t += 1
        return torch.cat(outs), torch.cat(lses)


def _written(inputs: Any, result: torch.Tensor) -> Output:
    """`result` copied into the inputs' guarded output buffer (the kernel's output view)."""
    inputs.out.out.copy_(result.to(inputs.out.out.dtype))
    return Output(inputs.out.out, wrote_into_guarded=True)


def factory() -> TorchBackend:
    return TorchBackend()


def split_factory() -> TorchBackend:
    """KV split in 4 chunks merged by LSE (persistent-decode structure), smaller tiles."""
    return TorchBackend(Numerics(kv_block=32, splits=4), "torch-split")


def reverse_factory() -> TorchBackend:
    """KV tiles visited last to first: another accumulation order."""
    return TorchBackend(Numerics(kv_block=16, reverse=True), "torch-reverse")


# FlashAttention-4's rescale threshold is 2^8 with 16-bit P; an FP8 P must stay below the
# format's max (e4m3fnuz: 240), so a kernel with FP8 P lets it reach 2^7 at most.
LAZY_RESCALE_LOG2 = 7.0


def lazy_factory() -> TorchBackend:
    """A lazily rescaled online softmax (the running max moves only past a 2^7 jump; P may
    reach 2^7 before its FP8 rounding): another correct way to round P."""
    return TorchBackend(Numerics(lazy_rescale=LAZY_RESCALE_LOG2), "torch-lazy")


# P normalised before an e4m3 rounding (P / l) puts a long row's weights into e4m3's subnormal
# range or below it: with the `ties` inputs every weight of a 2048-key top-k row is 1/2048,
# under e4m3fn's smallest subnormal 2^-9, and rounds to 0 (an output of 0: row error 0.75-0.95,
# 3-3.8x the row bound, 94 of 1371 premerge case runs per seed on the H100 host's CPU,
# 2026-11-26). Not a correct FP8 implementation, so this variant is a correct control for
# 16-bit P only (a kernel that rounds P so is caught: bug class precision).
P_NORMALISED_FORMATS = ("bf16", "fp16", "fp32")
P_NORMALISED_FP8 = ("torch-normalised rounds P / l to the P format: with FP8 P a long row's "
                    "weights fall below e4m3's subnormals (a 16-bit-P control only)")


def normalised_factory() -> TorchBackend:
    """P rounded after normalisation (P / l, the largest weight not exactly 1)."""
    return TorchBackend(Numerics(p_normalised=True), "torch-normalised")
