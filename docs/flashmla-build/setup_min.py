"""mlacheck's sm_90-only FlashMLA build: dense decode + V3.2 sparse FP8 decode (docs/flashmla.md)."""
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

here = Path(__file__).parent
nvcc = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
        "--ptxas-options=--register-usage-level=10", "-lineinfo",
        "-gencode", "arch=compute_90a,code=sm_90a", "--threads", "4"]
setup(
    name="flash_mla", version="1.0.0+9241ae3.mlacheck-sm90",
    packages=["flash_mla"],
    ext_modules=[CUDAExtension(
        name="flash_mla.cuda",
        sources=["csrc/api/api_min.cpp", "csrc/stubs.cu",
                 "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
                 "csrc/smxx/decode/combine/combine.cu",
                 "csrc/sm90/decode/dense/instantiations/fp16.cu",
                 "csrc/sm90/decode/dense/instantiations/bf16.cu",
                 "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
                 "csrc/sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu"],
        extra_compile_args={"cxx": ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"],
                            "nvcc": nvcc},
        include_dirs=[here / "csrc", here / "csrc/kerutils/include", here / "csrc/sm90",
                      here / "csrc/cutlass/include", here / "csrc/cutlass/tools/util/include",
                      "/usr/local/cuda/include/cccl"])],
    cmdclass={"build_ext": BuildExtension},
)
