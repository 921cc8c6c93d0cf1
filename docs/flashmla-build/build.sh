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
cp "$here/api_min.cpp" csrc/api/api_min.cpp
cp "$here/stubs.cu" csrc/stubs.cu
cp "$here/setup_min.py" setup_min.py
export MAX_JOBS=${MAX_JOBS:-8} TORCH_CUDA_ARCH_LIST=9.0a CUDA_HOME=/usr/local/cuda
t0=$(date +%s)
python3 setup_min.py build_ext --inplace > $work/build.log 2>&1 || { tail -60 $work/build.log; exit 1; }
echo "flashmla build: $(( $(date +%s) - t0 )) s"
mkdir -p "$site" && cp -r flash_mla "$site/"
ls -la "$site/flash_mla"
