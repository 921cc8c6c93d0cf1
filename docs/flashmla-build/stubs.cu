// Kernels this sm_90 build leaves out: calling one is an error, never a silent no-op.
#include <c10/util/Exception.h>
#include "params.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"

namespace sm90::decode::sparse_fp8 {
template<ModelType M, int H>
void run_flash_splitkv_mla_fp8_sparse_kernel(const SparseAttnDecodeParams &) {
    TORCH_CHECK(false, "FlashMLA MODEL1 sparse decode is not built (mlacheck sm_90 recipe)");
}
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 64>(const SparseAttnDecodeParams &);
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 128>(const SparseAttnDecodeParams &);
}
namespace sm100::decode::head64 {
template<ModelType M>
void run_flash_splitkv_mla_fp8_sparse_kernel(const SparseAttnDecodeParams &) {
    TORCH_CHECK(false, "FlashMLA sm_100 kernels are not built");
}
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams &);
template void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams &);
}
namespace sm100::fwd_for_small_topk::head128 {
template<SparseAttnFwdMode FWD_MODE, int D_QK>
void run_fwd_for_small_topk_phase1_kernel(const SparseFwdArgT<FWD_MODE>&) {
    TORCH_CHECK(false, "FlashMLA sm_100 kernels are not built");
}
template void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(const SparseFwdArgT<SparseAttnFwdMode::DecodeWithSplitKV>&);
}
