"""Every kind of event the code can write is documented in docs/run-dir.md: the kinds are
read from the code (each ``emit``/``emit_once`` call whose first argument is a string, or a
choice of two strings), so an event added without its row, or a row removed, fails here."""

from __future__ import annotations

import ast
import re
from collections import defaultdict

from conftest import ROOT

DOC = ROOT / "docs" / "run-dir.md"
# Kinds the code writes through a variable, which the scan cannot read: the watchdog emits
# its verdict's kind (reliability/watchdog.py, ``event["kind"]``).
NOT_LITERAL = {"hang", "collective_error"}


def emitted() -> dict[str, list[str]]:
    """Each event kind written by llmtrain/, with the places (path:line) that write it."""
    kinds: dict[str, list[str]] = defaultdict(list)
    for path in sorted((ROOT / "llmtrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and node.args
                    and getattr(node.func, "attr", getattr(node.func, "id", None))
                    in ("emit", "emit_once")):
                continue
            first = node.args[0]
            choices = [first.body, first.orelse] if isinstance(first, ast.IfExp) else [first]
            for choice in choices:
                if isinstance(choice, ast.Constant) and isinstance(choice.value, str):
                    kinds[choice.value].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return kinds


def documented(page: str) -> set[str]:
    """The kinds in the first column of the Events section's tables."""
    events = page.split("\n## Events\n", 1)[1]
    return set(re.findall(r"^\| `(\w+)` \|", events, re.M))


def test_the_scan_finds_the_code_s_events():
    kinds = emitted()
    assert {"warm_recovery", "warm_grow", "warm_recovery_failed", "warm_path_off",
            "warm_path_unproven", "step", "loss_spike", "step_skipped"} <= kinds.keys()
    assert len(kinds) >= 50


def test_every_event_the_code_writes_is_documented():
    kinds = emitted()
    missing = {k: where for k, where in kinds.items() if k not in documented(DOC.read_text())}
    assert not missing, (f"event kinds written by the code but not in {DOC.name}'s Events "
                         f"tables (add a row each): {missing}")
    assert NOT_LITERAL <= documented(DOC.read_text())


def test_no_documented_event_is_one_the_code_never_writes():
    stale = documented(DOC.read_text()) - emitted().keys() - NOT_LITERAL
    assert not stale, f"{DOC.name} documents events nothing writes any more: {stale}"


def test_a_row_removed_from_the_docs_is_caught():
    page = DOC.read_text()
    without = "\n".join(line for line in page.splitlines()
                        if not line.startswith("| `warm_grow` |"))
    assert "warm_grow" in documented(page) and "warm_grow" not in documented(without)
    assert "warm_grow" in emitted().keys() - documented(without)
