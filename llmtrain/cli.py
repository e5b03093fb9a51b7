"""The ``llmtrain`` command.

Exit codes follow :class:`llmtrain.exit_codes.ExitCode`: a configuration or data
error is FATAL (a restart would fail the same way), so launchers do not loop on it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import socket
from typing import Callable, NamedTuple

from llmtrain import collector
from llmtrain.config import (ConfigError, load_config, parse_overrides, preset_names,
                             reference_markdown)
from llmtrain.exit_codes import ExitCode, FatalError
from llmtrain.log import log_to_stderr

log = logging.getLogger(__name__)


class MissingExtra(Exception):
    """An optional dependency of the command is not installed: exit FATAL, say which extra."""


def _need_extra(extra: str, module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"this command needs the {extra!r} extra ({module} is not "
                           f"installed): pip install 'llmtrain[{extra}]'") from None


def _config(args: argparse.Namespace, rest: list[str]):
    return load_config(args.config, parse_overrides(rest))


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    with collector.paused(freeze=True):  # a worker's start: see llmtrain.collector
        from llmtrain.launch.worker import run_worker
    return run_worker(_config(args, rest))


def cmd_spare(args: argparse.Namespace, rest: list[str]) -> int:
    with collector.paused(freeze=True):
        from llmtrain.launch.worker import run_spare
    return run_spare(_config(args, rest))


def cmd_config(args: argparse.Namespace, rest: list[str]) -> int:
    if args.reference:
        print(reference_markdown())
        return ExitCode.CLEAN
    cfg = _config(args, rest)
    cfg.validate(args.world_size)
    from llmtrain.model import count_params, flops_per_token
    out = cfg.to_dict()
    out["derived"] = {"params": count_params(cfg.model),
                      "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len),
                      "accumulation_steps": cfg.accumulation_steps(args.world_size),
                      "mesh_shape": cfg.mesh_shape(args.world_size),
                      "mesh": dict(zip(("dp_replicate", "dp_shard", "tp"),
                                       (*cfg.mesh_shape(args.world_size), cfg.parallelism.tp))),
                      "tokens_per_step": cfg.tokens_per_step()}
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
    if args.action == "convert":
        from llmtrain.checkpoint.convert import convert
        if not args.to or rest:
            raise ConfigError("ckpt convert needs --to raw|dcp|torch DEST, nothing else")
        convert(args.url, *args.to)
        print(f"{args.to[1]}: {args.url} as {args.to[0]}, read back and equal")
        return ExitCode.CLEAN
    if args.action == "export":
        from llmtrain.checkpoint import hf
        _need_extra("hf", "safetensors")
        fmt, out = args.to or (None, None)
        if fmt != "hf":
            raise ConfigError("ckpt export needs --to hf DIR (the one format it writes)")
        given = _config(args, rest).model if args.config or rest else None
        written, no_tokenizer = hf.export(args.url, out, given, tokenizer=args.tokenizer)
        for name in written:
            print(f"{out.rstrip('/')}/{name}")
        if no_tokenizer:
            log.warning("llmtrain ckpt export: no tokenizer written: %s", no_tokenizer)
        return ExitCode.CLEAN
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
        log.error("no committed checkpoints under %s", args.url)
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
    from llmtrain.reliability.health.checks import table, to_json, worst
    from llmtrain.reliability.health.gate import check_node, run_gate
    cfg = _config(args, rest)
    host = args.host or socket.gethostname()
    if args.gate:
        return run_gate(cfg, host, as_json=args.json)
    findings, values, backend = check_node(cfg, host)
    print(to_json(findings, values, backend) if args.json else table(findings))
    return {"fatal": ExitCode.EXCLUDE_NODE, "warn": 1}.get(worst(findings), ExitCode.CLEAN)


def cmd_launch(args: argparse.Namespace, rest: list[str]) -> int:
    # not torch: the node's template imports it for the agent and the workers, and a
    # launcher of its own would delay the template's start by its 1.3 s of CPU
    with collector.paused(freeze=True):
        from llmtrain.launch.config import from_args
        from llmtrain.launch.node import launch
    cfg = _config(args, rest)
    return launch(cfg, from_args(args), ["--config", args.config, *rest])


def cmd_rdzv_store(args: argparse.Namespace, rest: list[str]) -> int:
    with collector.paused(freeze=True):
        from llmtrain.launch.store import serve_store
    return serve_store(args.bind, args.port, args.exit_when_unused, args.lease_timeout_s,
                       presence_port=args.presence_port)


def cmd_report(args: argparse.Namespace, rest: list[str]) -> int:
    _need_extra("report", "matplotlib")
    from llmtrain.report.html import write_report
    if rest:
        raise ConfigError(f"unexpected arguments {rest}")
    try:
        print(write_report(args.run_dir, args.out))
    except (FileNotFoundError, ValueError) as e:
        log.error("llmtrain report: %s", e)
        return 1
    return ExitCode.CLEAN


def cmd_stop(args: argparse.Namespace, rest: list[str]) -> int:
    """Asks a running job to save and end at its next step (see llmtrain/stop_request.py)."""
    import fsspec

    from llmtrain.fsio import join
    from llmtrain.stop_request import request_stop
    if rest:
        raise ConfigError(f"unexpected arguments {rest}")
    fs, path = fsspec.core.url_to_fs(join(args.run_dir, "events"))
    if not fs.exists(path):
        raise ConfigError(f"{args.run_dir}: no run there (no events/): give the job's "
                          f"training.run_dir")
    request_stop(args.run_dir, args.reason)
    print(f"asked the run at {args.run_dir} to save and end at its next step; its run_end "
          f"event says when it has (launch it again to go on from that save)")
    return ExitCode.CLEAN


def cmd_chaos(args: argparse.Namespace, rest: list[str]) -> int:
    """Injects every kind of fault into a running multi-node job; exit 1 unless every
    fault was detected and diagnosed, the job finished with the reference's weights and
    no committed checkpoint was lost."""
    _need_extra("chaos", "mfusepy")
    from llmtrain.chaos import runner as chaos
    if rest:
        raise ConfigError(f"unexpected arguments {rest}")
    mix, source = chaos.load_mix(args.mix) if args.mix else (None, "")
    cfg = chaos.ChaosConfig(workdir=args.workdir, steps=args.steps, interval_s=args.interval,
                            seed=args.seed, faults=args.faults or ",".join(
                                chaos.script_kinds() if args.script else chaos.KINDS),
                            repeat=args.repeat,
                            nodes=args.nodes, tp=args.tp, rank=args.rank,
                            checkpoint_every=args.checkpoint_every,
                            reference=not args.no_reference, warm=not args.cold,
                            mix=mix, mix_source=source, netns=not args.no_netns,
                            spares=args.spares, repair_s=args.repair_s,
                            script=args.script, pace=args.pace)
    if cfg.spares is not None and cfg.spares < 0:
        raise ConfigError(f"--spares {cfg.spares}: a count of nodes, 0 or more")
    if cfg.spares == 0 and cfg.nodes < 2:
        raise ConfigError("--spares 0 needs --nodes 2 or more: the job goes on one node short")
    if cfg.tp < 1:
        raise ConfigError(f"--tp {cfg.tp}: a node's ranks, 1 or more")
    if cfg.pace < 1:
        raise ConfigError(f"--pace {cfg.pace}: a factor of the job's fastest step, 1 or more")
    if cfg.rank is not None and not 0 <= cfg.rank < cfg.world_size:
        raise ConfigError(f"--rank {cfg.rank}: the job has ranks 0..{cfg.world_size - 1}")
    if cfg.checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every {cfg.checkpoint_every}: must be at least 1")
    unknown = set(cfg.faults.split(",")) - set(chaos.KINDS)
    if unknown:
        raise ConfigError(f"--faults: unknown {sorted(unknown)}; choose from {chaos.KINDS}")
    chaos.kinds_named(cfg.faults, cfg.script)  # a kind a script's loop cannot meet: refused
    result = chaos.Chaos(cfg).execute()
    out = os.path.join(args.workdir, "verdict.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(chaos.table(result))
    print(f"verdict: {out}")
    return ExitCode.CLEAN if chaos.passed(result) else 1


def cmd_data(args: argparse.Namespace, rest: list[str]) -> int:
    _need_extra("data", "tokenizers")
    _need_extra("data", "pyarrow")
    if rest:
        raise ConfigError(f"unexpected arguments {rest}")
    from llmtrain.data.prepare import Config, prepare
    shard_tokens = {"shard_tokens": args.shard_tokens} if args.shard_tokens else {}
    prepare(Config(
        inputs=args.inputs, tokenizer=args.tokenizer, out=args.out, text_field=args.field,
        eos=args.eos, workers=args.workers, faults=args.faults, **shard_tokens))
    return ExitCode.CLEAN


def cmd_analyze(args: argparse.Namespace, rest: list[str]) -> int:
    from llmtrain.reliability import flightrec
    dumps = flightrec.load_dumps(args.dir)
    if not dumps:
        log.error("no flight-recorder dumps in %s", args.dir)
        return 1
    report = flightrec.analyze(dumps, args.world_size)
    print(json.dumps(report.to_json(), indent=1) if args.json else report.to_markdown())
    return ExitCode.CLEAN


# -- each command's parser -------------------------------------------------------------


def _add_config(p: argparse.ArgumentParser) -> None:
    """``--config``: what the commands that read a training config take."""
    p.add_argument("--config", default="debug_cpu",
                   help=f"preset ({', '.join(preset_names())}) or a .toml file")


def _config_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain config``'s options."""
    _add_config(p)
    p.add_argument("--world-size", type=int, default=1,
                   help="check batch and mesh fit this many ranks")
    p.add_argument("--reference", action="store_true",
                   help="print every field as Markdown (docs/config.md)")


def _health_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain health``'s options."""
    _add_config(p)
    p.add_argument("--gate", action="store_true",
                   help="preflight: a fatal finding excludes this node from the run (exit 76)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--host", default="", help="name to record (default: the hostname)")


def _launch_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain launch``'s options: the node launcher's own (llmtrain.launch.config)."""
    _add_config(p)
    from llmtrain.launch.config import add_arguments
    add_arguments(p)


def _rdzv_store_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain rdzv-store``'s options."""
    p.add_argument("--bind", default="127.0.0.1",
                   help="address to listen on (default: this host only); on a cluster, "
                        "the address the nodes reach this host at")
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("--exit-when-unused", action="store_true",
                   help="end once every `llmtrain launch` that used it has ended (a "
                        "store run as one task of the job, as the torchx component does)")
    p.add_argument("--lease-timeout-s", type=float, default=30.0,
                   help="a launcher silent this long counts as ended (its node died)")
    p.add_argument("--presence-port", type=int, default=0,
                   help="port of the presence listener, which knows at once when a rank's "
                        "process dies (its node's too) for the warm path; 0: any free port, "
                        "published in the store (needs the job's secret)")


def _chaos_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain chaos``'s options."""
    p.add_argument("--workdir", default="runs/chaos", help="a new directory for the run")
    p.add_argument("--steps", type=int, default=1000,
                   help="the job's length at most: without --repeat, it is asked to stop "
                        "once every kind has run")
    p.add_argument("--interval", type=float, default=20.0, help="mean seconds between faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--faults", default="", help="comma-separated kinds (default: all, with "
                                                "--script all a script's loop can meet; each "
                                                "kind is a module of llmtrain/chaos/kinds/)")
    p.add_argument("--repeat", action="store_true",
                   help="after each kind once, keep injecting at random until near the end")
    p.add_argument("--mix", default="", help="draw the kinds by a fleet's failure mix: a "
                                             "TOML file, or a shipped mix by name (llama3)")
    p.add_argument("--nodes", type=int, default=2, help="training nodes (plus spares)")
    p.add_argument("--tp", type=int, default=1,
                   help="ranks per node, a tensor-parallel group (parallelism.tp); each node "
                        "is a data-parallel replica, and each spare node offers this many "
                        "spares")
    p.add_argument("--spares", type=int, default=None,
                   help="spare nodes waiting (default: 2 warm, 1 cold); 0: a lost node's "
                        "job shrinks and grows back once the node returns")
    p.add_argument("--repair-s", type=float, default=20.0,
                   help="with --spares 0: a lost node returns this long after its fault")
    p.add_argument("--rank", type=int, default=None,
                   help="the rank every rank-level fault hits (default: a random one)")
    p.add_argument("--pace", type=int, default=1,
                   help="the job's steps last this many times its fastest early step (a "
                        "sleep; the arithmetic is the same): faults come by the clock, so "
                        "a fast job only trains more steps, which the fault-free reference "
                        "trains again")
    p.add_argument("--checkpoint-every", type=int, default=20,
                   help="the job's checkpoint interval in steps (the last faults come "
                        "3 intervals before the end)")
    p.add_argument("--cold", action="store_true",
                   help="without the warm path: every lost rank costs a restart of all")
    p.add_argument("--no-netns", action="store_true",
                   help="nodes on loopback, not in network namespaces of their own (the "
                        "kinds that need their own link are left out)")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the fault-free run that the final weights are compared with")
    p.add_argument("--script", default="", metavar="PATH",
                   help="chaos on a training loop of yours (a script that calls "
                        "llmtrain.start, e.g. examples/cnn_sgd.py) instead of llmtrain's "
                        "trainer: the nodes run llmtrain launch --script PATH, the "
                        "reference torchrun PATH. The kinds only llmtrain's trainer "
                        "meets are refused with it, and left out of its default set: "
                        "nan (the loss is poisoned at the trainer's 'loss' fault point)")


def _stop_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain stop``'s arguments."""
    p.add_argument("run_dir", help="the job's training.run_dir (an fsspec URL)")
    p.add_argument("--reason", default="asked by llmtrain stop",
                   help="recorded in the run's stop_requested event")


def _report_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain report``'s arguments."""
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")


def _ckpt_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain ckpt``'s arguments."""
    p.add_argument("action", choices=("list", "verify", "inspect", "convert", "export"))
    p.add_argument("url", help="checkpoint directory (or the root holding step-N dirs)")
    p.add_argument("--sizes-only", action="store_true", help="skip the checksum checks")
    p.add_argument("--to", nargs=2, metavar=("FORMAT", "DIR"),
                   help="convert: 'raw', 'dcp' (a checkpoint any DCP reader loads) or "
                        "'torch' (one torch.save file), and where; "
                        "export: 'hf' and a directory for safetensors + config.json "
                        "(transformers.LlamaForCausalLM loads it), and the tokenizer of "
                        "the corpus the run trained on (AutoTokenizer loads it)")
    p.add_argument("--tokenizer", default="",
                   help="export: this tokenizer.json (fsspec URL) instead of the corpus's")
    p.add_argument("--config", default=None,
                   help="export of a checkpoint that does not record its model: the "
                        "run's preset or .toml (model overrides may follow)")


def _data_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain data``'s arguments."""
    p.add_argument("action", choices=("prepare",))
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="fsspec URLs of .txt, .jsonl or .parquet files (compressed ones "
                        "too), globs or directories of them; their order is the data's")
    p.add_argument("--tokenizer", required=True,
                   help="a Hugging Face tokenizer.json (fsspec URL)")
    p.add_argument("--out", required=True,
                   help="directory for the shards and corpus.json (fsspec URL); "
                        "train on it with --data.source tokens --data.path OUT")
    p.add_argument("--field", default="text", help="JSONL key or Parquet column of the text")
    p.add_argument("--eos", default="", help="end-of-document token (default: the "
                                             "tokenizer's, by its usual names)")
    p.add_argument("--workers", type=int, default=0, help="processes (default: one a core)")
    p.add_argument("--shard-tokens", type=int, default=0,
                   help="tokens per shard at most (default: 256 Mi)")
    p.add_argument("--faults", default="", help=argparse.SUPPRESS)  # tests: fault points


def _analyze_arguments(p: argparse.ArgumentParser) -> None:
    """``llmtrain analyze``'s arguments."""
    p.add_argument("dir", help="directory of dumps, one a rank: llmtrain's rank-N.json, "
                               "or PyTorch's pickles or JSON (gloo or NCCL), the rank "
                               "at the end of the name (nccl_trace_rank_3)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks expected (default: as the dumps' pg_config lists them)")
    p.add_argument("--json", action="store_true")


class Command(NamedTuple):
    """One ``llmtrain`` command: its name, its help line, what adds its arguments to its
    parser, and what runs it (given the parsed arguments and the config overrides)."""
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, list[str]], int]


COMMANDS = (
    Command("train", "train a model (under torchrun, or alone)", _add_config, cmd_train),
    Command("spare", "wait warm to replace a lost rank (started by a standby llmtrain launch)",
            _add_config, cmd_spare),
    Command("config", "print the resolved config and model size", _config_arguments,
            cmd_config),
    Command("health", "check this node's GPUs and storage", _health_arguments, cmd_health),
    Command("launch", "run this node: preflight, health gate, torchrun with elastic restarts",
            _launch_arguments, cmd_launch),
    Command("rdzv-store", "serve a rendezvous store for the node agents",
            _rdzv_store_arguments, cmd_rdzv_store),
    Command("chaos", "inject the fault matrix into a running job; verdicts", _chaos_arguments,
            cmd_chaos),
    Command("stop", "ask a running job to save and end at its next step", _stop_arguments,
            cmd_stop),
    Command("report", "an HTML report (and PNGs) of a run", _report_arguments, cmd_report),
    Command("ckpt", "list, verify, inspect, convert or export checkpoints", _ckpt_arguments,
            cmd_ckpt),
    Command("data", "prepare your own text as token shards", _data_arguments, cmd_data),
    Command("analyze", "diagnose a hang or desync from any PyTorch job's flight-recorder dumps",
            _analyze_arguments, cmd_analyze),
)


def build_parser() -> argparse.ArgumentParser:
    """The ``llmtrain`` parser: a subcommand for each of :data:`COMMANDS`, in that order."""
    parser = argparse.ArgumentParser(
        prog="llmtrain", description="FSDP2 + FP8 Llama training that survives failures.",
        epilog="Any config field can be overridden as --section.field VALUE, "
               "e.g. --optim.lr 3e-4 --training.steps 100.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        command.arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs one ``llmtrain`` command; its exit code (:class:`ExitCode`): a configuration
    error, a fatal error or a missing extra is FATAL."""
    log_to_stderr()  # the library's messages, on stderr as they are (llmtrain.log)
    args, rest = build_parser().parse_known_args(argv)
    try:
        return int(args.func(args, rest))
    except ConfigError as e:
        log.error("llmtrain: configuration error: %s", e)
        return ExitCode.FATAL
    except FatalError as e:
        log.error("llmtrain: %s%s", e.what, e)
        return ExitCode.FATAL
    except MissingExtra as e:
        log.error("llmtrain %s: %s", args.command, e)
        return ExitCode.FATAL
