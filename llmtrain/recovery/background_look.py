"""A yes-or-no look at the rendezvous store that never holds up the training thread."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundLook:
    """A yes-or-no look at the store, made on a thread of its own: :meth:`latest` starts
    one when none is under way and returns at once the last answer, if it is no older
    than ``fresh_s`` (else no). A store that stalls holds up the look's thread only, and
    one that errs answers no."""

    def __init__(self, look: Callable[[], bool], fresh_s: float):
        self.look, self.fresh_s = look, fresh_s
        self._answer, self._at = False, -math.inf
        self._thread: threading.Thread | None = None

    def latest(self) -> bool:
        """The last answer, if fresh (else no); starts a look when none is under way."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="llmtrain-store-look")
            self._thread.start()
        return self._answer and time.monotonic() - self._at <= self.fresh_s

    def _run(self) -> None:
        try:
            answer = bool(self.look())
        except (RuntimeError, OSError) as e:  # DistError: the store is out
            log.debug("a look at the rendezvous store failed: %s", e)
            answer = False
        self._answer, self._at = answer, time.monotonic()
