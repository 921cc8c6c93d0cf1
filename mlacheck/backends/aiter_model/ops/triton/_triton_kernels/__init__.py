"""Model of `aiter.ops.triton._triton_kernels`: only the kernels an adapter launches itself."""
