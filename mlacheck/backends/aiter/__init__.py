"""AITER (AMD's MLA kernels) behind mlacheck's backend contract.

    api.py         the functions called and their keywords, the pinned environment, the
                   import of real `aiter` or mlacheck's model with signatures checked
    capability.py  what the kernels accept: head padding, head folding, page sizes
    rules.py       AITER's head / tiling rules, shared with the model and the validator
    metadata.py    validators of the persistent schedules AITER fills
    adapter.py     the adapter and the backend factories

Importing this package never imports aiter: that happens on the first `unavailable()`,
`capabilities()` or `run()` call. The torch model of AITER's API is
mlacheck.backends.aiter_model. Nothing here has been run on ROCm hardware (docs/aiter.md).
"""

from mlacheck.backends.aiter.adapter import (
    AiterAdapter,
    DecodeSchedule,
    MetadataBuffers,
    factory,
    folded_kv_offsets_wrong,
    model_factory,
    model_gfx942_factory,
    model_gfx950_factory,
    model_nonpersistent_factory,
    nonpersistent_factory,
    validate_persistent_metadata,
)
from mlacheck.backends.aiter.api import (
    MODEL_MODULE,
    REAL_MODULE,
    TARGET_COMMIT,
    AdapterError,
    AiterApi,
    load_api,
)
from mlacheck.backends.aiter.capability import HeadPadding, head_padding

__all__ = [
    "MODEL_MODULE", "REAL_MODULE", "TARGET_COMMIT", "AdapterError", "AiterAdapter", "AiterApi",
    "DecodeSchedule", "HeadPadding", "MetadataBuffers", "factory", "folded_kv_offsets_wrong",
    "head_padding", "load_api", "model_factory", "model_gfx942_factory", "model_gfx950_factory",
    "model_nonpersistent_factory", "nonpersistent_factory", "validate_persistent_metadata",
]
