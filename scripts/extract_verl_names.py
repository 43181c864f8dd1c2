"""Extract verl 0.9.1's public names once, into tests/compat/verl_0_9_1_names.json.

Run against an unpacked verl wheel (``pip download verl==0.9.1 --no-deps`` then unzip):

    python scripts/extract_verl_names.py /tmp/verl/src/verl > tests/compat/verl_0_9_1_names.json

Reads the source with ``ast`` (verl is never imported): the public module-level functions and
classes of ``protocol.py`` and of the ``verl.utils`` modules in :data:`MODULES`, and the public
methods, properties and class attributes of the classes a ported program touches, inherited
ones included.  The few ``_underscore`` methods verl's own workers call from user code (dispatch
info) are listed too.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

#: class -> (file under verl/, base classes to merge from the same set)
CLASSES = {
    "DataProto": ("protocol.py", []),
    "DataProtoFuture": ("protocol.py", []),
    "WorkerHelper": ("single_controller/base/worker.py", []),
    "Worker": ("single_controller/base/worker.py", ["WorkerHelper"]),
    "ResourcePool": ("single_controller/base/worker_group.py", []),
    "WorkerGroup": ("single_controller/base/worker_group.py", []),
    "RayResourcePool": ("single_controller/ray/base.py", ["ResourcePool"]),
    "RayWorkerGroup": ("single_controller/ray/base.py", ["WorkerGroup"]),
}
#: verl module (dotted, under verl.) -> its file: modules besides protocol whose public functions a port may import.
MODULES = {"utils.ray_utils": "utils/ray_utils.py"}
#: verl-private methods that verl worker code calls itself (so a port needs them).
USED_PRIVATE = {"_register_dispatch_collect_info", "_query_dispatch_info", "_query_collect_info"}


def _members(node: ast.ClassDef) -> set[str]:
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    return {n for n in names if not n.startswith("_") or n in USED_PRIVATE}


def _public_names(tree: ast.Module) -> list[str]:
    """The public module-level functions and classes of a parsed module, sorted."""
    return sorted(
        n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")
    )


def main(root: str) -> None:
    root_path = Path(root)
    trees = {f: ast.parse((root_path / f).read_text()) for f, _ in CLASSES.values()}
    classes = {}
    for name, (f, _) in CLASSES.items():
        node = next(n for n in trees[f].body if isinstance(n, ast.ClassDef) and n.name == name)
        classes[name] = _members(node)
    for name, (_, bases) in CLASSES.items():
        for base in bases:
            classes[name] |= classes[base]
    out = {
        "source": "verl 0.9.1 wheel (pip download verl==0.9.1 --no-deps), read with scripts/extract_verl_names.py",
        "protocol": _public_names(trees["protocol.py"]),
        "classes": {k: sorted(v) for k, v in classes.items() if k not in ("WorkerHelper", "ResourcePool")},
        "modules": {name: _public_names(ast.parse((root_path / f).read_text())) for name, f in MODULES.items()},
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
