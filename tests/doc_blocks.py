"""Code blocks of the Markdown docs: find the ```python blocks of a file and run them in order.

Why run them: a README whose first example fails is the first thing a newcomer meets, and docs
drift as names change.  Each file is one session, like a doctest: its blocks run top to bottom
in one namespace, so a later block may use what an earlier one defined.  Output shown as
``# comments`` is not checked (the blocks say what a reader would see, tests say what is true).

A block that truly cannot run on a CPU-only, one-machine setup (it needs GPUs or a real
multi-node cluster) is marked where a reader sees it, by an HTML comment on the line just
before its fence (blank lines between are allowed)::

    <!-- skip: needs 2 nodes with 8 GPUs each -->
    ```python
    ...

A skipped block is still compiled, so it at least stays valid Python.  Other fences (```bash,
```console, bare ```) are never run as such; only their ``rankmesh layout ...`` commands are
(:func:`layout_commands`).
"""

from __future__ import annotations

import re
import shlex
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it starts (1-based line of its first code line) and its code."""

    path: Path
    line: int
    source: str
    skip: str | None  # the reason given in the marker, or None when the block runs

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


class BlockFailed(AssertionError):
    """A block raised: the message names the file and line of the block and of the failing line."""


def python_blocks(path: Path) -> list[Block]:
    """Every ```python block of ``path`` in order, with its skip marker if it has one."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang = fence.group(1), fence.group(2)
        end = i + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 1}: code fence never closed")
        if lang == "python":
            body = [line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1 : end]]
            blocks.append(Block(Path(path), i + 2, "\n".join(body) + "\n", _skip_reason(lines, i)))
        i = end + 1
    return blocks


def layout_commands(path: Path) -> list[tuple[int, list[str]]]:
    """``(line, argv)`` of every ``rankmesh layout ...`` line in the shell blocks of ``path``.

    Shell blocks (```bash, ```console) are not run as shell; only these commands are, through
    the CLI's ``main`` in-process, because they are cheap and read only shipped layouts.  A
    console prompt (``$ ``) and a trailing ``# comment`` are dropped.
    """
    commands = []
    shell = False
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        fence = FENCE.match(line)
        if fence:
            shell = not shell and fence.group(2) in ("bash", "console", "sh", "shell")
            continue
        text = line.strip().removeprefix("$ ")
        if shell and text.startswith("rankmesh layout "):
            argv = shlex.split(text, comments=True)
            commands.append((number, argv[1:]))
    return commands


def _skip_reason(lines: list[str], fence_index: int) -> str | None:
    j = fence_index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    marker = SKIP.match(lines[j]) if j >= 0 else None
    return marker.group("reason") if marker else None


def run_blocks(blocks: list[Block], namespace: dict[str, Any]) -> list[Block]:
    """Run the blocks in order in ``namespace``; returns the skipped ones.

    Line numbers in tracebacks are the file's own (the code is compiled under the file's path,
    shifted to where the block starts).  The first failure raises :class:`BlockFailed`.
    """
    skipped = []
    for block in blocks:
        code = compile("\n" * (block.line - 1) + block.source, str(block.path), "exec")
        if block.skip is not None:
            skipped.append(block)
            continue
        try:
            exec(code, namespace)  # noqa: S102 - running the docs is the point
        except Exception as exc:  # noqa: BLE001 - reported with the block's location
            at = _failing_line(exc, block)
            raise BlockFailed(
                f"the ```python block at {block.where} failed at line {at}: {type(exc).__name__}: {exc}"
            ) from exc  # the chained traceback shows the block's lines under the file's own numbers
    return skipped


def _failing_line(exc: BaseException, block: Block) -> int:
    """The deepest traceback line inside the block's own file (the block's first line otherwise)."""
    line = block.line
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == str(block.path) and frame.lineno is not None:
            line = frame.lineno
    return line
