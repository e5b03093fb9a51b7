"""The fault kinds of a chaos run, one module each (its injection, its detection and its
verdict), registered by name (``registry``):

==================  ===================================================================
kill_rank           SIGKILL one rank mid-step
kill_in_save        a rank dies inside its checkpoint shard write (a run-time fault)
hang                SIGSTOP one rank: it stops inside a collective, watchdog thread and all
desync              one rank calls a different collective (a run-time fault)
slow_rank           one rank stopped 2/3 of the time for a while: a straggler
node_loss           a whole node (launcher, agent, workers) dies; the spare takes over
partition           a node's link goes down while its processes live (network namespaces)
lossy_link          a node's link drops what does not fit a small queue at 100 Mbit/s
                    (network namespaces)
preempt             a node's launcher gets SIGTERM, as Slurm sends it before taking the node
enospc, eio         the checkpoint filesystem fails the next save with ENOSPC / EIO
unreadable_         an old committed checkpoint's manifest fails every read (EIO)
checkpoint
slow_retention      every manifest read takes 1.5 s
store_stall         the rendezvous store's process is stopped (SIGSTOP) for 30 s
store_restart       the rendezvous store's process is killed and started again, empty
gpu_bad             a node's scripted GPU reports uncorrectable ECC errors
truncated_shard     a shard of the newest committed checkpoint is cut short
nan                 one rank's loss turns NaN for a step (llmtrain's trainer only)
bitflip             one rank flips a bit of its replica of the parameters
==================  ===================================================================

Each module's docstring says what its kind must see the job do. The order of the imports
below is the order the kinds register in, which a seed's schedule draws from: a new kind
goes last, or every seeded schedule changes.
"""

# each module registers its kinds as it is imported, in this order
from llmtrain.chaos.kinds import (kill_rank, kill_in_save, hang, desync, slow_rank, node_loss,
                                  partition, lossy_link, preempt, storage_error,
                                  unreadable_checkpoint, slow_retention, store_stall,
                                  store_restart, gpu_bad, truncated_shard, nan, bitflip)
from llmtrain.chaos.kinds.registry import (FAULT_KINDS, FaultKind, default_kinds, kinds_named,
                                           script_kinds, trainer_only_kinds)

MODULES = (kill_rank, kill_in_save, hang, desync, slow_rank, node_loss, partition, lossy_link,
           preempt, storage_error, unreadable_checkpoint, slow_retention, store_stall,
           store_restart, gpu_bad, truncated_shard, nan, bitflip)  # the kinds' modules
KINDS = tuple(FAULT_KINDS)  # every kind's name, in the order they registered

__all__ = ["FAULT_KINDS", "KINDS", "MODULES", "FaultKind", "default_kinds", "kinds_named", "script_kinds",
           "trainer_only_kinds"]
