"""Model of the `aiter.ops` namespace: only the submodules the adapter reaches by path."""
