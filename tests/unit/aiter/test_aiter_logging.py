"""AITER's logger is set up before `import aiter`, so the import leaves torch._dynamo alone."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from mlacheck.backends.aiter_logging import AITER_LOGGER, configure_aiter_logger

# What aiter/__init__.py `getLogger` does at import (ROCm/aiter e4048607a): configure the
# logger only when it has no handler, reading torch._dynamo.config while doing so.
_AITER_LIKE_INIT = textwrap.dedent("""
    import logging
    import torch
    logger = logging.getLogger("aiter")
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler())
        torch._dynamo.config  # aiter: hasattr(torch._dynamo.config, "ignore_logger_methods")
""")


def _dynamo_imported(tmp_path, through_adapter: bool) -> bool:
    (tmp_path / "aiterlike").mkdir()
    (tmp_path / "aiterlike" / "__init__.py").write_text(_AITER_LIKE_INIT)
    load = ("from mlacheck.backends.aiter import api; api.load_api('aiterlike')"
            if through_adapter else "import aiterlike")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); {load}; " \
           "print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("through_adapter", [False, True])
def test_the_adapter_imports_aiter_without_torch_dynamo(tmp_path, through_adapter):
    # imported bare, the AITER-like package pulls in torch._dynamo (the cost measured on the
    # GPU host); through the adapter's import it does not
    assert _dynamo_imported(tmp_path, through_adapter) is not through_adapter


@pytest.fixture
def fresh_aiter_logger():
    logger = logging.getLogger(AITER_LOGGER)
    saved = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers.clear()
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


def test_it_prints_as_aiter_does(fresh_aiter_logger, monkeypatch):
    monkeypatch.setenv("AITER_LOG_LEVEL", "warning")
    monkeypatch.delenv("AITER_LOG_MORE", raising=False)
    logger = configure_aiter_logger()
    (handler,) = logger.handlers
    assert logger.level == logging.WARNING and not logger.propagate
    record = logging.LogRecord("aiter", logging.WARNING, "f.py", 1, "hello", None, None)
    assert handler.format(record) == "[aiter] hello"


def test_an_unknown_level_is_info_as_in_aiter(fresh_aiter_logger, monkeypatch):
    monkeypatch.setenv("AITER_LOG_LEVEL", "chatty")
    assert configure_aiter_logger().level == logging.INFO


def test_a_configured_logger_is_left_alone(fresh_aiter_logger):
    mine = logging.NullHandler()
    fresh_aiter_logger.addHandler(mine)
    assert configure_aiter_logger().handlers == [mine]
