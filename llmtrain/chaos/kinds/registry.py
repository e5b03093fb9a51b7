"""The fault kinds chaos knows, by name: each kind's module registers its scenario (the
injection, the detection and the verdict) with :func:`fault_kind`, so that the kinds chaos
schedules, and checks ``--faults`` and mixes against, have one source."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmtrain.chaos.job import Job
from llmtrain.chaos.verdict import Verdict
from llmtrain.config import ConfigError

Scenario = Callable[[Job], Verdict]


@dataclass(frozen=True)
class FaultKind:
    """A kind of fault chaos injects: the scenario that injects it into the job and judges
    the job's answer, and what it needs of the cluster."""
    name: str
    inject: Scenario
    needs_netns: bool = False  # nodes with links of their own (network namespaces)
    keeps_ranks: bool = False  # costs no rank: needs no spare waiting, nor waits for one
    takes_node: bool = False   # costs a node's ranks: needs a node's worth of spares
    trainer_only: str = ""     # why it needs llmtrain's own trainer (not a --script's loop)


# name -> kind, in the order the kinds registered (a schedule's seeded order draws from it)
FAULT_KINDS: dict[str, FaultKind] = {}


def fault_kind(name: str, needs_netns: bool = False, keeps_ranks: bool = False,
               takes_node: bool = False, trainer_only: str = "") -> Callable[[Scenario],
                                                                            Scenario]:
    """Registers the decorated scenario as the fault kind ``name``. ``trainer_only``: why
    the kind cannot strike a user's loop (``--script``)."""
    def register(inject: Scenario) -> Scenario:
        if name in FAULT_KINDS:
            raise ValueError(f"fault kind {name!r} registered twice")
        FAULT_KINDS[name] = FaultKind(name, inject, needs_netns, keeps_ranks, takes_node,
                                      trainer_only)
        return inject
    return register


def script_kinds() -> tuple[str, ...]:
    """The kinds a user's loop (``--script``) can meet, and the default set for one:
    every kind but those only llmtrain's trainer can (``trainer_only``)."""
    return tuple(k for k, kind in FAULT_KINDS.items() if not kind.trainer_only)


def trainer_only_kinds() -> dict[str, str]:
    """The kinds only llmtrain's trainer can meet, and why."""
    return {k: kind.trainer_only for k, kind in FAULT_KINDS.items() if kind.trainer_only}


def default_kinds(script: str = "") -> tuple[str, ...]:
    """The kinds a run injects unless told which: every kind, or with ``script`` every
    kind a user's loop can meet."""
    return script_kinds() if script else tuple(FAULT_KINDS)


def kinds_named(names: str, script: str = "") -> list[FaultKind]:
    """The kinds a comma-separated list names ("": :func:`default_kinds`), or a
    ConfigError listing the known ones; with ``script`` (a user's loop, ``--script``), a
    ConfigError naming those only llmtrain's trainer can meet, and why."""
    listed = names.split(",") if names else list(default_kinds(script))
    unknown = [n for n in listed if n not in FAULT_KINDS]
    if unknown:
        raise ConfigError(f"unknown fault kind(s) {unknown}; known: {', '.join(FAULT_KINDS)}")
    kinds = [FAULT_KINDS[n] for n in listed]
    refused = [k for k in kinds if k.trainer_only]
    if script and refused:
        raise ConfigError(
            f"--script {script}: fault kind(s) {[k.name for k in refused]} cannot strike a "
            f"loop of your own (" + "; ".join(f"{k.name}: {k.trainer_only}" for k in refused)
            + f"); choose from {', '.join(script_kinds())}")
    return kinds
