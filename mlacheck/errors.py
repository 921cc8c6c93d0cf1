"""Bad input as the command line reports it: one line on stderr and exit code 2.

Every `mlacheck` command raises UsageError for what the user got wrong (README "Exit codes",
code 2) and parses its arguments with OneLineParser, so an argparse mistake is the same one
line as any other bad input instead of a usage block.
"""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageError (the caller prints one line)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)
