"""The library logs through ``logging`` and never prints a diagnostic, so a program that
uses it sees its messages in its own handlers; llmtrain's own processes (the CLI, torchrun's
agent, faultfs) print them on stderr as they are (llmtrain/log.py)."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys

import pytest

from conftest import ROOT
from llmtrain import fault_points
from llmtrain.exit_codes import ExitCode
from llmtrain.log import LOGGER, log_to_stderr

PACKAGE = ROOT / "llmtrain"
# Modules whose prints are a command's output on stdout, not messages about the run:
OUTPUT = {
    "llmtrain/cli.py",  # TOML/JSON, checkpoint tables, report paths, verdicts
    "llmtrain/chaos/runner.py",  # a verdict's row of the chaos summary table, as it comes
    "llmtrain/reliability/health/gate.py",  # the gate's findings table (or JSON)
    "llmtrain/launch/store.py",  # "serving HOST:PORT" (read by whoever started it), its end
}
# The processes llmtrain starts itself: the one place each installs the stderr handler.
ENTRY_POINTS = {("llmtrain/cli.py", "main"), ("llmtrain/launch/agent.py", "main"),
                ("llmtrain/chaos/faultfs.py", "main")}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def test_the_library_logs_and_prints_only_a_commands_output():
    """No ``print`` to stderr (nor ``sys.stderr.write``, ``traceback.print_*``): a message
    about the run is a log record. A print on stdout is a command's output, in the modules
    of OUTPUT only."""
    found = []
    for name, tree in _sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = _dotted(node.func)
            where = f"{name}:{node.lineno}"
            if called == "print":
                file = next((_dotted(k.value) for k in node.keywords if k.arg == "file"), None)
                if file not in (None, "sys.stdout"):
                    found.append(f"{where}: print(file={file}): log it (llmtrain/log.py)")
                elif file in (None, "sys.stdout") and name not in OUTPUT:
                    found.append(f"{where}: print on stdout: log it, or add the module to "
                                 f"OUTPUT if this is a command's output")
            elif called in ("sys.stderr.write", "sys.__stderr__.write", "sys.stdout.write") \
                    or called.startswith("traceback.print_"):
                found.append(f"{where}: {called}: log it (log.exception for a traceback)")
    assert not found, "\n".join(found)


def test_no_handler_is_installed_but_by_a_process_entry_point():
    """Importing llmtrain installs no handler and configures no logging: only the entry
    points of llmtrain's own processes call log_to_stderr, from their main()."""
    found, callers = [], set()
    for name, tree in _sources():
        functions = [n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        inside = {id(c): f.name for f in functions for c in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = _dotted(node.func)
            if called.endswith((".addHandler", "basicConfig", "dictConfig", "fileConfig")) \
                    and name != "llmtrain/log.py":
                found.append(f"{name}:{node.lineno}: {called}")
            if called.endswith("log_to_stderr"):
                callers.add((name, inside.get(id(node), "<module>")))
    assert not found, "logging configured outside llmtrain/log.py:\n" + "\n".join(found)
    assert callers == ENTRY_POINTS


def test_a_message_reaches_the_users_handler(monkeypatch):
    """A program's own handler on the ``llmtrain`` logger gets the library's messages,
    by module (here fault_points' warning about faults the environment names)."""
    monkeypatch.setenv("LLMTRAIN_FAULTS", "kill@step:rank=0,step=1")
    records = []

    class Mine(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger, handler = logging.getLogger("llmtrain"), Mine()
    logger.addHandler(handler)
    try:
        fault_points.install("", rank=0)
    finally:
        logger.removeHandler(handler)
        fault_points._injector = None
    (record,) = records
    assert record.name == "llmtrain.fault_points" and record.levelno == logging.WARNING
    assert record.getMessage().startswith("llmtrain: warning: ignoring $LLMTRAIN_FAULTS:")


@pytest.fixture
def cli_logging():
    """The ``llmtrain`` logger as it is, back after the test (log_to_stderr changes it)."""
    logger = logging.getLogger(LOGGER)
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)
    logger.propagate = propagate


def test_an_entry_point_prints_each_message_bare_on_stderr(cli_logging, capsys):
    logger = cli_logging
    handler = log_to_stderr()
    assert log_to_stderr() is handler and logger.handlers.count(handler) == 1
    assert not logger.propagate  # said once, not again by a handler of the root's
    logging.getLogger("llmtrain.some.module").info("llmtrain: a %s", "message")
    logging.getLogger("llmtrain.some.module").debug("not this")
    assert capsys.readouterr() == ("", "llmtrain: a message\n")


def test_the_cli_says_as_before_and_importing_configures_nothing():
    """``python -m llmtrain``: the message on stderr as the print said it, nothing on
    stdout; importing the package and the launcher left logging as it was."""
    code = ("import logging, sys; import llmtrain.cli as cli, llmtrain.launch.node; "
            "assert not logging.getLogger('llmtrain').handlers and not logging.root.handlers; "
            "raise SystemExit(cli.main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "config", "--config", "/nowhere.toml"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == ExitCode.FATAL, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert proc.stderr == ("llmtrain: configuration error: config file '/nowhere.toml' does "
                           "not exist\n")
