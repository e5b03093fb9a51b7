"""How llmtrain's process groups describe themselves (``group_desc``), as the flight
recorder's entries and NCCL's logs name them. Imports nothing: the dumps' analysis
(:mod:`llmtrain.reliability.flightrec`) reads them without torch."""

from __future__ import annotations

# A group whose collectives run off the training thread (snapshot replication, checkpoint
# I/O): a rank's newer collective there is no sign that its training thread went on past
# the collective it waits in.
OFF_THREAD = "off_thread:"


def group_label(group: str, desc: str) -> str:
    """A group's name in a report: its description, or ``pg <name>`` without one."""
    return desc if desc not in ("", "undefined") else f"pg {group}"
