"""The session's components talk through declared interfaces, by methods.

Each component with a real and a do-nothing implementation declares one Protocol (the
methods its callers use), which both implementations satisfy, signature for signature,
and which its factory returns. And no component reads (or writes) another's fields: an
AST scan of llmtrain/ finds ``self.<component>.<name>`` and ``<param>.<name>`` (a
parameter named, or annotated, as a component) where ``<name>`` is neither called nor a
method or property of that component's classes, or is private (``_x``, called or not). A component's own ``self.x`` is never a
finding (``x`` is not a component's name), nor are the sub-parts a component builds for
itself (the warm recovery's ``snapshots``, the reporter's ``exporter``, the watchdog's
``plane``): they are parts of one component, not the session's components.
"""

from __future__ import annotations

import ast
import inspect
import types
from functools import cached_property

import pytest

from conftest import ROOT
from llmtrain.checkpoint.interface import Checkpointing, NoCheckpoints
from llmtrain.checkpoint.manager import CheckpointManager, checkpoints_for
from llmtrain.control import RunControl
from llmtrain.distributed.compile_cache import (CompileCache, CompileCaching, NoCompileCache,
                                                compile_cache_for)
from llmtrain.metrics.goodput import GoodputLedger
from llmtrain.metrics.prometheus import Exporter, MetricsExport, NoExporter, start_exporter
from llmtrain.metrics.reporting import Reporter
from llmtrain.recovery.coordinator import (WarmRecovery, mark_reported, warm_recovery,
                                           was_reported)
from llmtrain.recovery.fence import Fence
from llmtrain.recovery.interface import NoWarmRecovery, Recovery
from llmtrain.reliability.guard import IntegrityGuard
from llmtrain.reliability.health.monitor import (HealthMonitor, HealthWatch, NoHealthMonitor,
                                                 start_monitor)
from llmtrain.reliability.integrity import Integrity
from llmtrain.reliability.watchdog import NoWatchdog, Watchdog, WatchdogLike, start_watchdog

# The session's components (llmtrain.api.Session's fields of these names) and the classes
# one may be; a Protocol stands for the pair it declares.
COMPONENTS: dict[str, tuple[type, ...]] = {
    "control": (RunControl,),
    "integrity": (Integrity,),
    "watchdog": (Watchdog, NoWatchdog),
    "health": (HealthMonitor, NoHealthMonitor),
    "checkpoints": (CheckpointManager, NoCheckpoints),
    "recovery": (WarmRecovery, NoWarmRecovery),
    "fence": (Fence,),
    "reporter": (Reporter,),
    "ledger": (GoodputLedger,),
    "guard": (IntegrityGuard,),
}
PROTOCOLS = {WatchdogLike: "watchdog", HealthWatch: "health", Checkpointing: "checkpoints",
             Recovery: "recovery"}
# A type's name in an annotation -> the component it is.
TYPE_NAMES = {cls.__name__: name for name, classes in COMPONENTS.items() for cls in classes}
TYPE_NAMES.update({proto.__name__: name for proto, name in PROTOCOLS.items()})

# Known reads, each of a file this change could not touch; remove an entry once its
# owner offers a method (the test fails on an entry that no longer occurs).
KNOWN: dict[str, str] = {}


def _interface(component: str) -> set[str]:
    """The public names every class of ``component`` defines as a method or a property."""
    def calls(cls: type) -> set[str]:
        names = set()
        for name in dir(cls):
            if name.startswith("_"):
                continue
            value = inspect.getattr_static(cls, name)
            if isinstance(value, (types.FunctionType, property, staticmethod, classmethod,
                                  cached_property)):
                names.add(name)
        return names
    return set.intersection(*(calls(cls) for cls in COMPONENTS[component]))


INTERFACES = {name: _interface(name) for name in COMPONENTS}


def _component_of(annotation: ast.expr | None) -> str | None:
    """The component an annotation names (``Watchdog | None``, ``"Fence | None"``)."""
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    for node in ast.walk(annotation):
        name = (node.id if isinstance(node, ast.Name) else
                node.attr if isinstance(node, ast.Attribute) else None)
        if name in TYPE_NAMES:
            return TYPE_NAMES[name]
    return None


class _Scan(ast.NodeVisitor):
    def __init__(self, where: str):
        self.where, self.found = where, []
        self.classes: list[dict[str, str | None]] = []  # class-level fields: their component
        self.params: list[dict[str, str]] = []  # in scope: parameter -> component
        self.called: set[int] = set()  # ids of attributes that are a call's function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        # a dataclass's field named like a component is what its annotation says (the
        # settings' ``integrity: IntegrityConfig`` is no component)
        self.classes.append({f.target.id: _component_of(f.annotation) for f in node.body
                             if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)})
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node) -> None:
        a = node.args
        params = {}
        for arg in a.posonlyargs + a.args + a.kwonlyargs:
            if arg.annotation is not None:
                component = _component_of(arg.annotation)
            else:
                component = arg.arg if arg.arg in COMPONENTS else None
            if component is not None:
                params[arg.arg] = component
        self.params.append(params)
        self.generic_visit(node)
        self.params.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        self.called.add(id(node.func))
        self.generic_visit(node)

    def _component(self, owner: ast.expr) -> str | None:
        if (isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name)
                and owner.value.id == "self" and owner.attr in COMPONENTS):
            declared = self.classes[-1] if self.classes else {}
            if owner.attr in declared and declared[owner.attr] is None:
                return None  # a field of another type that shares the name
            return declared.get(owner.attr) or owner.attr
        if isinstance(owner, ast.Name):
            for scope in reversed(self.params):
                if owner.id in scope:
                    return scope[owner.id]
        return None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        component = self._component(node.value)
        if component is not None and (node.attr.startswith("_") or (
                id(node) not in self.called and node.attr not in INTERFACES[component])):
            self.found.append(f"{self.where}: {ast.unparse(node)}")
        self.generic_visit(node)


def cross_reads(source: str, where: str) -> list[str]:
    """``where: <expression>`` for each read or write of another component's field."""
    scan = _Scan(where)
    scan.visit(ast.parse(source))
    return scan.found


def test_the_scan_flags_a_field_and_passes_a_method():
    snippet = '''
class Loop:
    def after(self, step):
        if self.control.sdc_named:                  # a field: flagged
            pass
        self.control.vote(step, time_due=False)     # a call: fine
        callback = self.recovery.give_up            # a method, not called: fine
        code = self.control.exit_code               # a property: fine
        self.reporter.spare = True                  # a write: flagged

    def report(self, watchdog, fence: "Fence | None", other: int):
        watchdog.slowdowns()                        # fine
        other.slowdowns                             # not a component: fine
        fence._ask(None)                            # a private method: flagged
        return watchdog._slowdowns, fence.token     # flagged, both


class Settings:
    integrity: IntegrityConfig

    def check(self):
        return self.integrity.skip_steps            # the settings, no component: fine
'''
    assert sorted(cross_reads(snippet, "x.py")) == [
        "x.py: fence._ask", "x.py: fence.token", "x.py: self.control.sdc_named", "x.py: self.reporter.spare",
        "x.py: watchdog._slowdowns"]


def test_no_component_reads_another_components_fields():
    found = set()
    for path in sorted((ROOT / "llmtrain").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        found.update(cross_reads(path.read_text(), where))
    assert not found - set(KNOWN), (
        "a component reads another's fields; give the owner a method:\n"
        + "\n".join(sorted(found - set(KNOWN))))
    assert not set(KNOWN) - found, f"fixed: remove from KNOWN {sorted(set(KNOWN) - found)}"


# -- the Protocols -------------------------------------------------------------------

PAIRS = [
    (Recovery, (WarmRecovery, NoWarmRecovery), warm_recovery),
    (WatchdogLike, (Watchdog, NoWatchdog), start_watchdog),
    (Checkpointing, (CheckpointManager, NoCheckpoints), checkpoints_for),
    (HealthWatch, (HealthMonitor, NoHealthMonitor), start_monitor),
    (MetricsExport, (Exporter, NoExporter), start_exporter),
    (CompileCaching, (CompileCache, NoCompileCache), compile_cache_for),
]


def _methods(cls: type) -> dict[str, types.FunctionType]:
    return {name: value for name in dir(cls) if not name.startswith("_")
            and isinstance(value := inspect.getattr_static(cls, name), types.FunctionType)}


def _shape(fn) -> list[tuple]:
    """A signature as callers see it: names, kinds and defaults (annotations are written
    differently in different modules, e.g. dist.ProcessGroup or none in a no-op)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("protocol,classes,factory", PAIRS,
                         ids=[p.__name__ for p, _, _ in PAIRS])
def test_each_pair_implements_its_protocol(protocol, classes, factory):
    declared = _methods(protocol)
    assert declared, f"{protocol.__name__} declares no method"
    for cls in classes:
        methods = _methods(cls)
        missing = set(declared) - set(methods)
        assert not missing, f"{cls.__name__} lacks {sorted(missing)} of {protocol.__name__}"
        for name, fn in declared.items():
            assert _shape(methods[name]) == _shape(fn), (
                f"{cls.__name__}.{name}{inspect.signature(methods[name])} is not "
                f"{protocol.__name__}.{name}{inspect.signature(fn)}")
    do_nothing = classes[-1]
    extra = set(_methods(do_nothing)) - set(declared)
    assert not extra, (f"{do_nothing.__name__} offers {sorted(extra)}, which "
                       f"{protocol.__name__} does not declare")
    assert inspect.signature(factory).return_annotation == protocol.__name__


def test_a_reported_error_is_marked_as_such():
    error = RuntimeError("a peer was lost")
    assert not was_reported(error)
    mark_reported(error)
    assert was_reported(error) and not was_reported(RuntimeError("another"))
