"""Where the run's time went, for whoever watches it: rank 0 reads the run's event log as
it grows (every attempt's spans, across restarts), sums it into goodput and badput by
cause for Prometheus, and suggests the checkpoint interval the measured costs call for;
at the run's end it also records the account as the ``goodput`` event."""

from __future__ import annotations

import time
from collections.abc import Callable

from llmtrain.events import EventLog, EventTail
from llmtrain.metrics import goodput
from llmtrain.metrics.goodput import IntervalAdvice
from llmtrain.metrics.prometheus import MetricsExport


class GoodputAccount:
    """Rank 0's goodput account, fed from the event log in ``run_dir``. ``before_read``
    is called before each read of the log (which may take long: the caller's watchdog
    should expect it); ``every_s``: the least time between two accounts during the run;
    ``assumed_mtbf_s``: the mean time between failures the advice assumes before the run
    has seen any (0: none assumed)."""

    def __init__(self, run_dir: str, events: EventLog, exporter: MetricsExport, *,
                 every_s: float, assumed_mtbf_s: float, before_read: Callable[[], None]):
        self.events, self.exporter = events, exporter
        self.every_s, self.assumed_mtbf_s = every_s, assumed_mtbf_s
        self.before_read = before_read
        self._tail = EventTail(run_dir, keep=goodput.INPUTS)
        self._read: list[dict] = []
        self._at = 0.0

    def due(self) -> bool:
        """Whether ``metrics.goodput_every_s`` has passed since the last account."""
        return time.monotonic() - self._at >= self.every_s

    def events_so_far(self) -> list[dict]:
        """The log's events an account reads, up to now."""
        self.before_read()
        self._read += self._tail.read()
        return self._read

    def account(self, final: bool = False) -> IntervalAdvice | None:
        """The account so far, to Prometheus; the checkpoint interval it suggests (None:
        not enough measured yet). ``final``: also as the run's ``goodput`` event."""
        self._at = time.monotonic()
        b = goodput.account(self.events_so_far(), now=time.time())
        advice = goodput.advise(b, self.assumed_mtbf_s)
        self.exporter.goodput(b, advice)
        if final:
            self.events.emit("goodput", **b.as_dict(),
                             optimal_interval_s=advice and advice.optimal_interval_s,
                             expected_ettr=advice and advice.expected_ettr,
                             mtbf_s=advice and advice.mtbf_s)
        return advice
