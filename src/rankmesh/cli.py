"""The ``rankmesh`` command line: inspect, validate and draw parallel layouts, run the demo.

Subcommands are a table, not hard-wired branches: ``rankmesh layout`` is set up here,
``rankmesh demo`` by :mod:`rankmesh.demo_cli` (imported here, and light: Ray, torch and
megatron-core load only when the command runs).  Code embedding rankmesh can add its own::

    from rankmesh.cli import add_command

    def setup(parser):                       # an argparse parser for `rankmesh steps`
        parser.add_argument("--steps", type=int, default=3)
        parser.set_defaults(handler=run)     # run(args) -> exit code

    add_command("steps", setup, help="run some steps")

Imports go one way: this module imports the command modules; they never import it.

Every error a user can cause ends as one line ``rankmesh: error: ...`` on stderr, never a
traceback.  Exit codes (also in ``rankmesh --help``):

* 0: done.
* 1: a layout file was found but is not a valid layout (malformed YAML, a bad field, a failed
  check): the same for ``layout show``, ``draw`` and ``validate``, so a script gets one answer for
  one file; ``validate`` also exits 1 on an error it lists, and ``demo`` when a self-check fails.
* 2: the command line is wrong (argparse's code for a usage error): an unknown command or option, a
  missing subcommand (then usage and the list of subcommands go to stderr first), an unknown
  layout name or missing file, sizes or a role or rank that do not fit.

``-v`` (info) and ``-vv`` (debug) may stand before or after the subcommand, as ``-h`` may.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any, Callable, Sequence

from rankmesh import __version__, demo_cli
from rankmesh.errors import LayoutFileError, MeshError, RankMeshError, UsageError
from rankmesh.tracing import summarize
from rankmesh.layout import (
    Layout,
    LayoutError,
    LayoutRole,
    find_layout,
    list_layouts,
    load_layout,
    validate_layout,
)
from rankmesh.mesh import DEFAULT_ORDER, RankMesh
from rankmesh.validate import positive_int, writable_file

log = logging.getLogger(__name__)

PROG = "rankmesh"
EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2

_EPILOG = (
    "exit status: 0 done; 1 a layout file is not a valid layout (show, draw and validate alike) or a "
    "check failed; 2 the command line is wrong (usage error)"
)
_VERBOSE = "verbose "
"""Prefix of the attributes the ``-v`` of each parser level counts into (see :class:`_Parser`)."""

Setup = Callable[[argparse.ArgumentParser], None]
"""Configures a subcommand's parser and sets ``handler=fn`` with ``fn(args) -> int``."""

_COMMANDS: dict[str, tuple[Setup, str]] = {}


class _Parser(argparse.ArgumentParser):
    """argparse, but errors raise instead of printing usage and exiting: main prints one line.

    Like ``-h``, ``-v`` is accepted by every parser, so it may stand before or after a subcommand.
    argparse parses each subcommand into a fresh namespace and copies it over its parent's, so each
    level counts into an attribute of its own (``_VERBOSE`` + its prog) and :func:`_verbosity` adds them.
    A parser with subcommands given none prints its usage and subcommands (:meth:`_missing_subcommand`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, dest=_VERBOSE + self.prog,
                          help="more diagnostics on stderr (-vv: debug); before or after the subcommand")

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)

    def add_subparsers(self, **kwargs: Any) -> Any:  # type: ignore[override]
        kwargs["required"] = False  # a missing subcommand is answered by the handler below, with the list
        self.set_defaults(handler=self._missing_subcommand)
        self._subcommands = super().add_subparsers(**kwargs)
        return self._subcommands

    def _missing_subcommand(self, args: argparse.Namespace) -> int:
        """``rankmesh``, ``rankmesh layout`` alone: the help (usage and subcommands) on stderr, exit 2."""
        sys.stderr.write(self.format_help())
        names = ", ".join(self._subcommands.choices)
        print(f"{self.prog}: error: give one of {names} (`{self.prog} NAME --help` for its options)",
              file=sys.stderr)
        return EXIT_USAGE


def add_command(name: str, setup: Setup, help: str = "") -> None:
    """Register ``rankmesh NAME``; registering the same setup twice is harmless."""
    existing = _COMMANDS.get(name)
    if existing is not None and existing[0] is not setup:
        raise ValueError(f"rankmesh command {name!r} is already registered by {existing[0]!r}")
    _COMMANDS[name] = (setup, help)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Drive Megatron-parallel worker groups: inspect, validate and draw layouts, read traces, run the demo.",
                     epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (setup, help_text) in _COMMANDS.items():
        setup(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script passes it to sys.exit)."""
    package_log = logging.getLogger("rankmesh")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
    old_level = package_log.level
    package_log.addHandler(handler)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help and --version
            return exc.code if isinstance(exc.code, int) else EXIT_OK
        args.verbose = _verbosity(args)
        package_log.setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else logging.WARNING)
        return int(args.handler(args))
    except LayoutFileError as exc:  # found but not a valid layout: 1 in show, draw and validate alike
        return _fail(exc, EXIT_INVALID)
    except RankMeshError as exc:
        return _fail(exc, EXIT_USAGE)
    except BrokenPipeError:  # e.g. `rankmesh layout show ... | head`
        return EXIT_OK
    finally:
        package_log.removeHandler(handler)
        package_log.setLevel(old_level)


def _verbosity(args: argparse.Namespace) -> int:
    """How many ``-v`` were given, at every parser level together."""
    return sum(count for name, count in vars(args).items() if name.startswith(_VERBOSE))


def _fail(exc: BaseException | str, code: int) -> int:
    message = " ".join(str(exc).split("\n"))
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


# ----- rankmesh layout ...  ---------------------------------------------------------------------


def _setup_layout(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="layout_command", metavar="ACTION")

    p = sub.add_parser("list", help="list the shipped layouts", description="List the layouts found by name.")
    p.add_argument("--json", action="store_true", help="a JSON list: name, description and source file of each")
    p.set_defaults(handler=_cmd_list)

    p = sub.add_parser(
        "show",
        help="print every rank's coordinates and the groups",
        description="Show a layout (name or file) or explicit sizes as a rank table, or as JSON.",
    )
    _add_source_args(p)
    p.add_argument("--rank", type=int, help="show only this rank (and its groups)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=_cmd_show)

    p = sub.add_parser(
        "validate",
        help="check layouts; exit 1 on errors",
        epilog=_EPILOG,
        description="List every problem of the layouts; exit 1 if any is an error.",
    )
    p.add_argument("layouts", nargs="*", metavar="NAME_OR_FILE")
    p.add_argument("--all", action="store_true", help="validate every layout `layout list` shows")
    p.add_argument("--strict", action="store_true", help="treat warnings (e.g. tp across nodes) as errors")
    p.add_argument("--address", default=None,
                   help="also check against this live Ray cluster ('auto': the running one), before any actor starts")
    p.add_argument("--resource", choices=("GPU", "CPU"), default=None,
                   help="with --address: what each process takes (default GPU if the cluster has any)")
    p.set_defaults(handler=_cmd_validate)

    p = sub.add_parser(
        "draw",
        help="draw ranks on nodes to a PNG/SVG/PDF",
        description="Draw ranks as boxes grouped by node, coloured by dp replica, tp groups outlined.",
    )
    _add_source_args(p)
    p.add_argument("-o", "--output", required=True, help="output file: .png, .svg or .pdf")
    p.set_defaults(handler=_cmd_draw)


def _process_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 4,4, got {text!r}") from None
    for count in counts:
        if count <= 0:
            raise argparse.ArgumentTypeError(f"process counts must be positive, got {text!r}")
    return counts


_SIZE_FLAGS = ("tp", "pp", "cp", "dp", "ep", "etp")


def _add_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("layout", nargs="?", metavar="NAME_OR_FILE", help="a layout name or a .yaml file")
    p.add_argument("--role", help="only this role of the layout")
    sizes = p.add_argument_group("explicit sizes (instead of a layout)")
    for axis in _SIZE_FLAGS:
        sizes.add_argument(f"--{axis}", type=int, metavar="N")
    sizes.add_argument("--order", help=f"megatron order string, fastest axis first (default {DEFAULT_ORDER})")
    sizes.add_argument("--nodes", type=int, metavar="N", help="number of nodes")
    sizes.add_argument("--devices-per-node", type=int, metavar="M", help="processes per node")
    sizes.add_argument("--process-on-nodes", type=_process_counts, metavar="A,B,...", help="processes on each node")


def _explicit_given(args: argparse.Namespace) -> bool:
    names = (*_SIZE_FLAGS, "order", "nodes", "devices_per_node", "process_on_nodes")
    return any(getattr(args, name) is not None for name in names)


def _resolve_layout(args: argparse.Namespace) -> Layout:
    """The layout named on the command line, or a one-role layout built from explicit sizes."""
    explicit = _explicit_given(args)
    if args.layout and explicit:
        raise UsageError("give either a layout or explicit sizes (--tp/--pp/...), not both")
    if args.layout:
        return load_layout(args.layout)
    if not explicit:
        raise UsageError("give a layout name or file, or explicit sizes such as --tp 2 --pp 2 --dp 2")
    if args.role is not None:
        raise UsageError("--role needs a layout; explicit sizes describe a single mesh")
    sizes = {axis: getattr(args, axis) for axis in ("tp", "pp", "cp", "ep") if getattr(args, axis) is not None}
    order = args.order if args.order is not None else DEFAULT_ORDER
    counts = _explicit_counts(args)
    if counts is not None and args.dp is None:
        mesh = RankMesh.for_world(sum(counts), etp=args.etp, order=order, **sizes)
    else:
        mesh = RankMesh(dp=1 if args.dp is None else args.dp, etp=args.etp, order=order, **sizes)
    if counts is None:
        counts = _counts_for_world(args, mesh.world_size)
    elif mesh.world_size != sum(counts):
        raise MeshError(f"the mesh has {mesh.world_size} ranks (tp*cp*dp*pp) but the nodes hold {sum(counts)} processes")
    return Layout.from_mesh(mesh, counts)


def _explicit_counts(args: argparse.Namespace) -> list[int] | None:
    """Process counts fixed by the flags alone, or None when they depend on the mesh."""
    if args.process_on_nodes is not None:
        if args.nodes is not None or args.devices_per_node is not None:
            raise UsageError("--process-on-nodes cannot be combined with --nodes/--devices-per-node")
        return args.process_on_nodes
    if args.nodes is not None and args.devices_per_node is not None:
        per_node = positive_int(args.devices_per_node, "--devices-per-node", UsageError)
        return [per_node] * positive_int(args.nodes, "--nodes", UsageError)
    return None


def _counts_for_world(args: argparse.Namespace, world: int) -> list[int]:
    if args.nodes is not None:
        nodes = positive_int(args.nodes, "--nodes", UsageError)
        if world % nodes:
            raise MeshError(f"{world} ranks do not divide evenly over --nodes {nodes}")
        return [world // nodes] * nodes
    if args.devices_per_node is not None:
        per_node = positive_int(args.devices_per_node, "--devices-per-node", UsageError)
        if world % per_node:
            raise MeshError(f"{world} ranks do not fill whole nodes of --devices-per-node {per_node}")
        return [per_node] * (world // per_node)
    return [world]


def _selected_roles(layout: Layout, role: str | None) -> list[LayoutRole]:
    return [layout.role(role)] if role is not None else list(layout.roles.values())


def _cmd_list(args: argparse.Namespace) -> int:
    entries = []
    for name in list_layouts():
        entry: dict[str, Any] = {"name": name, "description": None, "source": str(find_layout(name))}
        try:
            entry["description"] = load_layout(name, check=False).description
        except LayoutError as exc:
            log.warning("%s", exc)
            entry["error"] = str(exc)
        entries.append(entry)
    if args.json:
        print(json.dumps(entries, indent=2))
        return EXIT_OK
    width = max((len(e["name"]) for e in entries), default=0)
    for entry in entries:
        description = entry["description"] if "error" not in entry else "(cannot be loaded; see `rankmesh layout validate`)"
        print(f"{entry['name']:<{width}}  {description}".rstrip())
    return EXIT_OK


def role_report(layout: Layout, role: LayoutRole, rank: int | None = None) -> dict[str, Any]:
    """Everything ``layout show`` prints about one role, as plain JSON-ready data."""
    mesh = role.mesh()
    placement = role.placement()
    if rank is not None:
        mesh.dense.check_rank(rank)
    table = mesh.coord_table()
    nodes = placement.node_array()
    collect = set(mesh.collect_ranks())
    ranks = range(mesh.world_size) if rank is None else [rank]
    rows = []
    for r in ranks:
        place = placement.place(r)
        row = {"rank": r, "node": role.pool.nodes[int(nodes[r])], "local_rank": place.local_rank}
        row.update({axis: int(table[axis][r]) for axis in ("tp", "cp", "ep", "dp", "pp", "etp", "edp")})
        row["collect"] = r in collect
        rows.append(row)
    views = {
        "tp": ("tp", False),
        "cp": ("cp", False),
        "dp": ("dp", False),
        "pp": ("pp", False),
        "ep": ("ep", True),
        "etp": ("tp", True),
        "edp": ("dp", True),
    }
    if rank is None:
        groups = {name: mesh.groups(token, expert=expert) for name, (token, expert) in views.items()}
    else:
        groups = {name: [mesh.group_of(rank, token, expert=expert)] for name, (token, expert) in views.items()}
    return {
        "role": role.name,
        "pool": role.pool.name,
        "nodes": list(role.pool.nodes),
        "process_on_nodes": list(role.pool.process_on_nodes),
        "colocate_with": list(role.colocate_with),
        "mesh": {**mesh.sizes, "order": mesh.order, "world_size": mesh.world_size},
        "collect_ranks": mesh.collect_ranks(),
        "ranks": rows,
        "groups": groups,
    }


def _cmd_show(args: argparse.Namespace) -> int:
    layout = _resolve_layout(args)
    reports = [role_report(layout, role, args.rank) for role in _selected_roles(layout, args.role)]
    if args.json:
        document = {"layout": layout.name, "source": layout.source, "roles": reports}
        print(json.dumps(document, indent=2))
        return EXIT_OK
    for i, report in enumerate(reports):
        if i:
            print()
        print(_format_report(layout, report))
    return EXIT_OK


_COLUMNS = (
    ("rank", "rank"),
    ("node", "node"),
    ("local", "local_rank"),
    ("tp", "tp"),
    ("cp", "cp"),
    ("ep", "ep"),
    ("dp", "dp"),
    ("pp", "pp"),
)


def _on_nodes(nodes: Sequence[int], counts: Sequence[int]) -> str:
    """``8 on node 0`` / ``8 on node 0 and 8 on node 1`` / ``8 on each of nodes 0-3``: a pool's placement in words."""
    nodes, counts = list(nodes), list(counts)
    if len(nodes) > 2 and len(set(counts)) == 1 and nodes == list(range(nodes[0], nodes[0] + len(nodes))):
        return f"{counts[0]} on each of nodes {nodes[0]}-{nodes[-1]}"
    parts = [f"{c} on node {n}" for n, c in zip(nodes, counts)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _format_report(layout: Layout, report: dict[str, Any]) -> str:
    mesh = report["mesh"]
    sizes = " ".join(f"{a}{mesh[a]}" for a in ("tp", "cp", "ep", "dp", "pp") if mesh[a] > 1) or "single rank"
    if mesh["ep"] > 1:
        sizes += f" (expert: etp{mesh['etp']} ep{mesh['ep']} edp{mesh['edp']})"
    head = (
        f"layout {layout.name} · role {report['role']} · {sizes} · order {mesh['order']} · "
        f"pool {report['pool']}: {mesh['world_size']} ranks, {_on_nodes(report['nodes'], report['process_on_nodes'])}"
    )
    if report["colocate_with"]:
        head += f" · colocated with {', '.join(report['colocate_with'])}"
    header = [name for name, _ in _COLUMNS] + ["collect"]
    body = [[str(row[key]) for _, key in _COLUMNS] + ["*" if row["collect"] else ""] for row in report["ranks"]]
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(header)]
    lines = [head, "", "  ".join(h.rjust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(c.rjust(w) for c, w in zip(line, widths)).rstrip() for line in body]
    lines.append("")
    shown = [name for name in ("tp", "cp", "dp", "pp", "ep", "etp", "edp") if _group_size(report, name) > 1]
    if not shown:
        lines.append("groups: every group has one rank")
    else:
        lines.append("groups" + (" (etp/edp/ep from the expert view)" if mesh["ep"] > 1 else ""))
        width = max(len(name) for name in shown)
        for name in shown:
            listed = " ".join(str(g) for g in report["groups"][name])
            lines.append(f"  {name:<{width}}  {listed}")
    return "\n".join(lines)


def _group_size(report: dict[str, Any], name: str) -> int:
    if name in ("etp", "edp") and report["mesh"]["ep"] == 1:
        return 1  # without ep the expert view repeats the dense one
    return len(report["groups"][name][0])


def _cmd_validate(args: argparse.Namespace) -> int:
    targets = list(args.layouts)
    if args.all:
        targets += [name for name in list_layouts() if name not in targets]
    if not targets:
        raise UsageError("give at least one layout name or file, or --all")
    paths = [find_layout(target) for target in targets]  # unknown names are usage errors (exit 2)
    failed = False
    for target, path in zip(targets, paths):
        try:
            layout = load_layout(path, check=False)
        except LayoutFileError as exc:
            _fail(exc, EXIT_INVALID)
            failed = True
            continue
        problems = validate_layout(layout, strict=args.strict)
        for problem in problems:
            print(problem)
        errors = sum(p.severity == "error" for p in problems)
        warnings = len(problems) - errors
        failed |= errors > 0
        status = "ok" if not problems else f"{errors} error(s), {warnings} warning(s)"
        print(f"{target}: {status}")
        if args.address and not errors:
            from rankmesh.backends.ray.preflight import validate_on_cluster  # Ray only when asked

            report = validate_on_cluster(layout, args.address, args.resource)
            print(report.format())
            failed |= not report.ok
    return EXIT_INVALID if failed else EXIT_OK


_DRAW_SUFFIXES = (".png", ".svg", ".pdf")


def _check_output(output: str) -> None:
    """One line for every output path a picture cannot be written to, before any work is done."""
    if not output.lower().endswith(_DRAW_SUFFIXES):
        raise UsageError(f"output {output!r} must end in {', '.join(_DRAW_SUFFIXES)}")
    writable_file(output, "output", UsageError)


def _cmd_draw(args: argparse.Namespace) -> int:
    _check_output(args.output)
    layout = _resolve_layout(args)
    roles = [role.name for role in _selected_roles(layout, args.role)]
    from rankmesh.draw import draw_layout  # matplotlib is imported only here

    path = draw_layout(layout, args.output, roles=roles)
    print(f"wrote {path}")
    return EXIT_OK


# ----- rankmesh trace ... ----------------------------------------------------------------------


def _setup_trace(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION")
    p = sub.add_parser(
        "summarize",
        help="per method: call times, phases, slowest ranks, replica skew",
        description="Summarize a trace written by RANKMESH_TRACE=FILE or rankmesh.trace(FILE).",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=_cmd_trace_summarize)
    p = sub.add_parser(
        "plot",
        help="draw ranks coloured by worker-method time, and phases per call",
        description="Draw a trace: ranks by mesh coordinates coloured by worker-method time, and per-call phases.",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument("-o", "--output", required=True, help="output file: .png, .svg or .pdf")
    p.set_defaults(handler=_cmd_trace_plot)


def _cmd_trace_summarize(args: argparse.Namespace) -> int:
    summary = summarize(args.file)
    if args.json:
        print(json.dumps([dataclasses.asdict(m) | {"straggler": m.straggler} for m in summary.methods], indent=2))
    else:
        print(summary.format())
    return EXIT_OK


def _cmd_trace_plot(args: argparse.Namespace) -> int:
    _check_output(args.output)
    from rankmesh.tracing.plot import plot_trace  # matplotlib is imported only here

    print(f"wrote {plot_trace(args.file, args.output)}")
    return EXIT_OK


add_command("layout", _setup_layout, help="inspect, validate and draw parallel layouts")
add_command("trace", _setup_trace, help="summarize or plot a call trace (RANKMESH_TRACE=FILE)")
add_command("demo", demo_cli.setup, help=demo_cli.HELP)
