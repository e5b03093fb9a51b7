"""Reading ``llmtrain report``'s page in tests: a section's HTML, and the Incidents rows
of one kind of incident."""

import re


def section(page: str, heading_id: str) -> str:
    """The HTML between the ``<h2>`` of ``heading_id`` and the next ``<h2>``."""
    return page.split(f"<h2 id={heading_id}>", 1)[1].split("<h2", 1)[0]


def rows(incidents: str, event: str) -> list[str]:
    """The Incidents rows of ``event`` (as the table names it: "warm shrink"...)."""
    return re.findall(rf"<tr class=\w+><td>[^<]*</td><td>[^<]*</td><td>{event}</td>.*?</tr>",
                      incidents)


def row(incidents: str, event: str) -> str:
    """The one Incidents row of ``event``."""
    (found,) = rows(incidents, event)
    return found
