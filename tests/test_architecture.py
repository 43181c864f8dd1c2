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
strings, not imports, and are not read here.

The layers (:data:`LAYERS`) are data: each module belongs to the layer of its longest matching
prefix, and may import its own layer (the cycle check keeps that one-way) or a layer of a
strictly lower rank.  Two layers of equal rank know nothing of each other.  The third-party
rules (:data:`ONLY_UNDER`) say where Ray, megatron-core and torch.distributed may be imported.
docs/architecture.md draws the same map in words.
"""

from __future__ import annotations

import ast
import os
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
    "foundation": (0, ("rankmesh.errors", "rankmesh.validate", "rankmesh.lazy")),
    "mesh": (1, ("rankmesh.mesh",)),
    "serialization": (1, ("rankmesh.serialization", "rankmesh.sharedmem", "rankmesh.peermem")),
    "placement": (2, ("rankmesh.placement",)),
    "reshard planner": (2, ("rankmesh.reshard",)),
    "data": (2, ("rankmesh.data",)),
    "hangs": (2, ("rankmesh.hangs",)),
    "dispatch": (3, ("rankmesh.dispatch",)),
    "layout": (3, ("rankmesh.layout",)),
    "tracing": (3, ("rankmesh.tracing",)),
    "backend contract": (4, ("rankmesh.backend",)),
    "worker": (5, ("rankmesh.worker", "rankmesh.devices")),
    "groups": (6, ("rankmesh.group",)),
    # Reshard's worker methods (on Worker) and its controller side (through the groups' call_ranks,
    # which it calls but never imports): backend-neutral, below every backend.
    "reshard": (6, ("rankmesh.reshard.worker", "rankmesh.reshard.run")),
    "backends": (7, ("rankmesh.backends",)),
    "front door": (8, ("rankmesh",)),
    "compat": (8, ("rankmesh.compat",)),
    "megatron": (8, ("rankmesh.megatron",)),
    "tools": (9, ("rankmesh.demo", "rankmesh.demo_cli", "rankmesh.demo_hang", "rankmesh.draw", "rankmesh.cli", "rankmesh.__main__", "rankmesh.tracing.plot")),
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
    "torch.distributed": ("rankmesh.backends.ray", "rankmesh.megatron", "rankmesh.mesh"),
}


#: The Ray backend along the process boundary: module -> the modules of the other side it must
#: not import.  The host runs in every worker process; the controller-side modules (launching
#: hosts, waiting on calls, the group) never run there, and the host never reaches into them.
PROCESS_BOUNDARY: dict[str, tuple[str, ...]] = {
    "rankmesh.backends.ray.host": (
        "rankmesh.backends.ray.classes",
        "rankmesh.backends.ray.executor",
        "rankmesh.backends.ray.group",
        "rankmesh.backends.ray.hangs",
        "rankmesh.backends.ray.hosts",
        "rankmesh.backends.ray.pool",
        "rankmesh.backends.ray.recovery",
        "rankmesh.backends.ray.startup",
        "rankmesh.backends.ray.waiting",
        "rankmesh.group",
    ),
}

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


def test_the_worker_process_side_of_ray_imports_no_controller_side_module() -> None:
    bad = [
        imp.where()
        for imp in _internal(all_imports())
        if any(imp.target == t or imp.target.startswith(t + ".") for t in PROCESS_BOUNDARY.get(imp.source, ()))
    ]
    assert not bad, "the worker-process side imports the controller side:\n" + "\n".join(bad)


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


# ----- the front door --------------------------------------------------------------------------


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_star_import_does_not_import_ray() -> None:
    done = _run("from rankmesh import *\nimport sys\nassert 'ray' not in sys.modules, 'ray imported'\nprint(len(dir()))")
    assert done.returncode == 0, done.stderr


def test_plain_import_loads_neither_ray_nor_megatron() -> None:
    done = _run(
        "import sys, rankmesh, rankmesh.megatron\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
        "assert 'megatron.core' not in sys.modules, 'megatron.core imported'\n"
        "assert 'RayWorkerGroup' in dir(rankmesh) and 'verify_group' in dir(rankmesh.megatron)\n"
    )
    assert done.returncode == 0, done.stderr


def test_megatron_and_reshard_import_no_ray() -> None:
    """Reshard and megatron's workers are backend-neutral: an in-process megatron worker never loads Ray."""
    done = _run(
        "import sys, rankmesh.megatron, rankmesh.megatron.layouts, rankmesh.megatron.rollout, rankmesh.reshard.run\n"
        "import rankmesh.reshard.worker, rankmesh.backends.local\n"
        "from rankmesh.reshard import ReshardWorker, reshard, plan_between\n"
        "ray = [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]\n"
        "assert not ray, f'ray imported: {ray[:5]}'\n"
    )
    assert done.returncode == 0, done.stderr
    # megatron-core is there, but not Ray: the worker and the roles themselves.
    done = _run(
        "import sys, rankmesh.megatron.worker, rankmesh.megatron.roles\n"
        "ray = [m for m in sys.modules if m == 'ray' or m.startswith('ray.')]\n"
        "assert not ray, f'ray imported: {ray[:5]}'\n"
    )
    assert done.returncode == 0, done.stderr


def test_front_door_is_small_and_holds_rankmesh_own_api() -> None:
    import rankmesh

    public = set(rankmesh.__all__)
    assert len(public) == len(rankmesh.__all__) <= 27
    for name in public:
        assert getattr(rankmesh, name) is not None, name
    # verl mechanics and internals live in their modules (and rankmesh.compat.verl), not here.
    for internal in ("make_nd_compute_dataproto_dispatch_fn", "DispatchRegistry", "DispatchPlan", "RankGrid",
                     "update_dispatch_mode", "DataProtoConfig"):
        assert internal not in public and not hasattr(rankmesh, internal), internal
    # The Ray names show in dir() but stay out of __all__ (a star import would load Ray).
    for lazy in ("RayResourcePool", "RayClassWithInitArgs", "RayWorkerGroup", "create_colocated_worker_cls"):
        assert lazy in dir(rankmesh) and lazy not in public


def test_verl_mechanics_are_reachable_from_their_modules() -> None:
    from rankmesh.dispatch import DispatchPlan, DispatchRegistry, make_nd_compute_dataproto_dispatch_fn
    from rankmesh.mesh import RankGrid

    assert DispatchPlan and DispatchRegistry and RankGrid
    verl = pytest.importorskip("rankmesh.compat.verl")
    assert verl.make_nd_compute_dataproto_dispatch_fn is make_nd_compute_dataproto_dispatch_fn
