"""What a test needs from outside (FUSE, Slurm, Prometheus, shellcheck, transformers...).

Without it a test skips on a developer's machine, but fails under ``CI=true``: .ci/run
installs everything, so something missing there is a broken set-up, not a pass. The
same holds for any skip (a pytest plugin, registered by tests/conftest.py): under
``CI=true`` a test that skips fails, unless it declared up front when it may skip, with
a ``skip`` or ``skipif`` mark and its reason (the GPU tests on a machine without one, a
run that is opt-in by an environment variable)."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
IN_CI_NOTE = "CI=true: .ci/run sets this up, so it must work here"


def unavailable(reason: str) -> NoReturn:
    """Skips the test for want of ``reason`` (a failure under ``CI=true``)."""
    pytest.skip(reason)


def tool(name: str, install: str) -> str:
    """The path of executable ``name``; ``install`` says how to get it."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not installed ({install})")
    return path


def module(name: str, install: str) -> ModuleType:
    """Python module ``name``, imported; ``install`` says how to get it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        unavailable(f"{name} cannot be imported ({e}): {install}")


def netns() -> None:
    """Network namespaces for "nodes" with links of their own (root, iproute2)."""
    from llmtrain.chaos.netns import available
    reason = available()
    if reason is not None:
        unavailable(reason)


def _skipped_by_mark(item: pytest.Item) -> bool:
    """Whether a mark of the item skips it: ``skip``, or ``skipif`` with a true condition
    (a boolean; pytest's string conditions are not declarations here)."""
    for mark in item.iter_markers():
        if mark.name == "skip":
            return True
        if mark.name == "skipif":
            conditions = mark.args or ((mark.kwargs["condition"],)
                                       if "condition" in mark.kwargs else ())
            if any(c and not isinstance(c, str) for c in conditions):
                return True
    return False


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Under ``CI=true``, a skip that no mark of the test makes is a failure (a test a
    mark skips skips before its fixtures and its body run, so whatever skipped it then
    was the mark)."""
    report = yield
    if IN_CI and report.skipped and not hasattr(report, "wasxfail") \
            and not _skipped_by_mark(item):
        report.outcome = "failed"
        report.longrepr = f"{_skip_reason(report)} ({IN_CI_NOTE}; no skip mark declares it)"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    """Under ``CI=true``, a module that skips as it is collected is a failure."""
    report = yield
    if IN_CI and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"{_skip_reason(report)} ({IN_CI_NOTE})"
    return report
