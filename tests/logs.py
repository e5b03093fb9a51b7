"""What the library logs, as a test sees it.

The library says things through ``logging`` (llmtrain.log), not on stderr: a test reads
them here, from a handler of its own on the ``llmtrain`` logger, which sees them whatever
else is installed (pytest's handlers on the root logger, or the CLI's, which an earlier
test's ``cli.main`` left behind and which stops them from reaching the root)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _Said(logging.Handler):
    def __init__(self, said: list[str]):
        super().__init__(logging.DEBUG)
        self.said = said

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


@contextlib.contextmanager
def logged(level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages the ``llmtrain`` loggers log at ``level`` or above meanwhile, each as
    the CLI prints it (one string a message, filled in as they come)."""
    logger, said = logging.getLogger("llmtrain"), []
    handler, before = _Said(said), logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
