"""The README tour and every ```python block of docs/*.md run as written (see tests/doc_blocks.py).

Blocks that use Ray run on the session's Ray (``ray_session``); whatever worker groups and pools
a file's blocks leave in their namespace are shut down after the file, so no process outlives it.
"""

from __future__ import annotations

import ast
import builtins
import time
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from rankmesh import RayResourcePool, WorkerGroup  # noqa: E402
from rankmesh.cli import main as rankmesh_cli  # noqa: E402
from rankmesh.group import ReplicaGroup  # noqa: E402
from tests.doc_blocks import BlockFailed, layout_commands, python_blocks, run_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _uses_ray(blocks) -> bool:
    return any("Ray" in block.source or "megatron_group" in block.source for block in blocks if block.skip is None)


def _release(namespace: dict[str, Any]) -> None:
    """Shut down the worker groups, then remove the pools, that the blocks left behind."""
    values = list(namespace.values())
    values += [v for d in list(values) if isinstance(d, dict) for v in d.values()]
    for value in values:
        if isinstance(value, WorkerGroup) and not isinstance(value, ReplicaGroup):  # a view owns nothing
            value.shutdown()
    for value in values:
        if isinstance(value, RayResourcePool):
            value.remove()


def _free_cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


def _wait_free_cpus(expected: float, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    while _free_cpus() < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return _free_cpus()


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_python_blocks_run(path, request):
    blocks = python_blocks(path)
    uses_ray = _uses_ray(blocks)
    if uses_ray:
        request.getfixturevalue("ray_session")
        free_before = _free_cpus()
    namespace: dict[str, Any] = {"__name__": f"doc_{path.stem}"}
    try:
        run_blocks(blocks, namespace)
    finally:
        _release(namespace)
    if uses_ray:  # every process and placement group the blocks started is gone again
        assert _wait_free_cpus(free_before) >= free_before


LAYOUT_COMMANDS = [(path, line, argv) for path in DOC_FILES for line, argv in layout_commands(path)]


@pytest.mark.parametrize(
    "path, line, argv", LAYOUT_COMMANDS, ids=[f"{p.name}:{line}" for p, line, _ in LAYOUT_COMMANDS]
)
def test_doc_layout_commands_succeed(path, line, argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # `layout draw -o moe.png` writes here
    code = rankmesh_cli(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{path}:{line}: `rankmesh {' '.join(argv)}` exited {code}\n{err[-2000:]}"
    assert out.strip()


def test_the_tour_is_covered():
    """The files this test runs really hold the examples (a renamed fence would silently drop them)."""
    readme = python_blocks(ROOT / "README.md")
    assert len(readme) >= 2 and all(block.skip is None for block in readme)
    assert any("RayResourcePool(process_on_nodes=[8], use_gpu=False)" in block.source for block in readme)


# ----- the collector itself ----------------------------------------------------------------------

SAMPLE = """# title

```python
x = 1
```

```bash
this is not python
```

<!-- skip: needs a GPU -->

```python
import torch_on_a_gpu_only
```

```python
y = x + 1
assert y == 3, "wrong"
```
"""


def test_blocks_share_one_namespace_and_failures_name_file_and_line(tmp_path):
    doc = tmp_path / "sample.md"
    doc.write_text(SAMPLE)
    blocks = python_blocks(doc)
    assert [(b.line, b.skip) for b in blocks] == [(4, None), (14, "needs a GPU"), (18, None)]
    namespace: dict[str, Any] = {}
    with pytest.raises(BlockFailed) as info:
        run_blocks(blocks, namespace)
    assert namespace["y"] == 2  # the third block saw the first block's x
    assert f"block at {doc}:18 failed at line 19: AssertionError: wrong" in str(info.value)


def test_skipped_blocks_must_still_compile(tmp_path):
    doc = tmp_path / "bad.md"
    doc.write_text("<!-- skip: needs a cluster -->\n```python\ndef broken(:\n```\n")
    with pytest.raises(SyntaxError):
        run_blocks(python_blocks(doc), {})


def test_unclosed_fence_is_an_error(tmp_path):
    doc = tmp_path / "open.md"
    doc.write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match="open.md:1: code fence never closed"):
        python_blocks(doc)


#: Words that speak to the people who wrote the repository, not to its readers: an issue tracker,
#: a prototype, notes and a machine the reader has never seen.
OUTSIDE_WORDS = ("the issue", "issue's", "the spike", "this 2-core machine", "shared/notes", "../shared")


def test_docs_and_scripts_speak_to_a_reader_of_the_repository():
    """README, docs, library and scripts name no issue, spike, notes file or "this machine"."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src").rglob("*.py")),
             *sorted((ROOT / "scripts").glob("*.py"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {word!r}"
             for path in files for number, line in enumerate(path.read_text().splitlines(), 1)
             for word in OUTSIDE_WORDS if word in line.lower()]
    assert not found, "words from outside the repository (say what was measured, where, by whom):\n" + "\n".join(found)


def _bare_expressions(tree: ast.Module) -> list[int]:
    """Lines of top-level expression statements shown for their value, which a script drops: anything
    but a call, or a method call whose name does not say it acts (``print(...)``, ``actor.shutdown()``
    are run for what they do)."""
    lines = []
    for node in tree.body:
        if not isinstance(node, ast.Expr):
            continue
        call = node.value
        if isinstance(call, ast.Call) and (isinstance(call.func, ast.Name) or not _returns_value(call)):
            continue
        lines.append(node.lineno)
    return lines


def _returns_value(call: ast.Call) -> bool:
    """A method call shown for its value: ``mesh.groups("tp")``, ``out.batch["x"].tolist()``; calls
    whose name says they act (shutdown, close, start, join, append, ...) are run for what they do."""
    acts = ("shutdown", "close", "start", "join", "append", "update", "put", "step", "write", "sleep", "kill", "wait")
    name = call.func.attr if isinstance(call.func, ast.Attribute) else ""
    return not name.startswith(acts)


def _defined(tree: ast.Module) -> set[str]:
    """Names a block binds at top level: imports, assignments, classes and functions."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def test_readme_blocks_work_pasted_into_a_file():
    """Each README block prints what its comments show (a bare expression prints nothing in a script),
    and a block that needs names from the one before says so in the sentence that introduces it."""
    lines = (ROOT / "README.md").read_text().splitlines()
    problems = []
    for block in python_blocks(ROOT / "README.md"):
        tree = ast.parse(block.source)
        problems += [f"README.md:{block.line + n - 1}: a bare expression (print it)" for n in _bare_expressions(tree)]
        needed = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        missing = sorted(needed - _defined(tree) - set(dir(builtins)))
        intro = " ".join(lines[max(0, block.line - 6):block.line - 1]).lower()
        if missing and "continues" not in intro:
            problems.append(f"README.md:{block.line}: uses {missing} from an earlier block; say so above it (\"continues ...\")")
    assert not problems, "\n".join(problems)
