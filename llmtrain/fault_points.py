"""Where injected faults may strike: the product's one tie to the fault harness.

Training calls ``point(name, step)`` at its fault points (the start of a step, inside a
checkpoint shard write). That does nothing unless the run asks for faults
(``reliability.faults``, ``$LLMTRAIN_FAULTS`` or ``$LLMTRAIN_FAULTS_FILE``): only then is the
harness (``llmtrain.chaos.faults``, which documents the spec) loaded and armed, so a
production run never imports it.
"""

from __future__ import annotations

import importlib
import os

from llmtrain.config import ConfigError

HARNESS = "llmtrain.chaos.faults"
_injector = None


def install(spec: str, rank: int) -> None:
    """Arms the faults of ``spec`` and of the environment for this process, if any."""
    global _injector
    _injector = None
    if not (spec or os.environ.get("LLMTRAIN_FAULTS") or os.environ.get("LLMTRAIN_FAULTS_FILE")):
        return
    try:
        harness = importlib.import_module(HARNESS)
    except ImportError as e:
        raise ConfigError(f"reliability.faults (or $LLMTRAIN_FAULTS) asks for injected faults, "
                          f"but the fault harness does not load ({e}); install "
                          f"llmtrain[chaos]") from None
    _injector = harness.Injector(spec, rank)


def point(name: str, step: int, target=None):
    """Called where a fault may strike; does nothing unless a run armed one here. Returns
    ``target`` (a tensor or module the fault may corrupt), or what replaced it."""
    if _injector is not None:
        return _injector.point(name, step, target)
    return target
