"""Model of `aiter.ops.triton`: the DeepSeek-V3.2 indexer kernels (attention/)."""
