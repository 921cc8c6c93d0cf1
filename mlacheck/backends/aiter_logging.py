"""AITER's logger set up the way AITER sets it up, before `import aiter` does.

AITER's package `__init__` configures its "aiter" logger on import (aiter/__init__.py
`getLogger`) only when the logger has no handler yet, and that configuration reads
`torch._dynamo.config` to tell torch.compile to ignore AITER's logging calls. Touching
`torch._dynamo` imports it: 4.3 s in one process on the 4x H200 host, 6.5 s in each of 32
processes starting at once (`bash .dev/lead/startup.sh`, 2026-11-27) -- the largest part of
every worker's first AITER item, and mlacheck never compiles AITER's code. Installing the
same handler first (level from AITER_LOG_LEVEL, AITER's format, AITER_LOG_MORE's longer one)
keeps AITER's log lines as AITER prints them and leaves torch._dynamo unimported. A logger
that already has a handler (the user configured it) is left alone, as AITER leaves it.
"""

from __future__ import annotations

import logging
import os

AITER_LOGGER = "aiter"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # AITER's valid AITER_LOG_LEVEL values
_FORMAT = "[%(name)s] %(message)s"
_FORMAT_MORE = ("[%(name)s %(levelname)s] %(asctime)s.%(msecs)03d - %(processName)s:%(process)d"
                " - %(pathname)s:%(lineno)d - %(funcName)s\n%(message)s")


def configure_aiter_logger() -> logging.Logger:
    """AITER's logger with AITER's handler, unless it already has one."""
    logger = logging.getLogger(AITER_LOGGER)
    if logger.handlers:
        return logger
    level = os.getenv("AITER_LOG_LEVEL", "INFO").upper()
    level = level if level in _LEVELS else "INFO"  # AITER warns and takes INFO
    logger.setLevel(getattr(logging, level))
    handler = logging.StreamHandler()
    more = os.environ.get("AITER_LOG_MORE", "0").strip() not in ("", "0")
    handler.setFormatter(logging.Formatter(fmt=_FORMAT_MORE if more else _FORMAT,
                                           datefmt="%Y-%m-%d %H:%M:%S" if more else None))
    handler.setLevel(getattr(logging, level))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
