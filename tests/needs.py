"""What a test needs from outside Python (FUSE, Slurm, Prometheus, shellcheck...).

Without it a test skips on a developer's machine, but fails under ``CI=true``: .ci/run
installs everything, so something missing there is a broken set-up, not a pass."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: .ci/run sets this up, so it must work here)",
                    pytrace=False)
    pytest.skip(reason)


def tool(name: str, install: str) -> str:
    """The path of executable ``name``; ``install`` says how to get it."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not installed ({install})")
    return path


def netns() -> None:
    """Network namespaces for "nodes" with links of their own (root, iproute2)."""
    from llmtrain.chaos.netns import available
    reason = available()
    if reason is not None:
        unavailable(reason)
