"""The ranks of a multi-process test, started from a fork server rather than each in an
interpreter of its own: the server imports torch, its distributed stack and llmtrain once
per test worker (about 3 s of CPU on a 2-core machine), and each rank is a fork of it, a
fresh process that has imported nothing else and holds nothing of any earlier test's."""

import multiprocessing
import os

import torch.multiprocessing as mp

# What the server imports before its first fork (set once, before it starts: a test
# worker's later calls find it running and change nothing).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "llmtrain.checkpoint.snapshots", "llmtrain.control",
           "llmtrain.recovery.reshard"]


def spawn(fn, args: tuple = (), nprocs: int = 1) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, its ranks forked from the server:
    each rank runs ``fn(rank, *args)`` in this process's environment of now (as spawn's
    would: the server's is the one it started with); a rank that fails raises here."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(_in_env, args=(fn, dict(os.environ), *args), nprocs=nprocs,
                       start_method="forkserver")


def start(fn, args: tuple = (), nprocs: int = 1) -> list[multiprocessing.Process]:
    """Like :func:`spawn`, but returns the ranks' processes as they start, for a test that
    acts on them while they run (stops them, kills them) and ends them itself."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    ctx = multiprocessing.get_context("forkserver")
    procs = [ctx.Process(target=_in_env, args=(rank, fn, dict(os.environ), *args), daemon=True)
             for rank in range(nprocs)]
    for proc in procs:
        proc.start()
    return procs


def _in_env(rank: int, fn, env: dict[str, str], *args) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)
