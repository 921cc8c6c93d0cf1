"""e2e unit tests run single-threaded: their tensors are tiny, and extra intra-op threads only
add synchronisation (several times slower on shared CI cores)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
