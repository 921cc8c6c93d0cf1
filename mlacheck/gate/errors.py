"""Errors of the accuracy gate."""

from __future__ import annotations


class GateError(Exception):
    """A user-facing failure: bad input, unreachable server, incomparable runs.

    The message is one line; the CLI prints it to stderr and exits with status 2.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))
