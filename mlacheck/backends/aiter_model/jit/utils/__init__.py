"""Model of `aiter.jit.utils`: only `chip_info` is modelled."""
