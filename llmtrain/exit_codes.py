"""How a run ends, as the launcher must read it.

=====  ===============  ==================================================================
code   name             what the launcher does
=====  ===============  ==================================================================
0      CLEAN            nothing: the run finished
75     RETRYABLE        restart the workers, on the same nodes or on a spare
76     EXCLUDE_NODE     take this node out of the job, then restart on the others/spares
78     FATAL            stop: bad configuration or data; a restart would fail the same way
=====  ===============  ==================================================================

75 and 78 are the BSD sysexits EX_TEMPFAIL and EX_CONFIG. Any other non-zero code (an
uncaught exception gives 1, a signal gives 128+N) counts as RETRYABLE.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    CLEAN = 0
    RETRYABLE = 75
    EXCLUDE_NODE = 76
    FATAL = 78


class FatalError(Exception):
    """An error a restart would repeat (bad data, a diverging run): the command exits
    FATAL and prints ``what`` before the message. Defined here, with the codes, so the
    command line catches it without importing torch."""
    what = ""
