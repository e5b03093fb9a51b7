"""The library's messages go through :mod:`logging`, never ``print``: every module logs to
``logging.getLogger(__name__)`` (``llmtrain.<module>``), so a program that uses llmtrain
as a library sees them in its own handlers, and no module installs a handler.

A process of llmtrain's own (the ``llmtrain`` command, torchrun's agent, the chaos harness's
filesystem) calls :func:`log_to_stderr` once at its start: each message then goes to stderr
as it is, one line a message, as the library printed it before. A command's output (a
table, JSON, a path) is no log message: the command prints it on stdout.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "llmtrain"


class _Stderr(logging.StreamHandler):
    """A StreamHandler on ``sys.stderr`` as it is at each message, not as it was when the
    handler was made: a redirect made later (a test's capture) sees the messages too."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def log_to_stderr(level: int = logging.INFO) -> logging.Handler:
    """Prints the ``llmtrain`` logger's messages (``level`` and above) on stderr, bare
    (``%(message)s``), and stops them from reaching the root logger's handlers as well: for a
    process entry point of llmtrain only. Calling it again changes nothing."""
    logger = logging.getLogger(LOGGER)
    handler = next((h for h in logger.handlers if isinstance(h, _Stderr)), None)
    if handler is None:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    handler.setLevel(level)
    logger.setLevel(level)
    logger.propagate = False
    return handler
