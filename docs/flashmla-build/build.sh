#!/bin/bash
# Build FlashMLA's sm_90 dense decode + V3.2 sparse FP8 decode into the site dir $1
# (docs/flashmla.md "Install"). Needs, in $SRC (default: .dev/fmla of the checkout):
#   flashmla-src.tar.xz   git archive --prefix=FlashMLA/ of deepseek-ai/FlashMLA 9241ae3:
#                         csrc/{api,smxx,sm90,sm100/decode,sm100/prefill/sparse/fwd_for_small_topk,
#                         sm100/helpers.h,kerutils,defines.h,params.h,utils.h} flash_mla setup.py
#   cutlass-inc.tar.xz    git archive --prefix=FlashMLA/csrc/cutlass/ of NVIDIA/cutlass 147f5673:
#                         include tools/util/include
# Third-party source travels in .dev/ (ignored), never in this repository.
set -e
site=$1; work=/tmp/fmla-build
here=$(dirname "$(readlink -f "$0")")
SRC=${SRC:-$here/../../.dev/fmla}
rm -rf $work && mkdir -p $work && cd $work
xz -dc "$SRC/flashmla-src.tar.xz" | tar -x
xz -dc "$SRC/cutlass-inc.tar.xz" | tar -x
cd FlashMLA
# mlacheck's two source files, written here (no FlashMLA file is kept in this repository):
# a binding of the two decode entry points only, and the kernels this build leaves out
cat > csrc/api/api_min.cpp <<'CPP'
// mlacheck's reduced FlashMLA binding for sm_90: dense decode + sparse FP8 decode only.
#include <pybind11/pybind11.h>

#include "sparse_decode.h"
#include "dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA (sm_90 dense + sparse FP8 decode only; built by mlacheck's recipe)";
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
CPP
cat > csrc/stubs.cu <<'CU'
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
CU
cp "$here/setup_min.py" setup_min.py
export MAX_JOBS=${MAX_JOBS:-8} TORCH_CUDA_ARCH_LIST=9.0a CUDA_HOME=/usr/local/cuda
t0=$(date +%s)
python3 setup_min.py build_ext --inplace > $work/build.log 2>&1 || { tail -60 $work/build.log; exit 1; }
echo "flashmla build: $(( $(date +%s) - t0 )) s"
mkdir -p "$site" && cp -r flash_mla "$site/"
ls -la "$site/flash_mla"
