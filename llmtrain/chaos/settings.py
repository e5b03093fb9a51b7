"""What a chaos run is asked to do (``llmtrain chaos``'s options): :class:`ChaosConfig`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChaosConfig:
    """A chaos run's settings; ``llmtrain.chaos.runner.Chaos`` runs one."""
    workdir: str = "runs/chaos"
    steps: int = 1000              # the job's length at most (without repeat it is asked
                                   # to stop once every kind has run): faults come until
                                   # 3 checkpoint intervals before it
    interval_s: float = 20.0       # mean quiet time after a fault's recovery
    seed: int = 0
    # comma-separated kinds to inject, each once in a seeded order, then (with repeat) at
    # random until the job nears its end; "": every kind (with ``script``, every kind a
    # user's loop can meet: ``llmtrain.chaos.kinds.default_kinds``)
    faults: str = ""
    repeat: bool = False
    nodes: int = 2                 # training nodes, ``tp`` ranks each, plus spares
    tp: int = 1                    # each node's ranks: a tensor-parallel group (its
                                   # ``parallelism.tp``), each node a data-parallel
                                   # replica; a spare node offers as many spares
    rank: int | None = None        # the rank every rank-level fault hits (default: random)
    checkpoint_every: int = 20
    reference: bool = True         # train again without faults to compare the weights
    warm: bool = True              # recover lost ranks warm where the warm path can
    spares: int | None = None      # spare nodes waiting (None: two warm, one cold); 0: the
                                   # job shrinks without the lost node until it returns
    repair_s: float = 20.0         # with no spares: a lost node returns this long after
    pace: int = 1                  # the job's steps last this many times its fastest early
                                   # step (a sleep: the same arithmetic), where faults come
                                   # by the clock: a fast job only trains more steps, which
                                   # the fault-free reference then trains again
    store_stall_s: float = 30.0    # how long store_stall stops the store: more than the
                                   # fence's timeout (and torchrun's keep-alive's 15 s)
    mix: dict[str, float] | None = None  # kind -> weight (``load_mix``): draws by weight
    mix_source: str = ""
    netns: bool = True             # nodes in network namespaces where the machine allows
    script: str = ""               # a training script of the user's (it calls
                                   # llmtrain.start) instead of llmtrain's trainer: the
                                   # nodes run it (``llmtrain launch --script``), and so
                                   # does the reference; ``faults`` may not name a kind
                                   # only the trainer meets (``script_kinds()``)

    @property
    def world_size(self) -> int:
        """The job's ranks at full size."""
        return self.nodes * self.tp
