"""How ``llmtrain launch`` runs a node (:class:`LaunchConfig`): torchrun's options, the
rendezvous store's, a standby's, and the command-line flags that set them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class LaunchConfig:
    nnodes: str = "1"             # N or MIN:MAX, torchrun's syntax
    nproc_per_node: int = 1
    rdzv_endpoint: str = "127.0.0.1:29400"
    rdzv_id: str = "llmtrain"
    max_restarts: int = 3
    external_store: bool = False  # the endpoint is an `llmtrain rdzv-store`, not an agent
    host: str = ""                # the node's name in exclusion records (default: hostname)
    standby: bool = False         # a spare: wait outside the rendezvous until one is short
    join_timeout_s: float = 600.0
    last_call_timeout_s: float = 5.0
    monitor_interval_s: float = 0.1  # torchrun's own default: a dead worker seen at once
    # With the warm path the agent learns of a dead worker from SIGCHLD, and its monitor
    # only decides a cold restart: a look a second (ten cost a warm recovery's ranks about
    # 0.05 s of CPU on a 2-core machine).
    warm_monitor_interval_s: float = 1.0
    script: str = ""              # a training script of the user's (it calls llmtrain.start)
    prepared_workers: bool = True  # keep a worker imported per local rank for the next attempt
    # the node's Python processes (agent, prepared workers, spares) are forks of one
    # process that imported torch and llmtrain once (llmtrain.launch.template)
    template: bool = True

    @property
    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes of ``nnodes``; N is N:N."""
        lo, _, hi = self.nnodes.partition(":")
        return int(lo), int(hi or lo)

    @property
    def world_sizes(self) -> list[int]:
        """Every world size the job may run at: a node lost without a spare shrinks it by
        one node, down to MIN."""
        lo, hi = self.node_range
        return [n * self.nproc_per_node for n in range(lo, hi + 1)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = LaunchConfig()
    p.add_argument("--nnodes", default=d.nnodes, help="N, or MIN:MAX for an elastic job")
    p.add_argument("--nproc-per-node", type=int, default=d.nproc_per_node)
    p.add_argument("--rdzv-endpoint", default=d.rdzv_endpoint)
    p.add_argument("--rdzv-id", default=d.rdzv_id)
    p.add_argument("--max-restarts", type=int, default=d.max_restarts)
    p.add_argument("--external-store", action="store_true",
                   help="the endpoint is an `llmtrain rdzv-store` process")
    p.add_argument("--host", default="", help="this node's name (default: the hostname)")
    p.add_argument("--standby", action="store_true",
                   help="a spare: join only when the job's rendezvous is short of nodes")
    p.add_argument("--script", default="",
                   help="run this training script of yours (it calls llmtrain.start; it "
                        "gets --config and the overrides) instead of llmtrain's trainer")
    p.add_argument("--prepared-workers", action=argparse.BooleanOptionalAction,
                   default=d.prepared_workers,
                   help="keep, for each local rank, a worker that has imported torch and "
                        "llmtrain before its attempt starts: a cold restart skips the spawn "
                        "and the imports (one idle process per GPU meanwhile; on by default)")
    p.add_argument("--template", action=argparse.BooleanOptionalAction, default=d.template,
                   help="fork the node's processes (torchrun's agent, prepared workers, warm "
                        "spares) from one process that imported torch and llmtrain once; "
                        "--no-template starts each afresh, importing for itself (on by "
                        "default)")


def from_args(args: argparse.Namespace) -> LaunchConfig:
    return LaunchConfig(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                        rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
                        max_restarts=args.max_restarts, external_store=args.external_store,
                        host=args.host, standby=args.standby, script=args.script,
                        prepared_workers=args.prepared_workers, template=args.template)
