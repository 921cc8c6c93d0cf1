"""Model of `aiter.jit`: only `jit.utils.chip_info` is modelled."""
