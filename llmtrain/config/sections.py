"""The config's sections: one dataclass per section, each field with its default, its
allowed values (checked by :mod:`llmtrain.config.parsing` as it is set) and what it does
(the one source of ``docs/config.md``, :mod:`llmtrain.config.reference`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config value that cannot run; the message names the field and what is allowed."""


def _f(default: Any, *, choices: tuple | None = None, ge: float | None = None,
       gt: float | None = None, le: float | None = None, lt: float | None = None,
       doc: str = "") -> Any:
    """A config field with its allowed values, checked by
    :func:`llmtrain.config.parsing.check_field`."""
    return field(default=default, metadata={"choices": choices, "ge": ge, "gt": gt,
                                            "le": le, "lt": lt, "doc": doc})


@dataclass
class ModelConfig:
    """Shape of the Llama-3-style decoder."""
    name: str = _f("debug", doc="label used in logs")
    dim: int = _f(256, ge=8, doc="hidden size (width of the residual stream)")
    n_layers: int = _f(4, ge=1, doc="transformer blocks")
    n_heads: int = _f(8, ge=1, doc="attention heads; must divide dim into an even head size")
    n_kv_heads: int = _f(4, ge=1, doc="grouped-query attention: must divide n_heads")
    vocab_size: int = _f(256, ge=2,
                         doc="token ids the embedding holds; at least the tokenizer's vocabulary")
    ffn_dim_multiplier: float = _f(1.0, gt=0,
                                   doc="scales the SwiGLU hidden size (Llama 3's 8/3 x dim rule)")
    multiple_of: int = _f(64, ge=1, doc="SwiGLU hidden size is rounded up to this")
    norm_eps: float = _f(1e-5, gt=0, doc="RMSNorm epsilon")
    rope_theta: float = _f(500000.0, gt=0, doc="rotary embedding base")
    max_seq_len: int = _f(2048, ge=1,
                          doc="longest sequence the rotary tables cover; data.seq_len <= this")
    tie_embeddings: bool = _f(False, doc="share the input embedding with the output projection")
    init_std: float = _f(0.02, gt=0,
                         doc="standard deviation of the weight init (the residual "
                             "projections': this / sqrt(2 n_layers))")

    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size by Llama's rule.

        Two thirds of the classic 4*dim keeps the three SwiGLU matrices at the cost of a
        two-matrix MLP; the multiplier and the rounding to ``multiple_of`` reproduce the
        published Llama 3 shapes (8B: 14336, 70B: 28672, 405B: 53248).
        """
        hidden = int(2 * 4 * self.dim / 3)
        hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


@dataclass
class DataConfig:
    """Where tokens come from and how samples are cut."""
    source: str = _f("embedded", choices=("embedded", "tokens"),
                     doc="embedded: the Python stdlib sources, byte-tokenized into the run dir; "
                         "tokens: pre-tokenized shards under data.path")
    path: str = _f("", doc="fsspec URL of a directory of *.bin token shards (source=tokens)")
    seq_len: int = _f(256, ge=1, doc="tokens per training sequence")
    seed: int = _f(0, ge=0, doc="seeds the per-epoch sample order")
    prefetch: int = _f(2, ge=0, doc="steps of batches a background thread reads ahead; 0: "
                                    "read each step's batch when it starts")
    embedded_max_bytes: int = _f(8_000_000, ge=10_000,
                                 doc="how much stdlib source the embedded corpus takes")


@dataclass
class ParallelismConfig:
    """Devices, process groups and how the model is sharded."""
    device: str = _f("auto", choices=("auto", "cpu", "cuda"),
                     doc="auto: CUDA when a GPU is visible, else CPU")
    backend: str = _f("auto", choices=("auto", "gloo", "nccl"),
                      doc="auto: nccl on cuda, gloo on cpu")
    tp: int = _f(1, ge=1, doc="tensor parallel: each block's matmuls split over this many "
                              "consecutive ranks (keep it within a node: its collectives run "
                              "in every block); dp_replicate x dp_shard make up the "
                              "world size / tp")
    dp_replicate: int = _f(1, ge=-1, doc="replica groups (HSDP); 1 is plain FSDP; -1: as many "
                                          "replicas of dp_shard ranks as fit, so that an "
                                          "elastic job shrinks and grows by whole replicas")
    dp_shard: int = _f(-1, ge=-1, doc="ranks each parameter is sharded over; -1: the rest")
    param_dtype: str = _f("bfloat16", choices=("bfloat16", "float32"),
                          doc="dtype of the gathered parameters in forward/backward (the sharded "
                              "master copy stays float32)")
    reduce_dtype: str = _f("float32", choices=("float32", "bfloat16"),
                           doc="dtype of the gradient reduce-scatter")
    reshard_after_forward: bool = _f(True,
                                     doc="free gathered parameters after each block's forward "
                                         "(less memory, one more all-gather)")
    fp8: str = _f("none", choices=("none", "tensorwise", "rowwise", "rowwise_with_gw_hp"),
                  doc="torchao float8 training recipe")
    activation_checkpoint: str = _f("none", choices=("none", "full", "selective"),
                                    doc="recompute activations in backward: every block (full) or "
                                        "the cheap ops only (selective)")
    compile: bool = _f(False, doc="torch.compile each transformer block")
    compile_cache: bool = _f(True, doc="with compile: rank 0 keeps what its first step "
                             "compiled in <run_dir>/compile-cache/ (torch's Mega-Cache), and "
                             "every later start of the same job secret loads it, its record "
                             "signed with LLMTRAIN_JOB_SECRET and checked against its key "
                             "(config, torch, Triton, device) and sha256, instead of compiling "
                             "again; without a secret nothing is kept")
    deterministic: bool = _f(False, doc="CUDA: deterministic kernels (cuBLAS, cuDNN, "
                             "torch.use_deterministic_algorithms) and NCCL pinned to "
                             "NCCL_ALGO=Ring, NCCL_PROTO=Simple (unless set), so a resume on "
                             "other nodes of the same kind reaches bitwise the same weights; "
                             "costs slower kernels (e.g. index_add/scatter backward) and "
                             "ring-only all-reduce. Without it, bitwise-equal resume holds "
                             "only on the same nodes and NCCL topology")


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""
    lr: float = _f(3e-4, gt=0, doc="peak learning rate, reached after warmup_steps")
    min_lr_ratio: float = _f(0.1, ge=0, le=1, doc="the cosine decay ends at lr x this")
    warmup_steps: int = _f(100, ge=0, doc="steps of linear warmup from 0 to lr")
    decay_steps: int = _f(0, ge=0, doc="the step the cosine decay ends at; 0: training.steps "
                                       "(set it to keep a schedule when the run's length "
                                       "changes)")
    weight_decay: float = _f(0.1, ge=0, doc="AdamW decoupled weight decay")
    beta1: float = _f(0.9, ge=0, lt=1, doc="AdamW first-moment decay")
    beta2: float = _f(0.95, ge=0, lt=1, doc="AdamW second-moment decay")
    eps: float = _f(1e-8, gt=0, doc="AdamW epsilon")
    max_grad_norm: float = _f(1.0, ge=0, doc="0 disables clipping")


@dataclass
class TrainingConfig:
    """The run: where it lives, how long, and its batch."""
    run_dir: str = _f("runs/debug_cpu", doc="fsspec URL of the run's directory")
    steps: int = _f(300, ge=1, doc="optimizer steps the run trains for")
    global_batch_size: int = _f(32, ge=1, doc="sequences per optimizer step, at any world size")
    micro_batch_size: int = _f(8, ge=1, doc="sequences per rank per forward pass")
    seed: int = _f(0, ge=0, doc="seeds weight init and every RNG")


@dataclass
class CheckpointConfig:
    """When and where checkpoints go, how many stay, and how a run resumes."""
    enable: bool = _f(True, doc="save checkpoints (and resume from them)")
    url: str = _f("", doc="fsspec URL of the checkpoint directory; empty: <run_dir>/checkpoints")
    interval_steps: int = _f(100, ge=0, doc="save every N steps; 0: not by steps")
    interval_seconds: float = _f(0.0, ge=0, doc="save every T seconds; 0: not by time")
    mode: str = _f("async_thread", choices=("async_thread", "async_process", "sync"),
                   doc="async: training blocks only while the state is staged to host memory")
    if_busy: str = _f("wait", choices=("wait", "skip"),
                      doc="when a save is due while the previous one still writes")
    keep_last: int = _f(3, ge=1, doc="committed checkpoints kept")
    keep_every: int = _f(0, ge=0, doc="also keep every checkpoint whose step is a multiple; 0: none")
    verify_checksums: bool = _f(True, doc="check every file's checksums before resuming "
                                          "(sizes always)")
    resume: bool = _f(True, doc="resume from the newest checkpoint that verifies")
    read_retries: int = _f(2, ge=0, doc="tries again (after 1 s, 2 s, ...) to read a "
                                        "checkpoint that fails with a read error (EIO, a "
                                        "timeout) before resuming from the previous one; "
                                        "the unreadable one stays committed")
    format: str = _f("raw", choices=("raw", "dcp"),
                     doc="raw: tensors as bare bytes, each with its checksum (fast; stock DCP "
                         "readers need llmtrain's ShardReader); dcp: DCP's own torch.save "
                         "items that any DCP reader (dcp.load, dcp_to_torch_save, torchtitan) "
                         "loads, checksummed per file in the manifest. llmtrain loads both")
    writer_threads: int = _f(2, ge=1, doc="write threads per rank, one shard file each")
    writer_nice: int = _f(10, ge=0, le=19,
                          doc="CPU niceness added to an async save's staging and write "
                              "threads (Linux, per thread): a background save copies, hashes "
                              "and writes with what training leaves idle instead of taking "
                              "cores from it; 0: the same priority")
    direct_io: str = _f("auto", choices=("auto", "on", "off"),
                        doc="write local checkpoint files around the page cache (O_DIRECT): "
                            "no kernel copy, dirty pages or writeback taken from training, "
                            "nothing of the page cache evicted. auto: on local block "
                            "filesystems (ext4, xfs, btrfs, f2fs); on: any local path that "
                            "takes it (Lustre, GPFS); off: never")
    reader_threads: int = _f(8, ge=1, doc="parallel range reads per rank when "
                             "loading (from local files, at most the rank's share of the "
                             "node's CPUs)")
    auto_interval: bool = _f(False, doc="save at the Young/Daly optimal interval computed "
                                        "from measured save cost and failure rate")
    init_from: str = _f("", doc="a Hugging Face Llama directory (config.json + safetensors, "
                                "e.g. from `llmtrain ckpt export`) whose weights start the "
                                "run; a checkpoint to resume from takes precedence")


@dataclass
class ControlConfig:
    """What all ranks decide together, with checkpointing on or off (llmtrain/control.py)."""
    save_on_signal: bool = _f(True, doc="SIGTERM/SIGUSR1: every rank stops at one step, "
                                        "saving first when checkpoints are on, then exits "
                                        "RETRYABLE")
    vote_interval_s: float = _f(1.0, ge=0,
                                doc="how often ranks agree on a save by time, a signal, a "
                                    "failed GPU or a stop request: one small all-reduce "
                                    "about this often, in flight until the next (heard "
                                    "within two); 0: every step")


@dataclass
class ReliabilityConfig:
    """Timeouts of the process groups, and injected faults."""
    init_timeout_s: float = _f(300.0, gt=0, doc="rendezvous and process-group creation")
    collective_timeout_s: float = _f(600.0, gt=0, doc="one collective during training")
    faults: str = _f("", doc="faults to inject, see llmtrain/chaos/faults.py; \"env\": "
                             "those of $LLMTRAIN_FAULTS and $LLMTRAIN_FAULTS_FILE (the "
                             "environment is ignored otherwise)")
    watchdog: bool = _f(True, doc="detect hangs, dump the flight recorder, report, restart")
    hang_timeout_s: float = _f(300.0, gt=0, doc="no progress for this long is a hang: the "
                                                "ceiling of the learned timeout")
    phase_timeout_s: float = _f(1800.0, gt=0,
                                doc="the hang timeout of long phases that cannot beat: "
                                    "start-up, resume, the first (compiled) step and "
                                    "the first after a warm recovery, a blocking save")
    hang_timeout_step_factor: float = _f(10.0, ge=0,
                                         doc="once the run has shown its pace (3 steps), "
                                             "the hang timeout is this many times its "
                                             "slowest recent step, within [hang_timeout_"
                                             "floor_s, hang_timeout_s]; 0: always "
                                             "hang_timeout_s")
    hang_timeout_floor_s: float = _f(5.0, gt=0, doc="the learned hang timeout's least value")
    heartbeat_interval_s: float = _f(1.0, gt=0,
                                     doc="seconds between a rank's heartbeats to the store; a "
                                         "frozen rank is named 1.5 of them after its peers wait "
                                         "for it")
    dump_timeout_s: float = _f(10.0, gt=0, doc="how long the report waits for ranks' dumps")
    flight_recorder_entries: int = _f(2000, ge=0, doc="collectives each rank remembers")
    desync_debug: bool = _f(False, doc="check every collective's op, shape and dtype "
                                       "across ranks before it runs (costs an exchange "
                                       "per collective)")
    straggler_factor: float = _f(1.5, gt=1, doc="a rank this many times slower than the "
                                                "rest, two windows running, is reported")
    straggler_window_s: float = _f(30.0, gt=0, doc="how often ranks' collective arrival "
                                                   "times are compared")
    not_arrived_factor: float = _f(10.0, ge=0, doc="ranks waiting in a collective this many "
                                                   "times its usual duration for a quiet rank "
                                                   "that has not entered it name that rank at "
                                                   "once, before the hang timeout; 0: off")
    not_arrived_floor_s: float = _f(3.0, gt=0, doc="the least wait that names a rank as not "
                                                   "arrived")
    fence_timeout_s: float = _f(10.0, gt=0, doc="how long a rank about to write a checkpoint "
                                                "waits for the rendezvous store to confirm "
                                                "it is still a member of the job, before "
                                                "refusing the write (llmtrain/recovery/fence.py)")


@dataclass
class IntegrityConfig:
    """Training-state integrity: bad steps never reach the weights, bad state never a
    checkpoint (llmtrain/reliability/integrity.py)."""
    enable: bool = _f(True, doc="judge every step's loss and gradient norm on the device, "
                                "and check the state before every save")
    on_nonfinite: str = _f("skip", choices=("skip", "rollback", "stop"),
                           doc="a step whose loss or gradients are inf/NaN is never "
                               "applied; then: go on, roll back to the last checkpoint "
                               "and skip its batch, or stop")
    spike_z: float = _f(8.0, ge=0, doc="a loss this many robust deviations (MAD) above "
                                       "the window's median is a spike; 0: off")
    spike_window: int = _f(64, ge=4, doc="steps the spike statistic and max_bad_steps look at")
    on_spike: str = _f("skip", choices=("skip", "rollback", "stop", "warn"),
                       doc="a loss spike is never applied; then: go on, roll back, stop, or (warn) "
                           "apply it and only log it")
    max_bad_steps: int = _f(8, ge=1, doc="this many skipped steps within spike_window: the "
                                         "run has diverged and stops (exit 78)")
    rollback_skip: int = _f(1, ge=1, doc="batches skipped after a rollback, ending with "
                                         "the bad step")
    sdc_every: int = _f(0, ge=0, doc="compare the replicas' parameter fingerprints every N "
                                     "steps (and before every save); 0: before saves only")
    recompute_every: int = _f(0, ge=0, doc="every N steps each rank also computes the next "
                                           "rank's first micro-batch, compared bit for bit: "
                                           "a rank whose arithmetic is wrong disagrees with "
                                           "both neighbours (3+ ranks name it); 0: off")
    on_sdc: str = _f("rollback", choices=("rollback", "exclude"),
                     doc="replicas that differ: roll back to the last checkpoint and name "
                         "the rank; exclude: then also exclude its node (exit 76)")
    skip_steps: str = _f("", doc="steps whose batches are consumed but not trained on, "
                                 "e.g. '120-130,400'")


@dataclass
class WarmConfig:
    """The warm path: survivors of a lost rank keep their processes and re-form the group
    with a warm spare, restoring state from in-memory snapshots (llmtrain/recovery/)."""
    enable: bool = _f(True, doc="recover from a lost rank in memory, with a warm spare; "
                                "needs the rendezvous store outside the workers "
                                "(llmtrain launch --external-store). Without one, or on "
                                "NCCL settings that defeat it, the run goes cold and says "
                                "why once")
    snapshot_every: int = _f(1, ge=1, doc="steps between in-memory snapshots at the least "
                                          "(each also replicated to a buddy rank on the "
                                          "next node)")
    snapshot_budget: float = _f(0.01, ge=0, lt=1, doc="the share of training time snapshots "
                                                      "may take: the interval grows from "
                                                      "snapshot_every until they fit; 0: "
                                                      "always snapshot_every. A larger share "
                                                      "redoes fewer steps after a failure, "
                                                      "and costs every step")
    snapshot_max_every: int = _f(50, ge=1, doc="steps between snapshots at the most, "
                                               "whatever the budget: a warm recovery "
                                               "redoes fewer steps than this")
    settle_s: float = _f(0.5, gt=0, doc="how long survivors wait for each other's reports "
                                        "before the missing ranks count as lost (a live "
                                        "rank still computing its step says it is "
                                        "coming, and is waited for up to budget_s / 2)")
    budget_s: float = _f(30.0, gt=0, doc="a warm recovery not done in this time falls "
                                         "back to the cold path (a restart under torchrun)")
    shrink: bool = _f(True, doc="with no spare waiting, the survivors of lost nodes go "
                                "on at the smaller world size (within the launcher's "
                                "--nnodes minimum), the state resharded from memory; "
                                "false: a lost node without a spare goes cold")
    grow: bool = _f(True, doc="a spare that waits while the job runs below the launcher's "
                              "--nnodes maximum joins it at a step boundary, its state "
                              "resharded from the running ranks' memory (no restart)")
    rehearse: bool = _f(True, doc="a warm spare of llmtrain's trainer trains one step of "
                                  "the job's model while it waits, alone, on a fake process "
                                  "group (no peer, no network), then drops it: the first "
                                  "step it trains in a lost rank's place pays only what "
                                  "belongs to that rank (DTensor's plans)")
    evict_wait_s: float = _f(2.0, gt=0, doc="a hang's stuck ranks are killed by their "
                                            "agents for the warm path to replace; a rank "
                                            "whose agent says nothing in this time (its "
                                            "node cut off) is marked gone and replaced all "
                                            "the same. Above the launcher's monitor "
                                            "interval")


@dataclass
class HealthConfig:
    """GPU and node health checks: the preflight gate and the in-training monitor."""
    backend: str = _f("auto", choices=("auto", "nvml", "scripted", "none"),
                      doc="auto: NVML if the driver loads, else the script if given, else CPU")
    script: str = _f("", doc="JSON/TOML file of scripted GPU states (also LLMTRAIN_NVML_SCRIPT)")
    expected_gpus: int = _f(-1, ge=-1, doc="GPUs a node must show; -1: LOCAL_WORLD_SIZE "
                                          "when set; 0: not checked")
    monitor: bool = _f(True, doc="re-check this rank's GPU while training")
    interval_s: float = _f(30.0, gt=0, doc="seconds between the monitor's checks")
    xid_fatal: str = _f("48,64,74,79,95,119,120", doc="XIDs that exclude the node")
    xid_warn: str = _f("63,92,94", doc="XIDs that only warn")
    xid_window_s: float = _f(3600.0, gt=0, doc="how far back the kernel log counts")
    max_aggregate_uce: int = _f(0, ge=0, doc="lifetime uncorrectable ECC errors before a warning")
    max_temperature_c: float = _f(87.0, gt=0, doc="GPU temperature above which the check warns")
    nvlink_error_threshold: int = _f(100, ge=0, doc="replay/recovery/CRC errors before a warning")
    pcie_degraded: str = _f("warn", choices=("warn", "fatal"), doc="a link below its max width")
    stray_processes: str = _f("fatal", choices=("warn", "fatal"),
                              doc="another process holding memory on our GPU")
    min_free_gb: float = _f(1.0, ge=0, doc="free space wanted on local run/checkpoint storage")
    min_shm_gb: float = _f(1.0, ge=0, doc="/dev/shm size NCCL needs")
    max_retransmit_ratio: float = _f(0.02, gt=0, doc="TCP segments a node sends again, as a "
                                                     "share of those it sends, above which "
                                                     "its link is reported lossy")
    link_window_s: float = _f(30.0, gt=0, doc="how far back a node's resent share is "
                                              "measured")
    link_min_segments: int = _f(1000, ge=1, doc="TCP segments a node must send in that window "
                                                "for its link to be judged")
    plugins: str = _f("", doc="comma-separated module:function site checks, each returning "
                              "a list of Finding")


@dataclass
class MetricsConfig:
    """What rank 0 reports, and how often."""
    log_every: int = _f(10, ge=1, doc="steps between loss/throughput reports")
    progress: str = _f("auto", choices=("auto", "bar", "plain"),
                       doc="auto: a progress bar on a terminal, plain lines otherwise")
    peak_tflops: float = _f(0.0, ge=0, doc="per-device peak for MFU; 0: known GPUs only")
    prometheus: bool = _f(True, doc="serve /metrics on every rank")
    address: str = _f("127.0.0.1", doc="address the exporter listens on; loopback serves "
                                       "a scraper on this host only, a cluster passes the "
                                       "node's address (or 0.0.0.0: every interface)")
    port: int = _f(9400, ge=0, le=65535, doc="base port, plus the local rank; 0: any free port")
    targets_dir: str = _f("", doc="where each rank writes its Prometheus file_sd entry; "
                              "empty: <run_dir>/monitoring/targets")
    run_name: str = _f("", doc="the `run` label; empty: the run dir's last component")
    goodput_every_s: float = _f(30.0, gt=0, doc="how often rank 0 re-reads the event log "
                                               "for goodput")
    assumed_mtbf_s: float = _f(0.0, ge=0, doc="mean time between failures for checkpoint "
                                              "advice before any failure is seen; 0: none")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "parallelism": ParallelismConfig,
    "optim": OptimConfig,
    "training": TrainingConfig,
    "checkpoint": CheckpointConfig,
    "control": ControlConfig,
    "reliability": ReliabilityConfig,
    "integrity": IntegrityConfig,
    "warm": WarmConfig,
    "health": HealthConfig,
    "metrics": MetricsConfig,
}
