"""The package's shape: imports flow one way, and training carries no test harness.

Layers, lowest first: a module may import its own layer or a lower one, never a higher
one, and no set of modules may import each other in a loop (imports inside functions
count: they are how the old CLI/launcher loop hid).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

PACKAGE = ROOT / "llmtrain"
LAYERS = [
    {"collector", "config", "configs", "events", "exit_codes", "fsio", "fault_points",  # foundations
     "log", "stop_request", "state_registry", "process_origin"},
    {"model", "optim", "sharded_model", "data", "distributed", "checkpoint", "metrics", "reliability",  # components
     "recovery", "control", "placement", "parts"},
    {"api"},  # the public API: what any training loop, llmtrain's own among them, calls
    {"trainer", "spare_rehearsal"},  # its own loop, and its spares' rehearsal of a step
    {"launch"},
    {"report", "chaos"},  # tools behind extras
    {"cli", "__main__"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}
# What a production install lacks (extras) or training has no use for.
HARNESS = ("llmtrain.chaos", "llmtrain.report", "mfusepy", "fuse", "nfs4fs", "matplotlib",
           "torchx")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The llmtrain module an import names: ``from llmtrain.x import y`` is module
    ``llmtrain.x.y`` when that exists, else ``llmtrain.x``."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            targets |= {t for n in named if n.startswith("llmtrain")
                        and (t := _resolve(n, modules)) not in (None, name, "llmtrain")}
        graph[name] = targets
    return graph


def _unit(module: str) -> str:
    return module.split(".")[1]


def test_every_module_has_a_layer():
    units = {_unit(m) for m in _modules() if m != "llmtrain"}
    assert units <= set(LAYER), f"put {sorted(units - set(LAYER))} in a layer of LAYERS"


def test_no_import_runs_up_the_layers():
    upward = [f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
              if a != "llmtrain" and LAYER[_unit(b)] > LAYER[_unit(a)]]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles():
    graph = import_graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # The package level too: llmtrain.launch may not import what imports llmtrain.launch.
    units: dict[str, set[str]] = {}
    for a, targets in graph.items():
        if a != "llmtrain":
            units.setdefault(_unit(a), set()).update(_unit(b) for b in targets if _unit(b) != _unit(a))
    cycle = _cycle(units)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_the_checks_themselves_catch_a_cycle_and_an_upward_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "llmtrain.reliability.health.gate" in graph["llmtrain.launch.node"]
    assert "llmtrain.launch.worker" in graph["llmtrain.cli"]  # imported inside a function


@pytest.mark.parametrize("entry", ["llmtrain.trainer", "llmtrain.launch.worker",
                                   "llmtrain.launch.node", "llmtrain.cli"])
def test_training_does_not_import_the_harness(entry):
    """What `llmtrain train` loads carries no fault harness, FUSE or plotting code."""
    code = f"import json, sys, {entry}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    loaded = json.loads(out)
    assert "llmtrain.fault_points" in loaded or entry != "llmtrain.trainer"
    assert not [m for m in loaded if m.startswith(HARNESS)]


# What llmtrain's own loop may import besides the public API: what builds its model, its
# optimizer and its data, and the fault points its loss passes (what chaos poisons).
# Reliability (checkpoints, recovery, the watchdog, health, control, metrics, the state
# registry) is reached through llmtrain.api alone, as any other loop reaches it.
TRAINER_MAY_IMPORT = {"llmtrain.api", "llmtrain.config", "llmtrain.model", "llmtrain.optim",
                      "llmtrain.sharded_model", "llmtrain.data.sampler", "llmtrain.fault_points",
                      "llmtrain.distributed.parallelize", "llmtrain.distributed.compile_cache"}


def test_the_trainer_reaches_reliability_only_through_the_api():
    graph = import_graph()
    beyond = graph["llmtrain.trainer"] - TRAINER_MAY_IMPORT
    assert not beyond, f"llmtrain.trainer imports {sorted(beyond)}: go through llmtrain.api"
    assert "llmtrain.api" in graph["llmtrain.trainer"]
    # the check sees what it names: the API itself reaches every component
    assert {"llmtrain.recovery.coordinator", "llmtrain.checkpoint.manager",
            "llmtrain.reliability.watchdog"} <= graph["llmtrain.api"]


def test_the_public_api_is_the_package_all():
    code = "import sys, llmtrain; print(llmtrain.__all__, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    import llmtrain
    import llmtrain.api
    assert llmtrain.__all__ == llmtrain.api.__all__
    assert out.strip().endswith("False"), "import llmtrain imported torch (the CLI's start)"
    for name in llmtrain.__all__:
        obj = getattr(llmtrain, name)
        assert obj is getattr(llmtrain.api, name)
        assert (obj.__doc__ or "").strip(), f"llmtrain.{name} has no docstring"
