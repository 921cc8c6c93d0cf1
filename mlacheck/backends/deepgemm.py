"""`deepgemm`: DeepSeek's DeepGEMM lightning-indexer kernels on sm_90 (H100/H200).

mqa_logits: `deep_gemm.fp8_mqa_logits(q, kv=(k_fp8, k_scales), weights, cu_seq_len_k_start,
cu_seq_len_k_end, clean_logits=True)`: q [T, H, D] float8_e4m3fn, keys [S, D] float8_e4m3fn
with one FP32 scale per key, weights [T, H] FP32 (the q scale folded in, as vLLM does), row
t over keys [start, end); -inf outside (clean_logits). Returns [T, S] (a view of an aligned
buffer), copied into the guarded output.

paged_mqa_logits: `deep_gemm.fp8_paged_mqa_logits(q [B, next_n, H, D], kv_cache [P, 64, 1,
D + 4] uint8 (a page: its values, then its scales: mlacheck.indexer_cache), weights, context_lens
[B, next_n] int32, block_table [B, W] int32, schedule_meta, max_context_len,
clean_logits=False)` with `schedule_meta = get_paged_mqa_logits_metadata(context_lens, 64,
num_sms)`. The 2-D context lens are each row's own visible length (token j of a request of
kv_len n sees n - next_n + j + 1 positions); with 2-D lens sm_90 allows no clean_logits, so
the columns past a row's length are whatever the kernel left there: DOCUMENTED as not written
(csrc/apis/attention.hpp), they are set to -inf here before the judge sees them, and the
verdict says so (`past_length_columns`).

sm_90 takes (csrc/apis/attention.hpp): H in {32, 64}, D in {32, 64, 128}, page size 64 for
the paged form; anything else is a SKIP naming the assert. Importing this module imports no
deep_gemm. The build: docs/deepgemm.md.
"""

from __future__ import annotations

from typing import Any

import torch

from mlacheck.backends.base import Capability, Output
from mlacheck.backends.toolkit import LibraryAdapter, Loaded, cuda_refusal, load_library
from mlacheck.ops import Op
from mlacheck.spec import Case

MODULE = "deep_gemm"
DISTRIBUTIONS = ("deep_gemm", "deep-gemm")
INSTALL_HINT = "build deepseek-ai/DeepGEMM for sm_90 (docs/deepgemm.md)"
CALLED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "fp8_mqa_logits": ("q", "kv", "weights", "cu_seq_len_k_start", "cu_seq_len_k_end",
                       "clean_logits"),
    "get_paged_mqa_logits_metadata": ("context_lens", "block_kv", "num_sms"),
    "fp8_paged_mqa_logits": ("q", "kv_cache", "weights", "context_lens", "block_table",
                             "schedule_meta", "max_context_len", "clean_logits"),
}
PAGED_FUNCTIONS = ("get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits")

SM90_HEADS = (32, 64)  # DG_HOST_ASSERT(arch_major == 9 and (num_heads == 32 or num_heads == 64))
SM90_HEAD_DIMS = (32, 64, 128)
SM90_BLOCK_KV = 64  # the paged cache's page size on sm_90
H100_SMS = 132
# Read in DeepGEMM 54e2261's csrc/apis/attention.hpp (DG_HOST_ASSERTs).
_FP8 = ("DeepGEMM's indexer takes float8_e4m3fn q and keys (q_fp / kv_fp scalar_type == "
        "kFloat8_e4m3fn, csrc/apis/attention.hpp:126, :133, :303)")
REASONS = {
    "q_formats": _FP8,
    "kv_formats": _FP8,
    "head_counts": "DeepGEMM sm_90: num_heads 32 or 64 (csrc/apis/attention.hpp:122-123, "
                   ":299-300)",
    "page_sizes": "DeepGEMM sm_90: block_kv 64 (csrc/apis/attention.hpp:224, :308)",
}


def load() -> Loaded | str:
    return load_library(MODULE, distributions=DISTRIBUTIONS, install_hint=INSTALL_HINT,
                        called=CALLED_PARAMETERS)


def _head_dim(case: Case) -> str | None:
    d = case.head_dim  # type: ignore[union-attr]
    if d not in SM90_HEAD_DIMS:
        return (f"head_dim {d}: DeepGEMM sm_90 takes 32, 64 or 128 (csrc/apis/attention.hpp:"
                f"124)")
    return None


class DeepGemmBackend(LibraryAdapter):
    """DeepGEMM's FP8 MQA logits (both forms) behind the backend contract."""

    def __init__(self, name: str = "deepgemm") -> None:
        self.name = name

    def import_library(self) -> Loaded | str:
        return load()

    def machine_refusal(self) -> str | None:
        return cuda_refusal("DeepGEMM", 9, "this adapter runs DeepGEMM's sm_90 indexer kernels "
                                           "(H100/H200) only")

    def capabilities(self) -> dict[str, Capability]:
        got = self.loaded()
        if isinstance(got, str):
            return {op: Capability(refusal=got) for op in (Op.MQA_LOGITS, Op.PAGED_MQA_LOGITS)}
        common: dict[str, Any] = dict(
            q_formats=("fp8_e4m3fn",), kv_formats=("fp8_e4m3fn",), per_token_scales=True,
            head_counts=SM90_HEADS, devices=("cuda",), reasons=REASONS)
        return {
            Op.MQA_LOGITS: Capability(
                **common, empty_requests=True, rules=(_head_dim,),
                refusal=got.first_problem(("fp8_mqa_logits",)),
                notes="fp8_mqa_logits (clean_logits=True)"),
            Op.PAGED_MQA_LOGITS: Capability(
                **common, page_sizes=(SM90_BLOCK_KV,), rules=(_head_dim,),
                refusal=got.first_problem(PAGED_FUNCTIONS),
                notes="fp8_paged_mqa_logits with 2-D context lens (each row's own length); "
                      "columns past a row's length are not written by the kernel: set to "
                      "-inf by the adapter"),
        }

    def run(self, case: Case, inputs: Any) -> Output:
        got = self.loaded()
        if isinstance(got, str):
            raise RuntimeError(got)
        dg = got.module
        meta: dict[str, Any] = {"deepgemm": {"version": got.version}}
        out = inputs.out.out
        if case.op == Op.MQA_LOGITS:
            q = inputs.query
            logits = dg.fp8_mqa_logits(
                q=q.q.contiguous(), kv=(inputs.keys.values.contiguous(),
                                        inputs.keys.scales.contiguous()),
                weights=q.weights.contiguous(), cu_seq_len_k_start=inputs.k_start.contiguous(),
                cu_seq_len_k_end=inputs.k_end.contiguous(), clean_logits=True)
            out.copy_(logits)
            return Output(out, metadata=meta, wrote_into_guarded=True)
        assert case.op == Op.PAGED_MQA_LOGITS
        b, nn = len(case.requests), case.next_n  # type: ignore[union-attr]
        lens = inputs.row_visible.to(torch.int32).reshape(b, nn).contiguous().to(inputs.device)
        num_sms = _num_sms(inputs.device)
        sched = dg.get_paged_mqa_logits_metadata(context_lens=lens, block_kv=SM90_BLOCK_KV,
                                                 num_sms=num_sms)
        q = inputs.query
        logits = dg.fp8_paged_mqa_logits(
            q=q.q.view(b, nn, case.num_heads, case.head_dim).contiguous(),  # type: ignore[union-attr]
            kv_cache=inputs.pool.data, weights=q.weights.contiguous(), context_lens=lens,
            block_table=inputs.block_table.contiguous(), schedule_meta=sched,
            max_context_len=out.shape[1], clean_logits=False)
        past = torch.arange(out.shape[1], device=out.device)[None, :] >= \
            inputs.row_visible.to(out.device)[:, None]
        out.copy_(logits.masked_fill(past, float("-inf")))
        meta["deepgemm"]["past_length_columns"] = "not written by the kernel: set to -inf"
        return Output(out, metadata=meta, wrote_into_guarded=True)


def _num_sms(device: torch.device) -> int:
    """The SMs DeepGEMM's paged schedule is built for: the device's (an H100's 132 where
    there is no CUDA device: the CPU tests with a fake deep_gemm)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H100_SMS


def factory() -> DeepGemmBackend:
    return DeepGemmBackend()


# --------------------------------------------------------------------------- composed path


class DeepGemmFlashMLAPipeline(LibraryAdapter):
    """`deepgemm-flashmla`: the DeepSeek-V3.2 decode path as it runs on NVIDIA: DeepGEMM's
    paged indexer logits -> top-k (mlacheck's torch top-k: the top-k kernel vLLM uses on CUDA
    lives in vLLM itself) -> global slots through the block table -> FlashMLA's sparse FP8
    decode. Each stage's adapter is the same code its own op uses; the verdict judges the
    selection and the attention (docs/sparse-pipeline.md)."""

    def __init__(self, name: str = "deepgemm-flashmla") -> None:
        self.name = name
        self.deepgemm = DeepGemmBackend()
        from mlacheck.backends.flashmla import FlashMLABackend

        self.flashmla = FlashMLABackend()

    def import_library(self) -> Loaded | str:
        got = self.deepgemm.loaded()
        flash = self.flashmla.loaded()
        if isinstance(flash, str):
            return flash
        return got

    def version(self) -> str:
        return f"{self.deepgemm.version()} + {self.flashmla.version()}"

    def machine_refusal(self) -> str | None:
        return self.deepgemm.machine_refusal()

    def capabilities(self) -> dict[str, Capability]:
        logits = self.deepgemm.capabilities().get(Op.PAGED_MQA_LOGITS)
        attention = self.flashmla.capabilities().get(Op.SPARSE_DECODE)
        refusal = next((c.refusal for c in (logits, attention) if c is not None and c.refusal),
                       None)

        def stages(case: Case) -> str | None:
            idx, att = case.indexer_case(), case.attention_case()  # type: ignore[union-attr]
            for cap, sub in ((logits, idx), (attention, att)):
                why = cap.why_not(sub, "cuda") if cap is not None else "stage not provided"
                if why:
                    return why
            return None

        return {Op.SPARSE_PIPELINE: Capability(
            devices=("cuda",), refusal=refusal, rules=(stages,), empty_requests=False,
            notes="DeepGEMM fp8_paged_mqa_logits -> torch top-k -> FlashMLA sparse decode")}

    def run(self, case: Case, inputs: Any) -> Output:
        from mlacheck.backends import torch_pipeline as tp

        idx = inputs.indexer
        res = self.deepgemm.run(case.indexer_case(), idx)  # type: ignore[union-attr]
        local = tp.topk_local(res.out, idx.row_visible, case.topk)  # type: ignore[union-attr]
        twin = inputs.attention_with(local)
        out = self.flashmla.run(case.attention_case(), twin)  # type: ignore[union-attr]
        out.extra["slots"] = tp.global_slots(inputs, local)
        out.metadata["deepgemm"] = res.metadata.get("deepgemm", {})
        out.metadata["topk"] = "torch.topk over DeepGEMM's logits"
        return out


def pipeline_factory() -> DeepGemmFlashMLAPipeline:
    return DeepGemmFlashMLAPipeline()
