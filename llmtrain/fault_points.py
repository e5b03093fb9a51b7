"""Where injected faults may strike: the product's one tie to the fault harness.

Training calls ``point(name, step)`` at its fault points (the start of a step, inside a
checkpoint shard write). That does nothing unless the run's config asks for faults
(``reliability.faults``): only then is the harness (``llmtrain.chaos.faults``, which
documents the spec) loaded and armed, so a production run never imports it. The
environment (``$LLMTRAIN_FAULTS``, ``$LLMTRAIN_FAULTS_FILE``) is read only when the config
says ``reliability.faults = "env"``: a stray variable never faults a run.
"""

from __future__ import annotations

import importlib
import logging
import os

from llmtrain.config import ConfigError

log = logging.getLogger(__name__)

HARNESS = "llmtrain.chaos.faults"
FROM_ENV = "env"
ENV_VARS = ("LLMTRAIN_FAULTS", "LLMTRAIN_FAULTS_FILE")
_injector = None


def install(spec: str, rank: int) -> None:
    """Arms the faults of ``spec`` for this process, or with ``"env"`` those of the
    environment; warns when the environment names faults that the config does not take."""
    global _injector
    _injector = None
    faults_file = None
    if spec == FROM_ENV:
        spec, faults_file = os.environ.get(ENV_VARS[0], ""), os.environ.get(ENV_VARS[1])
    elif stray := [f"${v}" for v in ENV_VARS if os.environ.get(v)]:
        log.warning(f"llmtrain: warning: ignoring {' and '.join(stray)}: faults are injected "
                    f"from the environment only with reliability.faults = \"{FROM_ENV}\"")
    if not (spec or faults_file):
        return
    try:
        harness = importlib.import_module(HARNESS)
    except ImportError as e:
        raise ConfigError(f"reliability.faults asks for injected faults, but the fault "
                          f"harness does not load ({e}); install llmtrain[chaos]") from None
    _injector = harness.Injector(spec, rank, faults_file)


def armed() -> bool:
    """Whether this run injects faults at all."""
    return _injector is not None


def point(name: str, step: int, target=None):
    """Called where a fault may strike; does nothing unless a run armed one here. Returns
    ``target`` (a tensor or module the fault may corrupt), or what replaced it."""
    if _injector is not None:
        return _injector.point(name, step, target)
    return target
