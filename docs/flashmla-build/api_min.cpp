// mlacheck's reduced FlashMLA binding for sm_90: dense decode + sparse FP8 decode only.
#include <pybind11/pybind11.h>

#include "sparse_decode.h"
#include "dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA (sm_90 dense + sparse FP8 decode only; built by mlacheck's recipe)";
    m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
