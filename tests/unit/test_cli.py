"""The ``llmtrain`` command line: one parser builder and one handler per command, and
``main`` mapping what a handler raises to the exit codes launchers act on."""

import argparse
import sys

import pytest

from llmtrain.cli import COMMANDS, build_parser, main
from llmtrain.exit_codes import ExitCode


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub


def test_every_command_has_its_parser_help_and_handler_in_order():
    sub = _subparsers(build_parser())
    assert list(sub.choices) == [c.name for c in COMMANDS] == [
        "train", "spare", "config", "health", "launch", "rdzv-store", "chaos", "stop",
        "report", "ckpt", "data", "analyze"]
    helps = {a.dest: a.help for a in sub._choices_actions}
    for command in COMMANDS:
        assert helps[command.name] == command.help
        assert sub.choices[command.name].get_default("func") is command.run
        assert command.run.__name__ == "cmd_" + command.name.replace("-", "_")


@pytest.mark.parametrize("argv,expected", [
    (["train", "--training.steps", "3"], {"config": "debug_cpu"}),
    (["config", "--config", "x.toml", "--world-size", "8", "--reference"],
     {"config": "x.toml", "world_size": 8, "reference": True}),
    (["health", "--gate", "--json", "--host", "n1"],
     {"gate": True, "json": True, "host": "n1", "config": "debug_cpu"}),
    (["rdzv-store", "--port", "1234", "--exit-when-unused"],
     {"bind": "127.0.0.1", "port": 1234, "exit_when_unused": True, "lease_timeout_s": 30.0}),
    (["chaos", "--nodes", "3", "--spares", "0", "--no-netns", "--script", "a.py"],
     {"nodes": 3, "spares": 0, "no_netns": True, "script": "a.py", "steps": 1000,
      "checkpoint_every": 20, "repair_s": 20.0, "rank": None, "cold": False, "pace": 1}),
    (["chaos", "--pace", "3"], {"pace": 3}),
    (["stop", "runs/x"], {"run_dir": "runs/x", "reason": "asked by llmtrain stop"}),
    (["report", "runs/x", "--out", "o"], {"run_dir": "runs/x", "out": "o"}),
    (["ckpt", "convert", "c", "--to", "dcp", "d"],
     {"action": "convert", "url": "c", "to": ["dcp", "d"], "config": None, "sizes_only": False}),
    (["data", "prepare", "a.txt", "b.txt", "--tokenizer", "t.json", "--out", "o"],
     {"inputs": ["a.txt", "b.txt"], "field": "text", "workers": 0, "shard_tokens": 0}),
    (["analyze", "dumps", "--world-size", "4"], {"dir": "dumps", "world_size": 4,
                                                 "json": False}),
])
def test_each_commands_parser_reads_its_options(argv, expected):
    args, rest = build_parser().parse_known_args(argv)
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.command == argv[0]
    assert rest == (["--training.steps", "3"] if argv[0] == "train" else [])


def test_launch_takes_the_node_agents_options():
    from llmtrain.launch.config import add_arguments
    own = argparse.ArgumentParser()
    add_arguments(own)
    launch = _subparsers(build_parser()).choices["launch"]
    names = {o for a in launch._actions for o in a.option_strings}
    assert {o for a in own._actions for o in a.option_strings} | {"--config"} <= names


def test_an_unknown_command_or_a_missing_argument_is_a_usage_error(capsys):
    for argv in (["nope"], [], ["data", "prepare", "x"], ["ckpt", "bad", "url"]):
        with pytest.raises(SystemExit) as exit:
            main(argv)
        assert exit.value.code == 2, argv


def test_main_runs_the_command_and_returns_its_code(tmp_path, capsys):
    assert main(["ckpt", "list", str(tmp_path)]) == ExitCode.CLEAN
    assert f"no checkpoints under {tmp_path}" in capsys.readouterr().out
    assert main(["analyze", str(tmp_path)]) == 1  # no dumps there


def test_errors_a_restart_would_repeat_exit_fatal(tmp_path, capsys):
    assert main(["stop", str(tmp_path)]) == ExitCode.FATAL  # ConfigError: no run there
    assert "configuration error" in capsys.readouterr().err
    assert main(["ckpt", "list", str(tmp_path), "--unknown"]) == ExitCode.FATAL
    assert main(["config", "--config", str(tmp_path / "none.toml")]) == ExitCode.FATAL


def test_a_missing_extra_exits_fatal_naming_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on an install without it
    assert main(["report", "runs/x"]) == ExitCode.FATAL
    assert "llmtrain report: this command needs the 'report' extra" in capsys.readouterr().err
