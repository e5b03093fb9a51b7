"""The ``llmtrain`` command.

Exit codes follow :class:`llmtrain.reliability.elastic.ExitCode`: a configuration or data
error is FATAL (a restart would fail the same way), so launchers do not loop on it.
"""

from __future__ import annotations

import argparse
import json
import sys

from llmtrain.config import ConfigError, load_config, parse_overrides, preset_names
from llmtrain.data import ShardError
from llmtrain.reliability.elastic import ExitCode


def _config(args: argparse.Namespace, rest: list[str]):
    return load_config(args.config, parse_overrides(rest))


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    cfg = _config(args, rest)
    from llmtrain.trainer import Trainer  # heavy imports only once the config is good
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    return ExitCode.CLEAN


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmtrain", description="FSDP2 + FP8 Llama training that survives failures.",
        epilog="Any config field can be overridden as --section.field VALUE, "
               "e.g. --optim.lr 3e-4 --training.steps 100.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (("train", cmd_train, "train a model (under torchrun, or alone)"),
                             ("config", cmd_config, "print the resolved config and model size")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default="debug_cpu",
                       help=f"preset ({', '.join(preset_names())}) or a .toml file")
        p.set_defaults(func=func)
    sub.choices["config"].add_argument("--world-size", type=int, default=1,
                                       help="check batch and mesh fit this many ranks")
    args, rest = parser.parse_known_args(argv)
    try:
        return int(args.func(args, rest))
    except ConfigError as e:
        print(f"llmtrain: configuration error: {e}", file=sys.stderr)
        return ExitCode.FATAL
    except ShardError as e:
        print(f"llmtrain: data error: {e}", file=sys.stderr)
        return ExitCode.FATAL
