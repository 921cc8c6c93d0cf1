"""Model of `aiter.ops.triton`: the DeepSeek-V3.2 indexer kernels (attention/) and
the DeepSeek-V4 positions -> slots kernels (_triton_kernels/attention/)."""
