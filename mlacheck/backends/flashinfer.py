"""`flashinfer` / `flashinfer-fa3`: FlashInfer's MLA kernels on NVIDIA GPUs.

- mla_decode: `flashinfer.mla.BatchMLAPagedAttentionWrapper` (absorbed MLA: q_nope 512 +
  q_pe 64 against a paged latent cache ckv 512 + kpe 64), its fa2 path (`flashinfer`) or its
  sm_90 fa3 path (`flashinfer-fa3`). mlacheck's latent pool [pages, page_size, 1, 576] is
  handed over as two strided views (ckv = channels 0..511, kpe = 512..575): FlashInfer reads
  the page and token strides of each cache tensor, so nothing is copied. The page table is
  FlashInfer's own convention (kv_indptr / kv_indices / kv_len_arr). MTP (q_len > 1) rows
  come through qo_indptr with causal=True.
- mla_prefill: `flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper` (MHA view, q/k 192,
  v 128, ragged cu_seqlens), causal or not, soft cap as `logits_soft_cap`.

FlashInfer returns the LSE in base 2 (log2 of the sum of exp): converted to the natural log
here (x ln 2). The softmax scale is always passed. Every installed function is checked
against the keywords passed (toolkit.signature_problem) before first use, and the library
version goes into every Output's metadata. Capabilities are what was measured on an H100
(docs/flashinfer.md); what a kernel does not take is a SKIP naming it.
"""

from __future__ import annotations

import torch

from mlacheck import layouts
from mlacheck.backends.base import Capability, Output
from mlacheck.backends.toolkit import (
    LibraryAdapter,
    Loaded,
    cuda_refusal,
    load_library,
    lse_natural,
    lse_tokens_heads,
)
from mlacheck.inputs import DecodeInputs, Inputs, PrefillInputs
from mlacheck.spec import Case, DecodeCase, PrefillCase

MODULE = "flashinfer"
DISTRIBUTIONS = ("flashinfer-python", "flashinfer")
INSTALL_HINT = "pip install flashinfer-python (docs/flashinfer.md)"
# FlashInfer computes the LSE as log2(sum 2^(s * log2 e)): base 2.
LSE_BASE = 2.0
# The split-k workspace FlashInfer's examples allocate.
WORKSPACE_BYTES = 128 << 20

# The keyword parameters this adapter passes to each installed function.
CALLED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "mla.BatchMLAPagedAttentionWrapper": ("float_workspace_buffer", "use_cuda_graph", "backend"),
    "mla.BatchMLAPagedAttentionWrapper.plan": (
        "qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv",
        "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type"),
    "mla.BatchMLAPagedAttentionWrapper.run": (
        "q_nope", "q_pe", "ckv_cache", "kpe_cache", "out", "return_lse"),
    "prefill.BatchPrefillWithRaggedKVCacheWrapper": (
        "float_workspace_buffer", "kv_layout", "backend"),
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.plan": (
        "qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo",
        "causal", "logits_soft_cap", "sm_scale", "q_data_type", "kv_data_type"),
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.run": ("q", "k", "v", "out", "return_lse"),
}
OP_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "mla_decode": tuple(k for k in CALLED_PARAMETERS if k.startswith("mla.")),
    "mla_prefill": tuple(k for k in CALLED_PARAMETERS if k.startswith("prefill.")),
}

# Measured on an H100 with flashinfer-python 0.2.14.post1 (benchmarks/capability_probe.py,
# docs/flashinfer.md): every page size 1..1024, 8..128 heads, MTP (uniform or mixed q_len),
# empty requests / segments, pools past 2^32 bytes, soft cap, pass; FP8 does not build
# (MLA decode: the fa2 JIT fails to compile an fp8 kv variant; ragged prefill: "fp8 tensor
# core is not supported in fa2 backend").
DECODE_FORMATS = ("bf16", "fp16")
PREFILL_FORMATS = ("bf16", "fp16")


def load() -> Loaded | str:
    """Import FlashInfer and check the installed signatures; a one-line reason otherwise."""
    return load_library(MODULE, distributions=DISTRIBUTIONS, install_hint=INSTALL_HINT,
                        called=CALLED_PARAMETERS, submodules=("mla", "prefill"))


class FlashInferBackend(LibraryAdapter):
    """FlashInfer MLA decode + ragged prefill behind the backend contract."""

    def __init__(self, kernel: str = "fa2", name: str = "flashinfer") -> None:
        self.kernel = kernel  # FlashInfer's `backend` argument: fa2 or fa3
        self.name = name
        self._workspace: torch.Tensor | None = None

    def import_library(self) -> Loaded | str:
        return load()

    def machine_refusal(self) -> str | None:
        return cuda_refusal("FlashInfer", 9 if self.kernel == "fa3" else None,
                            "the fa3 kernels need an sm_90 GPU (H100/H200)")

    # -- contract
    def capabilities(self) -> dict[str, Capability]:
        got = self.loaded()
        if isinstance(got, str):
            return {op: Capability(refusal=got) for op in OP_FUNCTIONS}
        same = lambda fmts: frozenset((f, f) for f in fmts)  # noqa: E731
        return {
            "mla_decode": Capability(
                q_formats=DECODE_FORMATS, kv_formats=DECODE_FORMATS,
                format_pairs=same(DECODE_FORMATS), causal=(True,), lse=True,
                layouts=(layouts.LINEAR.name,),  # ckv / kpe are strided views of linear pages
                empty_requests=True, devices=("cuda",), refusal=got.first_problem(OP_FUNCTIONS["mla_decode"]),
                notes=f"BatchMLAPagedAttentionWrapper backend={self.kernel}; latent cache as "
                      "strided ckv/kpe views of mlacheck's pool; LSE base 2 -> natural"),
            "mla_prefill": Capability(
                q_formats=PREFILL_FORMATS, kv_formats=PREFILL_FORMATS,
                format_pairs=same(PREFILL_FORMATS), soft_cap=True, lse=True,
                empty_requests=True, devices=("cuda",), refusal=got.first_problem(OP_FUNCTIONS["mla_prefill"]),
                notes=f"BatchPrefillWithRaggedKVCacheWrapper backend={self.kernel}, q/k 192, "
                      "v 128; LSE base 2 -> natural"),
        }

    def run(self, case: Case, inputs: Inputs) -> Output:
        got = self.loaded()
        if isinstance(got, str):
            raise RuntimeError(got)
        if isinstance(case, PrefillCase):
            assert isinstance(inputs, PrefillInputs)
            out = self._prefill(got, case, inputs)
        else:
            assert isinstance(inputs, DecodeInputs) and isinstance(case, DecodeCase)
            out = self._decode(got, case, inputs)
        out.metadata["flashinfer"] = {"version": got.version, "kernel": self.kernel}
        return out

    # -- internals
    def _workspace_on(self, device: torch.device) -> torch.Tensor:
        if self._workspace is None or self._workspace.device != device:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return self._workspace

    def _decode(self, got: Loaded, case: DecodeCase, inputs: DecodeInputs) -> Output:
        dev = inputs.device
        rank = case.dims.kv_lora_rank
        wrapper = got.function("mla.BatchMLAPagedAttentionWrapper")(
            float_workspace_buffer=self._workspace_on(dev), use_cuda_graph=False,
            backend=self.kernel)
        kv_indptr, kv_indices, kv_lens = inputs.table.to_flashinfer()
        q = inputs.q.stored
        cache = inputs.pool.data[:, :, 0, :]  # [pages, page_size, 576]: views, no copy
        wrapper.plan(
            qo_indptr=inputs.qo_indptr.to(dev, torch.int32), kv_indptr=kv_indptr.to(dev),
            kv_indices=kv_indices.to(dev), kv_len_arr=kv_lens.to(dev),
            num_heads=case.num_heads, head_dim_ckv=rank, head_dim_kpe=case.dims.qk_rope,
            page_size=case.page_size, causal=True, sm_scale=case.softmax_scale,
            q_data_type=q.dtype, kv_data_type=cache.dtype)
        out, lse = wrapper.run(q_nope=q[..., :rank], q_pe=q[..., rank:],
                               ckv_cache=cache[..., :rank], kpe_cache=cache[..., rank:],
                               out=inputs.out.out, return_lse=True)
        lse = lse_tokens_heads(lse_natural(lse, LSE_BASE), case.total_q, case.num_heads)
        return Output(out, lse, wrote_into_guarded=out.data_ptr() == inputs.out.out.data_ptr())

    def _prefill(self, got: Loaded, case: PrefillCase, inputs: PrefillInputs) -> Output:
        dev = inputs.device
        d = case.dims
        wrapper = got.function("prefill.BatchPrefillWithRaggedKVCacheWrapper")(
            float_workspace_buffer=self._workspace_on(dev), kv_layout="NHD", backend=self.kernel)
        q, k, v = inputs.q.stored, inputs.k.stored, inputs.v.stored
        wrapper.plan(
            qo_indptr=inputs.cu_seqlens_q.to(dev, torch.int32),
            kv_indptr=inputs.cu_seqlens_k.to(dev, torch.int32),
            num_qo_heads=case.num_heads, num_kv_heads=case.num_heads, head_dim_qk=d.qk_head,
            head_dim_vo=d.v_head, causal=case.causal,
            logits_soft_cap=case.soft_cap if case.soft_cap > 0 else None,
            sm_scale=case.softmax_scale, q_data_type=q.dtype, kv_data_type=k.dtype)
        out, lse = wrapper.run(q=q, k=k, v=v, out=inputs.out.out, return_lse=True)
        lse = lse_tokens_heads(lse_natural(lse, LSE_BASE), case.total_q, case.num_heads)
        return Output(out, lse if case.return_lse else None,
                      wrote_into_guarded=out.data_ptr() == inputs.out.out.data_ptr())


def factory() -> FlashInferBackend:
    return FlashInferBackend("fa2", "flashinfer")


def fa3_factory() -> FlashInferBackend:
    return FlashInferBackend("fa3", "flashinfer-fa3")
