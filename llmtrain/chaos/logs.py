"""The chaos nodes' logs (``<workdir>/<node>.log``: each node's launcher, agent and
workers): how far each has been written, and the Python tracebacks printed between two
such marks."""

from __future__ import annotations

import contextlib
from pathlib import Path


def log_sizes(workdir: Path, names: list[str]) -> dict[str, int]:
    """How far each node's log has been written (a mark; a log not there yet is left out)."""
    sizes = {}
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            sizes[name] = (workdir / f"{name}.log").stat().st_size
    return sizes


def _text(path: Path, start: int, end: int | None) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(-1 if end is None else max(0, end - start)).decode(errors="replace")
    except FileNotFoundError:
        return None


def tracebacks(workdir: Path, names: list[str], since: dict[str, int],
               until: dict[str, int] | None) -> list[str]:
    """``node: Exception: message`` for each Python traceback printed in a node's log
    between the two marks (``until`` None: to the end)."""
    found = []
    for name in names:
        # (a log not there yet at a mark had nothing written by then)
        end = None if until is None else until.get(name, 0)
        text = _text(workdir / f"{name}.log", since.get(name, 0), end)
        if text is None:
            continue
        lines = text.splitlines()
        for i, line in enumerate(lines):
            at = line.find("Traceback (most recent call last)")
            if at < 0:
                continue
            prefix = line[:at]  # torchrun's per-rank prefix, if any
            last = next((rest for rest in (ln[len(prefix):] if ln.startswith(prefix)
                                           else ln for ln in lines[i + 1:i + 400])
                         if rest and not rest[0].isspace()), "?")
            kind, colon, message = last.strip().partition(":")  # the class, unqualified
            found.append(f"{name}: {kind.rpartition('.')[2]}{colon}{message}"[:120])
    return found
