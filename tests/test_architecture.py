"""The map, enforced: imports between rankmesh's modules flow one way, and the front door stays small.

Every file under ``src/rankmesh`` is parsed with :mod:`ast` (nothing is imported), and every
import statement is read, module level and function level alike: a function-level import runs
as surely as a top-level one, so it counts for cycles and arrows.  Imports under
``if TYPE_CHECKING:`` are left out: they never run, and annotations may point anywhere.

Resolution: ``from rankmesh.data import proto`` names the module ``rankmesh.data.proto``;
``from rankmesh.data import DataProto`` names the package ``rankmesh.data`` (its ``__init__``);
``from torch import distributed`` names ``torch.distributed``.
Importing ``rankmesh.a.b`` does not count as importing the package ``rankmesh.a`` (Python runs
the package's ``__init__`` first, but counting that would make every package a cycle with its
own modules).  Names a package loads on first use (``rankmesh.lazy.lazy_exports`` tables) are
strings, not imports, and the scan does not read them; the front door's, which hold every public
name, are checked against the layers on their own.

Module-level state (:func:`module_state`) is read the same way: every module-level mutable
object must be on the list in docs/architecture.md, "Process-global state", with the reason it
must be process-global; the test reads that list from the page, so the two cannot drift.

The layers (:data:`LAYERS`) are data: each module belongs to the layer of its longest matching
prefix, and may import its own layer (the cycle check keeps that one-way) or a layer of a
strictly lower rank.  Two layers of equal rank know nothing of each other.  The third-party
rules (:data:`ONLY_UNDER`) say where Ray, megatron-core and torch.distributed may be imported.
docs/architecture.md draws the same map in words.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "rankmesh"

#: layer name -> (rank, module prefixes).  A module imports only its own layer or lower ranks.
#: A prefix covers the module of that name and everything under it ("rankmesh" itself covers
#: only the package's ``__init__``).
LAYERS: dict[str, tuple[int, tuple[str, ...]]] = {
    # Import nothing from the package at all (checked separately, see FOUNDATION).
    "foundation": (0, ("rankmesh.errors", "rankmesh.validate", "rankmesh.lazy", "rankmesh.deadline")),
    "mesh": (1, ("rankmesh.mesh",)),
    "serialization": (1, ("rankmesh.serialization", "rankmesh.sharedmem", "rankmesh.peermem", "rankmesh.ring")),
    "placement": (2, ("rankmesh.placement",)),
    "reshard planner": (2, ("rankmesh.reshard",)),
    "data": (2, ("rankmesh.data",)),
    "hangs": (2, ("rankmesh.hangs",)),
    "dispatch": (3, ("rankmesh.dispatch",)),
    "layout": (3, ("rankmesh.layout",)),
    "tracing": (3, ("rankmesh.tracing",)),
    # Imports nothing from the package; rank 2 so that dispatch's @register checks its receive vocabulary.
    "backend contract": (2, ("rankmesh.backend",)),
    "worker": (5, ("rankmesh.worker", "rankmesh.devices", "rankmesh.rendezvous")),
    "groups": (6, ("rankmesh.group", "rankmesh.binding", "rankmesh.replicas", "rankmesh.futures")),
    # Reshard's worker methods (on Worker) and its controller side (through the groups' call_ranks,
    # which it calls but never imports): backend-neutral, below every backend.
    "reshard": (6, ("rankmesh.reshard.worker", "rankmesh.reshard.run")),
    "backends": (7, ("rankmesh.backends",)),
    "front door": (8, ("rankmesh",)),
    "compat": (8, ("rankmesh.compat",)),
    "megatron": (8, ("rankmesh.megatron",)),
    # Test and script helpers (the namespaced cluster): they drive processes, and nothing imports them.
    "testing": (9, ("rankmesh.testing",)),
    "tools": (9, ("rankmesh.demo", "rankmesh.demo_async", "rankmesh.demo_cli", "rankmesh.demo_config", "rankmesh.demo_hang", "rankmesh.draw", "rankmesh.cli", "rankmesh.__main__", "rankmesh.tracing.plot")),
}

#: Layers that import nothing from the package: everything else may lean on them.
FOUNDATION = "foundation"

#: Third-party module -> the rankmesh prefixes allowed to import it.
ONLY_UNDER: dict[str, tuple[str, ...]] = {
    # data knows no Ray; the groups and the dispatch layer are backend-neutral.
    "ray": ("rankmesh.backends.ray", "rankmesh.compat"),
    # megatron-core is heavy (~3 s) and optional: only rankmesh.megatron may load it.
    "megatron": ("rankmesh.megatron",),
    # Process groups are a worker-side concern: the rendezvous, megatron's workers, and the
    # mesh's optional torch DeviceMesh view.
    "torch.distributed": ("rankmesh.rendezvous", "rankmesh.backends.ray", "rankmesh.megatron", "rankmesh.mesh"),
    # tensordict imports torch._dynamo (~1 CPU-s a process): reached through one module, on first use.
    "tensordict": ("rankmesh.data.tensordicts",),
}


#: The Ray backend along the process boundary: module -> the modules of the other side it must
#: not reach, directly or through any chain of imports (a module's parent packages count: Python
#: runs them first).  The host runs in every worker process; the controller-side modules (launching
#: hosts, carrying and waiting on calls, the group, the trace recorder) never run there.
PROCESS_BOUNDARY: dict[str, tuple[str, ...]] = {
    "rankmesh.backends.ray.host": (
        "rankmesh.backends.ray.agent",
        "rankmesh.backends.ray.classes",
        "rankmesh.backends.ray.executor",
        "rankmesh.backends.ray.group",
        "rankmesh.backends.ray.hangs",
        "rankmesh.backends.ray.hosts",
        "rankmesh.backends.ray.order",
        "rankmesh.backends.ray.pool",
        "rankmesh.backends.ray.recovery",
        "rankmesh.backends.ray.remesh",
        "rankmesh.backends.ray.session",
        "rankmesh.backends.ray.spares",
        "rankmesh.backends.ray.startup",
        "rankmesh.backends.ray.tasks",
        "rankmesh.backends.ray.waiting",
        "rankmesh.group",
        "rankmesh.replicas",
        "rankmesh.futures",
        "rankmesh.tracing.recorder",
    ),
}

# The warm process and the ranks it forks run the host's side, and never the holder's.
PROCESS_BOUNDARY["rankmesh.backends.ray.warm"] = (*PROCESS_BOUNDARY["rankmesh.backends.ray.host"], "rankmesh.backends.ray.forked")

#: The module every exception class lives in.
ERRORS_MODULE = "rankmesh.errors"

ARCHITECTURE_DOC = SRC.parent / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is written, and whether it runs at import time."""

    source: str  # importing module
    target: str  # imported module (rankmesh modules resolved to a file of this tree)
    file: Path
    line: int
    in_function: bool

    def where(self) -> str:
        level = "function-level " if self.in_function else ""
        return f"{self.file.relative_to(SRC.parent)}:{self.line}: {level}import of {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool = False):
    """Every import node under ``node`` with its function-level flag, skipping ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _walk(other, in_function)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner)


def imports_of(name: str, path: Path, modules: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node, in_function in _walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            internal = base == PACKAGE or base.startswith(PACKAGE + ".")
            for alias in node.names:
                dotted = f"{base}.{alias.name}"
                # rankmesh: the submodule if there is one, else the package; third-party: the
                # dotted name, so that ``from torch import distributed`` reads as torch.distributed.
                targets.append(dotted if dotted in modules or not internal else base)
        for target in dict.fromkeys(targets):
            found.append(Import(name, target, path, node.lineno, in_function))
    return found


def all_imports() -> list[Import]:
    files = source_files()
    modules = set(files)
    return [imp for name, path in files.items() for imp in imports_of(name, path, modules)]


def layer_of(module: str) -> str:
    best, length = None, -1
    for layer, (_, prefixes) in LAYERS.items():
        for prefix in prefixes:
            # The package itself names only its __init__: a new module must be given a layer.
            covers = module == prefix or (prefix != PACKAGE and module.startswith(prefix + "."))
            if covers and len(prefix) > length:
                best, length = layer, len(prefix)
    assert best is not None, f"{module} is in no layer of tests/test_architecture.py LAYERS"
    return best


def _internal(imports: list[Import]) -> list[Import]:
    return [i for i in imports if i.target == PACKAGE or i.target.startswith(PACKAGE + ".")]


def find_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    graph: dict[str, set[str]] = {}
    for imp in _internal(imports):
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan; the graph has ~70 nodes, recursion is fine
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


# ----- the import graph ------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    missing = []
    for name in source_files():
        try:
            layer_of(name)
        except AssertionError as exc:
            missing.append(str(exc))
    assert not missing, "\n".join(missing)


def test_no_import_cycles() -> None:
    imports = all_imports()
    cycles = find_cycles(imports)
    lines = []
    for component in cycles:
        members = set(component)
        lines.append(f"cycle between {', '.join(component)}:")
        lines += [
            f"  {imp.where()}"
            for imp in _internal(imports)
            if imp.source in members and imp.target in members
        ]
    assert not cycles, "import cycles (imports must flow one way):\n" + "\n".join(lines)


def test_imports_go_down_the_layers() -> None:
    bad = []
    for imp in _internal(all_imports()):
        src_layer, dst_layer = layer_of(imp.source), layer_of(imp.target)
        if src_layer == dst_layer:
            continue
        src_rank, dst_rank = LAYERS[src_layer][0], LAYERS[dst_layer][0]
        if src_layer == FOUNDATION or dst_rank >= src_rank:
            bad.append(f"{imp.where()}: layer {src_layer!r} (rank {src_rank}) may not import layer {dst_layer!r} (rank {dst_rank})")
    assert not bad, "imports against the layers (see LAYERS in tests/test_architecture.py):\n" + "\n".join(bad)


def test_the_front_doors_lazy_names_go_down_the_layers() -> None:
    """The front door imports nothing at import time: its names are strings (``rankmesh.NAMES``,
    ``rankmesh.RAY_NAMES``) that the import scan above does not read, so their arrows are checked here."""
    import rankmesh

    rank = LAYERS[layer_of(PACKAGE)][0]
    bad = [f"rankmesh.{name} -> {module} (layer {layer_of(module)!r})"
           for name, module in {**rankmesh.NAMES, **rankmesh.RAY_NAMES}.items()
           if LAYERS[layer_of(module)][0] >= rank]
    assert not bad, "front-door names loaded from a layer at or above the front door:\n" + "\n".join(bad)


def test_foundation_imports_nothing_from_the_package() -> None:
    bad = [imp.where() for imp in _internal(all_imports()) if layer_of(imp.source) == FOUNDATION]
    assert not bad, "errors, validate and lazy must import nothing from rankmesh:\n" + "\n".join(bad)


def test_heavy_dependencies_stay_in_their_layers() -> None:
    bad = []
    for imp in all_imports():
        for dependency, allowed in ONLY_UNDER.items():
            if imp.target != dependency and not imp.target.startswith(dependency + "."):
                continue
            if not any(imp.source == p or imp.source.startswith(p + ".") for p in allowed):
                bad.append(f"{imp.where()}: {dependency} may be imported only under {', '.join(allowed)}")
    assert not bad, "third-party imports outside their layers:\n" + "\n".join(bad)


def test_no_private_name_is_imported_across_modules() -> None:
    files = source_files()
    bad = []
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, _ in _walk(tree):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    bad.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: imports {', '.join(private)}")
    assert not bad, "a _private name belongs to its module; make it public or move the code:\n" + "\n".join(bad)


def reached_from(start: str, imports: list[Import], internal_only: bool = True) -> dict[str, Import | None]:
    """Every rankmesh module (every module, with ``internal_only=False``) importing ``start`` runs,
    with the import that first reached it (``None`` for ``start`` and for parent packages, which
    Python runs before their modules)."""
    graph: dict[str, list[Import]] = {}
    for imp in _internal(imports) if internal_only else imports:
        graph.setdefault(imp.source, []).append(imp)
    seen: dict[str, Import | None] = {start: None}
    todo = [start]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        parents = [".".join(parts[:k]) for k in range(1, len(parts))]
        for target, via in [*((p, None) for p in parents), *((i.target, i) for i in graph.get(module, ()))]:
            if target not in seen:
                seen[target] = via
                todo.append(target)
    return seen


def import_chain(seen: dict[str, Import | None], module: str) -> list[str]:
    chain = []
    while seen.get(module) is not None:
        imp = seen[module]
        chain.append(imp.where())
        module = imp.source
    return list(reversed(chain))


def test_the_worker_process_side_of_ray_reaches_no_controller_side_module() -> None:
    imports = all_imports()
    bad = []
    for start, forbidden in PROCESS_BOUNDARY.items():
        seen = reached_from(start, imports)
        for module in sorted(seen):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                bad.append(f"{start} reaches {module}:\n    " + "\n    ".join(import_chain(seen, module) or ["(a parent package)"]))
    assert not bad, "the worker-process side imports the controller side:\n" + "\n".join(bad)


#: What a forked rank's holder (:mod:`rankmesh.backends.ray.forked`) must not load when its
#: process starts: it holds a bundle and forwards calls, and loading these would cost what forking saves.
HOLDER_MUST_NOT_LOAD = ("torch", "tensordict", "megatron", "rankmesh.backends.ray.host", "rankmesh.backends.ray.wire",
                        "rankmesh.data", "rankmesh.worker")


def loaded_at_start(start: str, imports: list[Import]) -> dict[str, Import | None]:
    """Every module importing ``start`` loads at once (imports inside functions wait for their call), third-party ones too."""
    return reached_from(start, [imp for imp in imports if not imp.in_function], internal_only=False)


def test_a_forked_ranks_holder_loads_neither_torch_nor_the_rank_side_at_start() -> None:
    seen = loaded_at_start("rankmesh.backends.ray.forked", all_imports())
    bad = [m for m in sorted(seen) if any(m == f or m.startswith(f + ".") for f in HOLDER_MUST_NOT_LOAD)]
    assert not bad, "the holder's start loads:\n" + "\n".join(
        f"{m}:\n    " + "\n    ".join(import_chain(seen, m)) for m in bad)


def test_the_holder_check_sees_a_heavy_import_two_modules_away() -> None:
    imports = [
        Import("rankmesh.backends.ray.forked", "rankmesh.backends.ray.warm", SRC / "a.py", 1, False),
        Import("rankmesh.backends.ray.warm", "torch", SRC / "b.py", 2, False),
        Import("rankmesh.backends.ray.warm", "rankmesh.backends.ray.host", SRC / "b.py", 3, True),
    ]
    seen = loaded_at_start("rankmesh.backends.ray.forked", imports)
    assert "torch" in seen and "rankmesh.backends.ray.host" not in seen


def test_the_boundary_check_follows_chains_of_imports() -> None:
    """A controller module two imports away from the host is found, with the chain that reaches it."""
    imports = [
        Import("rankmesh.backends.ray.host", "rankmesh.backends.ray.serve", SRC / "a.py", 1, False),
        Import("rankmesh.backends.ray.serve", "rankmesh.backends.ray.waiting", SRC / "b.py", 2, True),
    ]
    seen = reached_from("rankmesh.backends.ray.host", imports)
    assert "rankmesh.backends.ray.waiting" in seen and "rankmesh.backends" in seen  # the parents run too
    assert len(import_chain(seen, "rankmesh.backends.ray.waiting")) == 2


def _is_exception_class(node: ast.ClassDef) -> bool:
    names = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases]
    return any(n.endswith(("Error", "Exception", "Warning")) or n in ("Exception", "BaseException") for n in names)


def test_every_exception_class_lives_in_errors_py() -> None:
    bad = []
    for name, path in source_files().items():
        if name == ERRORS_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and _is_exception_class(node):
                bad.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: class {node.name}")
    assert not bad, "exception classes belong in src/rankmesh/errors.py:\n" + "\n".join(bad)


def test_the_architecture_doc_names_every_module() -> None:
    text = ARCHITECTURE_DOC.read_text(encoding="utf-8")
    missing = [name for name in source_files() if f"`{name}`" not in text]
    assert not missing, f"docs/architecture.md does not list: {', '.join(missing)}"


# ----- the checker itself (hand-made graphs) ---------------------------------------------------


def _imp(source: str, target: str) -> Import:
    return Import(source, target, SRC / "rankmesh" / "x.py", 1, False)


def test_the_cycle_finder_finds_hand_made_cycles() -> None:
    imports = [
        _imp("rankmesh.a", "rankmesh.b"),
        _imp("rankmesh.b", "rankmesh.c"),
        _imp("rankmesh.c", "rankmesh.a"),
        _imp("rankmesh.c", "rankmesh.d"),
        _imp("rankmesh.e", "rankmesh.e"),
        _imp("rankmesh.f", "ray"),
    ]
    assert find_cycles(imports) == [["rankmesh.a", "rankmesh.b", "rankmesh.c"], ["rankmesh.e"]]
    assert find_cycles(imports[:2]) == []


def test_function_level_and_relative_imports_are_read(tmp_path: Path) -> None:
    path = tmp_path / "__init__.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import spec\n"
        "from .spec import Thing\n"
        "if TYPE_CHECKING:\n"
        "    from rankmesh.hidden import X\n"
        "def f():\n"
        "    from ..mesh import RankMesh\n"
        "    import ray\n"
        "    from torch import distributed\n"
    )
    found = imports_of("rankmesh.layout", path, {"rankmesh.layout.spec", "rankmesh.mesh"})
    assert [(i.target, i.line, i.in_function) for i in found] == [
        ("typing.TYPE_CHECKING", 1, False),
        ("rankmesh.layout.spec", 2, False),
        ("rankmesh.layout.spec", 3, False),
        ("rankmesh.mesh", 7, True),
        ("ray", 8, True),
        ("torch.distributed", 9, True),
    ]


# ----- module-level state ---------------------------------------------------------------------
#
# What counts as a module-level mutable object (a registry or switch with no owner), found by
# parsing each module, nothing imported:
#
# * a name bound at module level (also inside a module-level ``if``/``try``/``with``) or in the
#   body of a module-level class, to a dict/list/set literal or comprehension, to a call of one
#   of :data:`MUTABLE_CALLS` (resolved through the module's imports), or to an instance of a
#   class of the package that is not frozen (a ``@dataclass(frozen=True)``, a NamedTuple or an
#   Enum, or a class with ``__slots__ = ()``, is frozen);
# * a module-level name a function rebinds under ``global``;
# * a class attribute a classmethod or metaclass method rebinds (``cls.NAME = ...``).
#
# Not counted: ``__all__`` (the import system's list), constants of immutable types (tuple,
# frozenset, types.MappingProxyType, str, numbers), calls of functions or third-party classes
# outside MUTABLE_CALLS (a compiled regex, a logger, a timedelta), and functools caches (a memo
# of a pure function is a constant computed late).  A constant table is made immutable rather
# than listed.

#: Calls that build a mutable object, by the dotted name the callee resolves to.
MUTABLE_CALLS = frozenset({
    "dict", "list", "set", "bytearray",
    "collections.defaultdict", "collections.OrderedDict", "collections.Counter", "collections.deque",
    "threading.local", "threading.Lock", "threading.RLock", "threading.Event", "threading.Condition",
    "threading.Semaphore", "queue.Queue", "contextvars.ContextVar", "itertools.count",
    "weakref.WeakValueDictionary", "weakref.WeakKeyDictionary", "weakref.WeakSet",
    "numpy.empty", "numpy.zeros", "numpy.ones", "numpy.array", "torch.empty", "torch.zeros",
})

#: The section of docs/architecture.md that lists the allowed process-global objects.
STATE_SECTION = "## Process-global state"

_MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
_FROZEN_BASES = {"NamedTuple", "Enum", "IntEnum", "StrEnum", "Flag", "IntFlag"}


@dataclass(frozen=True)
class StateObject:
    """One module-level mutable object: ``name`` is ``NAME`` or ``Class.NAME``."""

    module: str
    name: str
    file: str
    line: int
    what: str  # why it counts as mutable

    def where(self) -> str:
        return f"{self.file}:{self.line}: {self.module}.{self.name} ({self.what})"


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _is_frozen_class(node: ast.ClassDef) -> bool:
    for deco in node.decorator_list:
        if isinstance(deco, ast.Call) and (_dotted(deco.func) or "").split(".")[-1] == "dataclass":
            if any(k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True for k in deco.keywords):
                return True
    if any((_dotted(b) or "").split(".")[-1] in _FROZEN_BASES for b in node.bases):
        return True
    return any(
        isinstance(stmt, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets)
        and isinstance(stmt.value, ast.Tuple) and not stmt.value.elts
        for stmt in node.body
    )


def package_classes(files: dict[str, Path]) -> dict[str, bool]:
    """``module.Class`` -> frozen?, for every module-level class of the package."""
    out = {}
    for name, path in files.items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                out[f"{name}.{node.name}"] = _is_frozen_class(node)
    return out


def _aliases(tree: ast.Module, module: str, is_package: bool) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from the module's top-level imports."""
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}"
    out.setdefault("np", "numpy")
    return out


def _module_level(body: list[ast.stmt]):
    """Statements of a module body, descending into module-level if/try/with, not into defs."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.With, ast.For, ast.While)):
            yield from _module_level(stmt.body + getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Try):
            yield from _module_level(stmt.body + stmt.orelse + stmt.finalbody + [s for h in stmt.handlers for s in h.body])


def _bindings(stmt: ast.stmt):
    """``(name, value)`` pairs a statement binds (tuple targets matched element by element)."""
    if isinstance(stmt, ast.Assign):
        pairs = [(t, stmt.value) for t in stmt.targets]
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        pairs = [(stmt.target, stmt.value)]
    else:
        return
    for target, value in pairs:
        if isinstance(target, ast.Name):
            yield target.id, value
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                if isinstance(t, ast.Name):
                    yield t.id, v


def module_state(module: str, source: str, file: str, classes: dict[str, bool], is_package: bool = False) -> list[StateObject]:
    """Every module-level mutable object of ``source`` (see the rules above)."""
    tree = ast.parse(source, filename=file)
    aliases = _aliases(tree, module, is_package)
    local_classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    by_short: dict[str, list[bool]] = {}
    for dotted, frozen in classes.items():
        by_short.setdefault(dotted.rsplit(".", 1)[-1], []).append(frozen)

    def mutable(value: ast.expr) -> str | None:
        if isinstance(value, _MUTABLE_LITERALS):
            return f"a {type(value).__name__.lower()}"
        if not isinstance(value, ast.Call):
            return None
        callee = _dotted(value.func)
        if callee is None:
            return None
        head, _, rest = callee.partition(".")
        if head in local_classes and not rest:
            resolved = f"{module}.{head}"
        else:
            resolved = aliases.get(head, head) + (f".{rest}" if rest else "")
        if resolved in MUTABLE_CALLS:
            return f"{resolved}()"
        frozen = classes.get(resolved)
        if frozen is None and resolved.startswith(f"{PACKAGE}."):  # a re-export: match the class name
            found = by_short.get(resolved.rsplit(".", 1)[-1], [])
            frozen = all(found) if found else None
        if frozen is False:
            return f"an instance of {resolved.rsplit('.', 1)[-1]}, not frozen"
        return None

    found: dict[str, StateObject] = {}

    def add(name: str, line: int, what: str) -> None:
        found.setdefault(name, StateObject(module, name, file, line, what))

    top_lines: dict[str, int] = {}
    for stmt in _module_level(tree.body):
        for name, value in _bindings(stmt):
            top_lines.setdefault(name, stmt.lineno)
            what = mutable(value)
            if what and name != "__all__":
                add(name, stmt.lineno, what)
        if isinstance(stmt, ast.ClassDef):
            class_attrs: dict[str, int] = {}
            for inner in stmt.body:
                for name, value in _bindings(inner):
                    class_attrs.setdefault(name, inner.lineno)
                    what = mutable(value)
                    if what:
                        add(f"{stmt.name}.{name}", inner.lineno, what)
            for fn in ast.walk(stmt):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
                    continue
                first = fn.args.args[0].arg
                if first != "cls":
                    continue
                for node in ast.walk(fn):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == first and t.attr in class_attrs:
                            add(f"{stmt.name}.{t.attr}", class_attrs[t.attr], f"rebound by {fn.name}() at line {node.lineno}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Global):
                    for name in inner.names:
                        add(name, top_lines.get(name, inner.lineno), f"rebound under `global` in {node.name}()")
    return sorted(found.values(), key=lambda o: o.line)


def all_module_state() -> list[StateObject]:
    files = source_files()
    classes = package_classes(files)
    out = []
    for name, path in files.items():
        rel = str(path.relative_to(SRC.parent))
        out += module_state(name, path.read_text(encoding="utf-8"), rel, classes, path.name == "__init__.py")
    return out


@dataclass(frozen=True)
class AllowedState:
    """One row of docs/architecture.md's "Process-global state" tables."""

    module: str
    name: str
    why: str
    heading: str  # the table's heading: the main list, or a block marked "to be removed"


def allowed_state(text: str | None = None) -> list[AllowedState]:
    """The rows of the tables under :data:`STATE_SECTION` (up to the next ``## `` heading)."""
    text = ARCHITECTURE_DOC.read_text(encoding="utf-8") if text is None else text
    assert STATE_SECTION in text, f"docs/architecture.md has no {STATE_SECTION!r} section"
    section = text.split(STATE_SECTION, 1)[1].split("\n## ", 1)[0]
    rows, heading = [], STATE_SECTION
    for line in section.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
        m = re.match(r"^\|\s*`([\w.]+)`\s*\|\s*`([\w.]+)`\s*\|(.*)\|\s*$", line)
        if m:
            rows.append(AllowedState(m.group(1), m.group(2), m.group(3).strip(), heading))
    return rows


def test_every_module_level_mutable_object_is_on_the_process_global_list() -> None:
    allowed = {(row.module, row.name) for row in allowed_state()}
    bad = [obj.where() for obj in all_module_state() if (obj.module, obj.name) not in allowed]
    assert not bad, (
        "module-level mutable state without an owner (make it an attribute of the object whose "
        "lifetime it shares, pass it explicitly, make a constant table immutable, or, if it must be "
        f"process-global, add a row with the reason to docs/architecture.md, {STATE_SECTION!r}):\n" + "\n".join(bad)
    )


def test_the_process_global_list_names_only_objects_that_exist_and_says_why() -> None:
    rows = allowed_state()
    found = {(obj.module, obj.name) for obj in all_module_state()}
    stale = [f"{r.module} {r.name}" for r in rows if (r.module, r.name) not in found]
    assert not stale, f"docs/architecture.md, {STATE_SECTION!r}, lists objects that are gone or no longer mutable: {stale}"
    assert len({(r.module, r.name) for r in rows}) == len(rows), "a row is listed twice"
    assert all(r.why for r in rows), "every row says why the object must be process-global"


_SYNTHETIC = """\
import threading
import itertools as it
from dataclasses import dataclass
from types import MappingProxyType
from weakref import WeakValueDictionary

TABLE = MappingProxyType({"a": 1})
NAMES = frozenset({"x"})
ORDER = ("a", "b")
__all__ = ["TABLE"]


@dataclass(frozen=True)
class Point:
    x: int = 0


class Box:
    shared = []

    def __init__(self):
        self.items = {}

    @classmethod
    def switch(cls, on):
        cls.enabled = on

    enabled = False


ORIGIN = Point()
_CACHE = {}
if True:
    _SEEN: set[int] = set()
_LOCAL = threading.local()
_IDS = it.count(1)
_BY_TOKEN = WeakValueDictionary()
_BOX = Box()
_FLAG = None


def f():
    local = {}
    global _FLAG
    _FLAG = local
"""


def test_the_state_guard_flags_a_new_module_level_registry() -> None:
    """The guard is honest: a hand-written module with each kind of state, and constants beside them."""
    found = module_state("rankmesh.synthetic", _SYNTHETIC, "src/rankmesh/synthetic.py", {"rankmesh.other.Box": False})
    assert [(o.name, o.line) for o in found] == [
        ("Box.shared", 19),
        ("Box.enabled", 28),
        ("_CACHE", 32),
        ("_SEEN", 34),
        ("_LOCAL", 35),
        ("_IDS", 36),
        ("_BY_TOKEN", 37),
        ("_BOX", 38),
        ("_FLAG", 39),
    ]
    by_name = {o.name: o for o in found}
    assert by_name["_CACHE"].where() == "src/rankmesh/synthetic.py:32: rankmesh.synthetic._CACHE (a dict)"
    assert by_name["_LOCAL"].what == "threading.local()" and by_name["_IDS"].what == "itertools.count()"
    assert by_name["_BOX"].what == "an instance of Box, not frozen"
    assert by_name["Box.enabled"].what == "rebound by switch() at line 26"
    assert by_name["_FLAG"].what == "rebound under `global` in f()"


def test_the_state_guard_fails_on_a_registry_that_is_not_listed() -> None:
    """End to end: a new module-level dict in a module's source fails the check, naming file and line."""
    source = (SRC / PACKAGE / "placement.py").read_text(encoding="utf-8") + "\n_REGISTRY: dict[str, int] = {}\n"
    lines = source.count("\n")
    found = module_state("rankmesh.placement", source, "src/rankmesh/placement.py", package_classes(source_files()))
    allowed = {(row.module, row.name) for row in allowed_state()}
    bad = [o.where() for o in found if (o.module, o.name) not in allowed]
    assert bad == [f"src/rankmesh/placement.py:{lines}: rankmesh.placement._REGISTRY (a dict)"]


def test_the_state_list_is_read_from_its_section_only() -> None:
    text = (
        "# Page\n| `rankmesh.a` | `X` | before the section |\n"
        f"{STATE_SECTION}\n\n| module | name | why |\n|---|---|---|\n| `rankmesh.b` | `_Y` | one per process |\n"
        "\n### Owned by another change, to be removed\n\n| `rankmesh.c` | `C.z` | later |\n"
        "## Next\n| `rankmesh.d` | `W` | after |\n"
    )
    assert allowed_state(text) == [
        AllowedState("rankmesh.b", "_Y", "one per process", STATE_SECTION),
        AllowedState("rankmesh.c", "C.z", "later", "Owned by another change, to be removed"),
    ]


# ----- the front door --------------------------------------------------------------------------


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


#: What five fresh-interpreter tests below ask, in one interpreter: each stage imports more and
#: records which of torch, Ray and megatron-core are loaded so far.  Every check is an absence, and
#: a module absent after several stages' imports is absent after each one alone, so one interpreter
#: answers all five (its start-up, torch included, costs seconds; a stage that fails to import
#: fails the script, and every test with it).  The first stage runs before anything loads torch.
IMPORT_STAGES = """
import json, sys

def loaded(*names):
    return sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in names))

stages = {}
import rankmesh, rankmesh.cli
stages["bare"] = {"torch": loaded("torch"), "ray": loaded("ray"), "data": rankmesh.DataProto.__module__}
exec("from rankmesh import *", {})
stages["star"] = {"ray": loaded("ray")}
import rankmesh, rankmesh.megatron
stages["plain"] = {"ray": loaded("ray"), "megatron": loaded("megatron.core"),
                   "names": ["RayWorkerGroup" in dir(rankmesh), "verify_group" in dir(rankmesh.megatron)]}
import rankmesh.megatron.layouts, rankmesh.megatron.rollout, rankmesh.reshard.run
import rankmesh.reshard.worker, rankmesh.backends.local
from rankmesh.reshard import ReshardWorker, reshard, plan_between
stages["reshard"] = {"ray": loaded("ray")}
# megatron-core is there now, but not Ray: the worker and the roles themselves.
import rankmesh.megatron.worker, rankmesh.megatron.roles
stages["megatron_worker"] = {"ray": loaded("ray"), "megatron": loaded("megatron.core")[:1]}
print(json.dumps(stages))
"""


@pytest.fixture(scope="module")
def import_stages() -> dict:
    done = _run(IMPORT_STAGES)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_front_door_and_command_import_no_torch(import_stages) -> None:
    """``import rankmesh`` and the ``rankmesh`` command load torch only when a name that needs it is
    touched (the stage's last step touches DataProto, which resolves)."""
    bare = import_stages["bare"]
    assert bare["torch"] == [] and bare["ray"] == [], bare
    assert bare["data"] == "rankmesh.data.proto", bare


def test_star_import_does_not_import_ray(import_stages) -> None:
    assert import_stages["star"]["ray"] == [], "ray imported"


def test_plain_import_loads_neither_ray_nor_megatron(import_stages) -> None:
    plain = import_stages["plain"]
    assert plain["ray"] == [], "ray imported"
    assert plain["megatron"] == [], "megatron.core imported"
    assert plain["names"] == [True, True]  # RayWorkerGroup in dir(rankmesh), verify_group in dir(rankmesh.megatron)


def test_a_worker_process_imports_tensordict_only_when_a_tensordict_arrives() -> None:
    """The Ray host, the front door and the command start without tensordict (and its torch._dynamo);
    the first TensorDict built or unpickled brings it in, and is recognised as one."""
    done = _run(
        "import pickle, sys, torch\n"
        "import rankmesh, rankmesh.backends.ray.host, rankmesh.cli, rankmesh.dispatch.split\n"
        "from rankmesh import DataProto\n"
        "from rankmesh.data.tensordicts import is_tensordict\n"
        "early = [m for m in ('tensordict', 'torch._dynamo') if m in sys.modules]\n"
        "assert not early, f'imported at start: {early}'\n"
        "assert not is_tensordict({'a': torch.ones(2)})\n"
        "batch = DataProto.from_dict({'a': torch.ones(2)}).batch\n"
        "assert 'tensordict' in sys.modules and is_tensordict(batch)\n"
        "assert type(batch).__name__ == 'TensorDict' and is_tensordict(pickle.loads(pickle.dumps(batch)))\n"
    )
    assert done.returncode == 0, done.stderr


def test_megatron_and_reshard_import_no_ray(import_stages) -> None:
    """Reshard and megatron's workers are backend-neutral: an in-process megatron worker never loads Ray."""
    assert import_stages["reshard"]["ray"] == [], "ray imported by reshard or rankmesh.megatron"
    worker = import_stages["megatron_worker"]
    assert worker["megatron"] == ["megatron.core"]  # the stage did import megatron-core ...
    assert worker["ray"] == [], "ray imported by the megatron worker or roles"  # ... and still no Ray


def test_front_door_is_small_and_holds_rankmesh_own_api() -> None:
    import rankmesh

    public = set(rankmesh.__all__)
    # 19 names to write code with and the errors the README names (10 since issue 45 item 9 added HangError,
    # PaddingError and ResourcePoolError: test_every_error_the_readme_names_is_at_the_front_door), one to spare.
    assert len(public) == len(rankmesh.__all__) <= 30
    for name in public:
        assert getattr(rankmesh, name) is not None, name
    # verl mechanics and internals live in their modules (and rankmesh.compat.verl), not here.
    for internal in ("make_nd_compute_dataproto_dispatch_fn", "DispatchRegistry", "DispatchPlan", "RankGrid",
                     "update_dispatch_mode", "DataProtoConfig"):
        assert internal not in public and not hasattr(rankmesh, internal), internal
    # The Ray names show in dir() but stay out of __all__ (a star import would load Ray).
    for lazy in ("RayResourcePool", "RayClassWithInitArgs", "RayWorkerGroup", "create_colocated_worker_cls"):
        assert lazy in dir(rankmesh) and lazy not in public


def test_every_error_the_readme_names_is_at_the_front_door() -> None:
    """``from rankmesh import HangError`` works because the README names it beside ``WorkerError``
    (issue 45, item 9): a reader imports what the first page shows from where it shows it."""
    import rankmesh
    import rankmesh.errors

    readme = (SRC.parent / "README.md").read_text(encoding="utf-8")
    named = {word for word in re.findall(r"\b[A-Z]\w*(?:Error|Timeout|Died)\b", readme)
             if isinstance(getattr(rankmesh.errors, word, None), type)}
    assert {"WorkerError", "HangError", "PaddingError"} <= named  # the scan finds what it should
    missing = sorted(named - set(rankmesh.__all__))
    assert not missing, f"the README names {missing}; add them to rankmesh.NAMES (they live in rankmesh.errors)"
    for word in named:
        namespace: dict = {}
        exec(f"from rankmesh import {word}", namespace)
        assert namespace[word] is getattr(rankmesh.errors, word)


def test_verl_mechanics_are_reachable_from_their_modules() -> None:
    from rankmesh.dispatch import DispatchPlan, DispatchRegistry, make_nd_compute_dataproto_dispatch_fn
    from rankmesh.mesh import RankGrid

    assert DispatchPlan and DispatchRegistry and RankGrid
    verl = pytest.importorskip("rankmesh.compat.verl")
    assert verl.make_nd_compute_dataproto_dispatch_fn is make_nd_compute_dataproto_dispatch_fn
