"""The torchx component for llmtrain: one role, one replica per node, each running
``llmtrain launch`` (preflight, health gate, then torchrun's elastic agent).

.. code:: shell-session

    # here: 1 node x 2 CPU ranks, the debug model
    $ torchx run -s local_cwd launchers/torchx_llmtrain.py:train \\
        --nodes 1 --nproc_per_node 2 --run_dir runs/torchx -- --training.steps 50

    # Slurm: 16 nodes x 8 GPUs, 2 spares, 3 in-job restarts, 2 requeues
    $ torchx run -s slurm -cfg partition=gpu,time=24:00:00 \\
        launchers/torchx_llmtrain.py:train --nodes 16 --spares 2 --gpu 8 \\
        --config llama3_8b --run_dir /shared/runs/8b --max_retries 2 \\
        -- --data.path /shared/tokens/

    # Kubernetes (Volcano): the image from docker/Dockerfile
    $ torchx run -s kubernetes -cfg queue=default,namespace=llm \\
        launchers/torchx_llmtrain.py:train --image registry/llmtrain:0.1.0 \\
        --nodes 4 --spares 1 --h gpu.small --run_dir s3://bucket/runs/exp1 \\
        -- --data.path s3://bucket/tokens/

Everything after ``--`` goes to ``llmtrain train`` as config overrides. The module only
imports torchx, so it can be used from a machine without llmtrain installed.
"""

import re
import secrets
import shlex
from typing import Dict, List, Optional

import torchx.specs as specs
from torchx.specs import macros

ROLE = "node"
STORE_ROLE = "store"


def train(
    *args: str,
    nodes: int = 1,
    spares: int = 0,
    min_nodes: int = 0,
    nproc_per_node: int = 0,
    max_restarts: int = 3,
    max_retries: int = 0,
    run_dir: str = "runs/torchx",
    config: str = "debug_cpu",
    script: str = "",
    rdzv_port: int = 29500,
    rdzv_endpoint: str = "",
    rdzv_bind: str = "0.0.0.0",
    host: str = "{hostname}",
    image: str = "llmtrain:0.1.0",
    name: str = "llmtrain",
    h: Optional[str] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 8192,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
) -> specs.AppDef:
    """An llmtrain training job: ``nodes + spares`` replicas of ``llmtrain launch``, and
    with two or more replicas a ``store`` role that serves their rendezvous store.

    Each replica is one node. It checks the config and data (a bad config exits 78 before
    anything starts), runs the node health gate (a failing node records itself in the run
    dir's ``excluded_hosts.json`` and exits 76 without joining), then runs torchrun with
    c10d rendezvous ``--nnodes min_nodes:nodes``: the first ``nodes`` replicas to arrive
    train; the ``spares`` wait warm outside the rendezvous and take the place of a lost
    rank in about a second (the warm path), or, where the warm path cannot, join a cold
    restart, in which torchrun restarts every worker from the newest checkpoint (up to
    ``max_restarts`` times).

    The rendezvous store runs as a role of its own (``llmtrain rdzv-store``, one small
    replica, the app's first role so that every scheduler's rank-0 host names it): losing
    any node leaves it up, which the warm path needs. It ends by itself once every node's
    launcher has ended. ``rdzv_endpoint`` names a store you run instead; a single replica
    has none (its agent hosts the store on a free port, and one node cannot recover warm).

    Exit codes of a replica (the scheduler sees them; ``torchx run`` itself exits 1 when
    any replica failed): 0 training finished; 75 retryable (requeue); 76 this node is
    excluded (health); 78 fatal config or data error (do not retry). The local schedulers
    never retry; ``max_retries`` is for Slurm (requeue) and Kubernetes (Volcano maxRetry).

    Scheduler notes:

    * ``local_cwd``: every replica runs in the current directory on this machine, with
      ``llmtrain`` from ``PATH`` (activate the virtualenv). Replicas share one hostname, so
      give them names of their own with ``--host 'node{replica_id}'`` when there is more
      than one. ``-cfg log_dir=DIR`` keeps the replicas' logs.
    * ``slurm``: one replica per node (torchx submits a heterogeneous job, one group per
      replica, with ``--ntasks-per-node=1``); ``--gpu`` becomes ``--gpus-per-task``.
      torchx's srun uses ``--kill-on-bad-exit=1 --wait=60``, so a replica that leaves
      (an excluded node, a lost node) ends the allocation, and the job is requeued up to
      ``max_retries`` times and resumes from its newest checkpoint. An excluded host
      that Slurm hands out again fails the gate again: drain it. For spares inside one
      allocation use ``slurm/llmtrain.sbatch``.
    * ``kubernetes``: a Volcano job, one task (pod) per replica; the first ``min_nodes``
      tasks are required for the gang to start and the spares are optional
      (``minAvailable`` 0). Replicas find the rendezvous through the store's DNS name
      (``VC_STORE_0_HOSTS``, Volcano's svc plugin). The pods run the role's command,
      not the image's entry script (``llmtrain launch`` runs the gate itself).
      torchx 0.7 has no Kueue scheduler; take the ``--dryrun`` request as a start.

    Args:
        args: overrides for ``llmtrain train`` (``--section.field VALUE``), after ``--``
        nodes: nodes that train (torchrun's ``--nnodes`` maximum)
        spares: extra replicas that wait warm outside the rendezvous and replace a lost node
        min_nodes: the job may shrink to this many nodes when no spare is left
            (0: ``nodes``, a fixed size)
        nproc_per_node: ranks per node (0: one per GPU of the resource, 1 without GPUs)
        max_restarts: torchrun's in-job restarts of all workers (``--max-restarts``)
        max_retries: scheduler retries of the job (Slurm requeue, Volcano maxRetry)
        run_dir: the run dir (``--training.run_dir``): shared storage every node can
            reach, any fsspec URL; checkpoints, events and exclusions live there
        config: the preset (debug_cpu, llama3_8b, ...) or a TOML file in the image
        script: a training loop of your own on llmtrain's public API
            (``llmtrain.start``), run instead of llmtrain's trainer: its path in the image
            (or, on ``local_cwd``, relative to the current directory); ``args`` and the
            settings above reach it as its command line (``llmtrain launch --script``)
        rdzv_port: the port of the rendezvous store on the store role's host (ignored
            with a single replica, which picks a free port)
        rdzv_endpoint: HOST:PORT of an ``llmtrain rdzv-store`` you run (empty: the store
            role serves one)
        rdzv_bind: the address the store role listens on: every interface of its host by
            default (a pod or node address cannot be named for every scheduler); the store
            has no authentication, so keep its port inside the cluster network
        host: each node's name in events and exclusion records; ``{hostname}`` is the
            machine's hostname, ``{replica_id}`` the replica's index
        image: the container image (docker/Dockerfile); unused by local_cwd
        name: the job name
        h: a registered named resource (e.g. gpu.small); takes precedence over cpu, gpu
            and memMB
        cpu: CPUs per replica
        gpu: GPUs per replica
        memMB: memory per replica in MB
        env: environment variables for every replica (e.g. NCCL_DEBUG=WARN); without
            LLMTRAIN_JOB_SECRET or LLMTRAIN_JOB_SECRET_FILE, a new secret is made for the app
        mounts: mounts for container schedulers
            (type=bind,src=/host,dst=/job[,readonly] or type=volume,src=name,dst=/job)
    """
    if nodes < 1 or spares < 0:
        raise ValueError(f"nodes must be at least 1 and spares at least 0, got {nodes} and {spares}")
    min_nodes = min_nodes or nodes
    if not 1 <= min_nodes <= nodes:
        raise ValueError(f"min_nodes must be between 1 and nodes ({nodes}), got {min_nodes}")
    resource = specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h)
    nproc = nproc_per_node or max(resource.gpu, 1)
    replicas = nodes + spares
    store_role = not rdzv_endpoint and replicas > 1
    if rdzv_endpoint:
        endpoint = shlex.quote(rdzv_endpoint)
    elif replicas == 1:
        endpoint = "localhost:0"  # one agent: a free port, as torchx's dist.ddp does
    else:
        # The store role's host, from the variable each scheduler sets for the app's first
        # role (macros.rank0_env: TORCHX_RANK0_HOST on local_cwd, the het group 0 node on
        # Slurm, the store pod's DNS name on Kubernetes); "$$" keeps the "$" from torchx's
        # macro substitution.
        endpoint = f"$${{{macros.rank0_env}:=localhost}}:{rdzv_port}"
    cmd = ["exec", "llmtrain", "launch",
           "--nnodes", f"{min_nodes}:{nodes}",
           "--nproc-per-node", str(nproc),
           "--rdzv-endpoint", endpoint,
           *(["--external-store"] if rdzv_endpoint or store_role else []),
           "--rdzv-id", macros.app_id,
           "--host", _host_word(host),
           "--max-restarts", str(max_restarts),
           # replicas past the first `nodes` are spares: on standby outside the rendezvous
           f"$([ {macros.replica_id} -ge {nodes} ] && echo --standby)",
           *(["--script", shlex.quote(script)] if script else []),
           "--config", shlex.quote(config),
           "--training.run_dir", shlex.quote(run_dir),
           # Prometheus scrapes each replica from outside its host, at an address (pod IP,
           # node address) the component cannot name for every scheduler: every interface
           # of the replica's network; `-- --metrics.address ADDR` narrows it.
           "--metrics.address", "0.0.0.0",
           *(shlex.quote(a) for a in (args[1:] if args[:1] == ("--",) else args))]
    # The job's secret, with which every control key in the store is signed: one for the
    # app, made here unless the caller gives one (it travels in the app's spec, readable by
    # whoever may read the job's definition on its scheduler).
    given = {"LLMTRAIN_JOB_SECRET", "LLMTRAIN_JOB_SECRET_FILE"} & set(env or {})
    secret = {} if given else {"LLMTRAIN_JOB_SECRET": secrets.token_hex(32)}

    def role(role_name: str, command: str, **kwargs) -> specs.Role:
        return specs.Role(name=role_name, image=image, entrypoint="bash", args=["-c", command],
                          max_retries=max_retries,
                          env={"PYTHONUNBUFFERED": "1", **secret, **(env or {})},
                          mounts=specs.parse_mounts(mounts) if mounts else [], **kwargs)

    roles = [role(STORE_ROLE, f"exec llmtrain rdzv-store --bind {shlex.quote(rdzv_bind)} "
                              f"--port {rdzv_port} --exit-when-unused",
                  num_replicas=1, resource=specs.Resource(cpu=1, gpu=0, memMB=2048),
                  port_map={"c10d": rdzv_port})] if store_role else []
    roles.append(role(ROLE, " ".join(cmd), num_replicas=replicas, min_replicas=min_nodes,
                      resource=resource))
    return specs.AppDef(name=name, roles=roles)


def _host_word(template: str) -> str:
    """The shell word for ``--host``: the template's text quoted, ``{hostname}`` expanded
    on the node and ``{replica_id}`` filled in by torchx."""
    parts = re.split(r"(\{hostname\}|\{replica_id\})", template)
    word = "".join('"$HOSTNAME"' if p == "{hostname}" else
                   macros.replica_id if p == "{replica_id}" else
                   shlex.quote(p) for p in parts if p)
    if not word:
        raise ValueError("host must not be empty")
    return word
