"""The ``llmtrain`` command.

Exit codes follow :class:`llmtrain.reliability.elastic.ExitCode`: a configuration or data
error is FATAL (a restart would fail the same way), so launchers do not loop on it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import asdict

from llmtrain.config import ConfigError, load_config, parse_overrides, preset_names
from llmtrain.data import ShardError
from llmtrain.reliability.elastic import ExitCode


def _config(args: argparse.Namespace, rest: list[str]):
    return load_config(args.config, parse_overrides(rest))


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    cfg = _config(args, rest)
    from llmtrain.distributed.process_group import node_name
    from llmtrain.launch import stop_agent
    from llmtrain.metrics.events import EventLog
    from llmtrain.reliability import elastic
    from llmtrain.trainer import Trainer
    host = node_name()
    if host in (excluded := elastic.excluded_hosts(cfg.training.run_dir)):
        print(f"llmtrain: {host} is excluded from this run ({excluded[host]['reason']})",
              file=sys.stderr)
        stop_agent(ExitCode.EXCLUDE_NODE)
        return ExitCode.EXCLUDE_NODE
    try:
        trainer = Trainer(cfg)
    except (ConfigError, ShardError) as e:
        EventLog(cfg.training.run_dir, int(os.environ.get("RANK", 0))).emit(
            "fatal", host=host, error=f"{type(e).__name__}: {e}")
        stop_agent(ExitCode.FATAL)
        raise
    try:
        trainer.run()
    except BaseException as e:
        # The first sign of a failure elsewhere (a dead peer breaks our collective): the
        # start of the recovery clock.
        trainer.events.emit("failure", step=trainer.step, error=f"{type(e).__name__}: {e}"[:500])
        raise
    finally:
        trainer.close()
    stop_agent(trainer.exit_code)
    return trainer.exit_code


def cmd_config(args: argparse.Namespace, rest: list[str]) -> int:
    cfg = _config(args, rest)
    cfg.validate(args.world_size)
    from llmtrain.model import count_params, flops_per_token
    out = cfg.to_dict()
    out["derived"] = {"params": count_params(cfg.model),
                      "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len),
                      "accumulation_steps": cfg.accumulation_steps(args.world_size),
                      "mesh_shape": cfg.mesh_shape(args.world_size)}
    print(json.dumps(out, indent=2))
    return ExitCode.CLEAN


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def cmd_ckpt(args: argparse.Namespace, rest: list[str]) -> int:
    from llmtrain.checkpoint import storage
    if rest:
        raise ConfigError(f"unexpected arguments {rest}")
    if args.action == "list":
        ckpts = storage.list_checkpoints(args.url)
        print(f"{'step':>10}  {'state':<10} {'size':>10} {'files':>6} {'world':>6} {'age':>7}")
        for c in ckpts:
            state = "committed" if c.committed else "incomplete"
            print(f"{c.step:>10}  {state:<10} {c.bytes / 2**20:>8.1f}MB "
                  f"{len(c.manifest.get('files', {})) or '-':>6} "
                  f"{c.manifest.get('world_size', '-'):>6} {_age(c.age_s):>7}")
        if not ckpts:
            print(f"no checkpoints under {args.url}")
        return ExitCode.CLEAN
    # verify / inspect: a checkpoint directory, or every committed one under a root
    manifest = storage.read_manifest(args.url)
    urls = ([args.url] if manifest is not None or args.action == "inspect"
            else [c.url for c in storage.list_checkpoints(args.url) if c.committed])
    if not urls:
        print(f"no committed checkpoints under {args.url}", file=sys.stderr)
        return 1
    failed = False
    for url in urls:
        problems = storage.verify(url, checksums=not args.sizes_only)
        failed |= bool(problems)
        print(f"{url}: {'FAILED' if problems else 'ok'}")
        for p in problems:
            print(f"  {p}")
        if args.action == "inspect" and not problems:
            m = storage.read_manifest(url)
            print(json.dumps({k: v for k, v in m.items() if k != "files"}, indent=1))
            for name, meta in storage.tensor_index(url).items():
                print(f"  {name:<60} {meta}")
    return 1 if failed else ExitCode.CLEAN


def cmd_health(args: argparse.Namespace, rest: list[str]) -> int:
    cfg = _config(args, rest)
    host = args.host or socket.gethostname()
    if args.gate:
        return run_gate(cfg, host, as_json=args.json)
    from llmtrain.reliability import health
    findings, values, backend = _check_node(cfg, host)
    print(health.to_json(findings, values, backend) if args.json else health.table(findings))
    worst = health.worst(findings)
    return {"fatal": ExitCode.EXCLUDE_NODE, "warn": 1}.get(worst, ExitCode.CLEAN)


def _check_node(cfg, host: str):
    from llmtrain.reliability import health
    storage = {"run_storage": cfg.training.run_dir}
    if cfg.checkpoint.enable:
        storage["checkpoint_storage"] = cfg.checkpoint_url
    checker = health.HealthChecker(cfg.health, health.open_backend(cfg.health), host=host,
                                   storage=storage)
    findings, values = checker.run()
    return findings, values, checker.backend


def run_gate(cfg, host: str, as_json: bool = False) -> ExitCode:
    """The preflight gate: a fatal finding (or an earlier exclusion) keeps the node out of
    the job; it is recorded in the run's excluded_hosts.json. Warnings let it join."""
    from llmtrain.metrics.events import EventLog
    from llmtrain.reliability import elastic, health
    run_dir = cfg.training.run_dir
    if host in (excluded := elastic.excluded_hosts(run_dir)):
        print(f"llmtrain health: {host} was excluded from this run earlier: "
              f"{excluded[host]['reason']}; remove it from {run_dir}/excluded_hosts.json "
              f"once it is repaired", file=sys.stderr)
        return ExitCode.EXCLUDE_NODE
    findings, values, backend = _check_node(cfg, host)
    print(health.to_json(findings, values, backend) if as_json else health.table(findings))
    fatal = [f for f in findings if f.severity == "fatal"]
    if not fatal:
        return ExitCode.CLEAN
    reason = "; ".join(f.sentence() for f in fatal)
    elastic.exclude_host(run_dir, host, reason, findings=[asdict(f) for f in fatal])
    events = EventLog(run_dir, rank=None)
    events.emit("node_excluded", host=host, reason=reason, source="gate")
    events.close()
    print(f"llmtrain health: {host} excluded from the run: {reason}", file=sys.stderr)
    return ExitCode.EXCLUDE_NODE


def cmd_launch(args: argparse.Namespace, rest: list[str]) -> int:
    from llmtrain import launch
    cfg = _config(args, rest)
    return launch.launch(cfg, launch.from_args(args), ["--config", args.config, *rest])


def cmd_rdzv_store(args: argparse.Namespace, rest: list[str]) -> int:
    from llmtrain.launch import serve_store
    serve_store(args.bind, args.port)
    return ExitCode.CLEAN


def cmd_report(args: argparse.Namespace, rest: list[str]) -> int:
    from llmtrain.metrics.report import write_report
    if rest:
        raise ConfigError(f"unexpected arguments {rest}")
    try:
        print(write_report(args.run_dir, args.out))
    except (FileNotFoundError, ValueError) as e:
        print(f"llmtrain report: {e}", file=sys.stderr)
        return 1
    return ExitCode.CLEAN


def cmd_chaos(args: argparse.Namespace, rest: list[str]) -> int:
    """Injects every kind of fault into a running multi-node job; exit 1 unless every
    fault was detected and diagnosed, the job finished with the reference's weights and
    no committed checkpoint was lost."""
    from llmtrain.reliability import chaos
    if rest:
        raise ConfigError(f"unexpected arguments {rest}")
    cfg = chaos.ChaosConfig(workdir=args.workdir, steps=args.steps, interval_s=args.interval,
                            seed=args.seed, faults=args.faults or ",".join(chaos.KINDS),
                            repeat=args.repeat,
                            nodes=args.nodes, rank=args.rank,
                            reference=not args.no_reference)
    if cfg.rank is not None and not 0 <= cfg.rank < cfg.nodes:
        raise ConfigError(f"--rank {cfg.rank}: the job has ranks 0..{cfg.nodes - 1}")
    unknown = set(cfg.faults.split(",")) - set(chaos.KINDS)
    if unknown:
        raise ConfigError(f"--faults: unknown {sorted(unknown)}; choose from {chaos.KINDS}")
    result = chaos.Chaos(cfg).execute()
    out = os.path.join(args.workdir, "verdict.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(chaos.table(result))
    print(f"verdict: {out}")
    return ExitCode.CLEAN if chaos.passed(result) else 1


def cmd_analyze(args: argparse.Namespace, rest: list[str]) -> int:
    from llmtrain.reliability import flightrec
    dumps = flightrec.load_dumps(args.dir)
    if not dumps:
        print(f"no flight-recorder dumps in {args.dir}", file=sys.stderr)
        return 1
    report = flightrec.analyze(dumps, args.world_size)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.to_markdown())
    return ExitCode.CLEAN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmtrain", description="FSDP2 + FP8 Llama training that survives failures.",
        epilog="Any config field can be overridden as --section.field VALUE, "
               "e.g. --optim.lr 3e-4 --training.steps 100.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (("train", cmd_train, "train a model (under torchrun, or alone)"),
                             ("config", cmd_config, "print the resolved config and model size"),
                             ("health", cmd_health, "check this node's GPUs and storage"),
                             ("launch", cmd_launch, "run this node: preflight, health gate, "
                                                    "torchrun with elastic restarts")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default="debug_cpu",
                       help=f"preset ({', '.join(preset_names())}) or a .toml file")
        p.set_defaults(func=func)
    sub.choices["config"].add_argument("--world-size", type=int, default=1,
                                       help="check batch and mesh fit this many ranks")
    hp = sub.choices["health"]
    hp.add_argument("--gate", action="store_true",
                    help="preflight: a fatal finding excludes this node from the run (exit 76)")
    hp.add_argument("--json", action="store_true")
    hp.add_argument("--host", default="", help="name to record (default: the hostname)")
    from llmtrain.launch import add_arguments
    add_arguments(sub.choices["launch"])
    store = sub.add_parser("rdzv-store", help="serve a rendezvous store for the node agents")
    store.add_argument("--bind", default="0.0.0.0")
    store.add_argument("--port", type=int, default=29400)
    store.set_defaults(func=cmd_rdzv_store)
    ch = sub.add_parser("chaos", help="inject the fault matrix into a running job; verdicts")
    ch.add_argument("--workdir", default="runs/chaos", help="a new directory for the run")
    ch.add_argument("--steps", type=int, default=1000, help="the job's length")
    ch.add_argument("--interval", type=float, default=20.0, help="mean seconds between faults")
    ch.add_argument("--seed", type=int, default=0)
    ch.add_argument("--faults", default="", help="comma-separated kinds (default: all; "
                                                 "see llmtrain/reliability/chaos.py)")
    ch.add_argument("--repeat", action="store_true",
                    help="after each kind once, keep injecting at random until near the end")
    ch.add_argument("--nodes", type=int, default=2, help="training nodes (plus one spare)")
    ch.add_argument("--rank", type=int, default=None,
                    help="the rank every rank-level fault hits (default: a random one)")
    ch.add_argument("--no-reference", action="store_true",
                    help="skip the fault-free run that the final weights are compared with")
    ch.set_defaults(func=cmd_chaos)
    report = sub.add_parser("report", help="an HTML report (and PNGs) of a run")
    report.add_argument("run_dir")
    report.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    report.set_defaults(func=cmd_report)
    ckpt = sub.add_parser("ckpt", help="list, verify or inspect checkpoints")
    ckpt.add_argument("action", choices=("list", "verify", "inspect"))
    ckpt.add_argument("url", help="checkpoint directory (or the root holding step-N dirs)")
    ckpt.add_argument("--sizes-only", action="store_true", help="skip the sha256 checks")
    ckpt.set_defaults(func=cmd_ckpt)
    analyze = sub.add_parser("analyze", help="diagnose a hang from flight-recorder dumps")
    analyze.add_argument("dir", help="directory of dumps: llmtrain's rank-N.json, or "
                                     "PyTorch's own flight-recorder files")
    analyze.add_argument("--world-size", type=int, default=None,
                         help="ranks expected, so that missing dumps are named")
    analyze.add_argument("--json", action="store_true")
    analyze.set_defaults(func=cmd_analyze)
    args, rest = parser.parse_known_args(argv)
    try:
        return int(args.func(args, rest))
    except ConfigError as e:
        print(f"llmtrain: configuration error: {e}", file=sys.stderr)
        return ExitCode.FATAL
    except ShardError as e:
        print(f"llmtrain: data error: {e}", file=sys.stderr)
        return ExitCode.FATAL
