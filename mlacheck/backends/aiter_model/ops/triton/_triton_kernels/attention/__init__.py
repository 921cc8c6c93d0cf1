"""Model of `aiter.ops.triton._triton_kernels.attention`: sparse_attention_dsv4's conversion
kernels."""
