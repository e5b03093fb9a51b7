"""How the report writes times, durations and tables: shared by its page, its incidents and
its figures."""

from __future__ import annotations

import html
import time


def duration(seconds: float) -> str:
    """``seconds`` as a person reads it: 0.9 s, 4m07s, 2h05m."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def utc(ts: float) -> str:
    """A timestamp as UTC date and time, to the second."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def table(head: tuple[str, ...], rows: list[str]) -> str:
    """An HTML table of ``rows`` (each a ready ``<tr>``) under the column names ``head``."""
    return ("<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead>\n"
            "<tbody>\n" + "\n".join(rows) + "\n</tbody></table>")


def cells(values: list[str], cls: str | None = None, wrap_last: bool = False) -> str:
    """One table row of ``values``, each escaped (the last one may wrap)."""
    tds = [f"<td>{html.escape(v)}</td>" for v in values]
    if wrap_last and tds:
        tds[-1] = f"<td class=wrap>{html.escape(values[-1])}</td>"
    return (f"<tr class={cls}>" if cls else "<tr>") + "".join(tds) + "</tr>"
