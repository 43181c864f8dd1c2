"""The named dispatch modes (verl's ``Dispatch`` / ``Execute``) and the registry that holds them.

Every built-in mode is a :class:`~rankmesh.dispatch.spec.MeshSpec`; users may add modes made of
a ``dispatch_fn`` / ``collect_fn`` pair (verl's user-mode form), or of a spec.  The modes live in
a :class:`DispatchRegistry` object, never in bare module dicts; :data:`DEFAULT_REGISTRY` is the
one instance the module-level functions and :class:`Dispatch` use.

User-mode contract (checked at call time):

* ``dispatch_fn(worker_group, *args, **kwargs) -> (tuple[list, ...], dict[str, list])``: every
  returned list has ``worker_group.world_size`` items; rank ``r`` receives item ``r`` of each.
* ``collect_fn(worker_group, outputs: list) -> Any``: ``outputs`` holds every rank's output in rank
  order; whatever it returns is what the caller gets.
"""

from __future__ import annotations

import difflib
import enum
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Union

from rankmesh.dispatch.spec import DEFAULT_MESH, MEGATRON_COLLECT, MeshSpec
from rankmesh.errors import DispatchError

DispatchFn = Callable[..., "tuple[tuple[list, ...], dict[str, list]]"]
CollectFn = Callable[[Any, list], Any]


@dataclass(frozen=True)
class DispatchMode:
    """A member of :class:`Dispatch`: just a name, looked up in a registry when a group binds."""

    name: str

    @property
    def value(self) -> str:  # verl's enum members have a value
        return self.name

    def __repr__(self) -> str:
        return f"Dispatch.{self.name}"


@dataclass(frozen=True)
class UserMode:
    """A mode given as a ``dispatch_fn`` / ``collect_fn`` pair (see the module docstring)."""

    dispatch_fn: DispatchFn
    collect_fn: CollectFn
    name: str | None = None

    def __post_init__(self) -> None:
        for attr in ("dispatch_fn", "collect_fn"):
            if not callable(getattr(self, attr)):
                raise DispatchError(f"{attr} of dispatch mode {self.name or '<user>'} must be callable, got {getattr(self, attr)!r}")

    @property
    def label(self) -> str:
        return self.name or f"user mode {getattr(self.dispatch_fn, '__name__', self.dispatch_fn)!r}"

    @classmethod
    def from_dict(cls, mode: Mapping[str, Any], name: str | None = None) -> "UserMode":
        """verl's ``{"dispatch_fn": ..., "collect_fn": ...}`` form."""
        missing = {"dispatch_fn", "collect_fn"} - set(mode)
        extra = set(mode) - {"dispatch_fn", "collect_fn"}
        if missing or extra:
            raise DispatchError(
                f"a dispatch mode dict needs exactly the keys 'dispatch_fn' and 'collect_fn'"
                + (f"; missing {sorted(missing)}" if missing else "")
                + (f"; unexpected {sorted(extra)}" if extra else "")
            )
        return cls(mode["dispatch_fn"], mode["collect_fn"], name)


ModeEntry = Union[MeshSpec, UserMode]
ModeLike = Union[DispatchMode, MeshSpec, UserMode, Mapping[str, Any], str]


class Execute(enum.Enum):
    """Which ranks a call runs on: all of them, or rank 0 only (its output returned alone)."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


def _builtin_modes() -> dict[str, MeshSpec]:
    modes = {
        "ONE_TO_ALL": MeshSpec(),
        "ALL_TO_ALL": MeshSpec(split=("rank",), broadcast_fallback=True),
        "RANK_ZERO": MeshSpec(collect={"rank": 0}, run="collect", output="single"),
        "DP_COMPUTE": MeshSpec(split=("rank",)),
        "DP_COMPUTE_PROTO": MeshSpec(split=("rank",), proto=True),
        "DP_COMPUTE_PROTO_WITH_FUNC": MeshSpec(split=("rank",), proto=True, with_func=True),
        "DP_COMPUTE_METRIC": MeshSpec(split=("rank",), proto=True, output="list"),
        "MEGATRON_COMPUTE": MeshSpec(split=("dp",), collect=MEGATRON_COLLECT),
        "MEGATRON_COMPUTE_PROTO": MeshSpec(split=("dp",), collect=MEGATRON_COLLECT, proto=True),
        "MEGATRON_PP_AS_DP": MeshSpec(split=("cp", "dp", "pp"), collect={"tp": 0}),
        "MEGATRON_PP_AS_DP_PROTO": MeshSpec(split=("cp", "dp", "pp"), collect={"tp": 0}, proto=True),
        "MEGATRON_PP_ONLY": MeshSpec(collect={"tp": 0, "dp": 0, "cp": 0}),
    }
    return {name: spec.replace(name=name) for name, spec in modes.items()}


class DispatchRegistry:
    """Named dispatch modes.  One default instance backs :class:`Dispatch`; tests may make more."""

    def __init__(self, builtins: bool = True) -> None:
        self._entries: dict[str, ModeEntry] = dict(_builtin_modes()) if builtins else {}

    def __contains__(self, mode: object) -> bool:
        name = mode.name if isinstance(mode, DispatchMode) else mode
        return isinstance(name, str) and name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def mode(self, name: str) -> DispatchMode:
        """The member named ``name``; :class:`DispatchError` if it is not registered."""
        if name not in self._entries:
            raise DispatchError(
                f"unknown dispatch mode {name!r}{self.choices(name)}; a mode of your own must be added "
                "(register_dispatch_mode) before a group binds it"
            )
        return DispatchMode(name)

    def choices(self, name: str) -> str:
        """What to say after a name that is no mode here: the closest registered name, then all of them."""
        names = list(self._entries)
        spelled = re.sub(r"\W+", "_", name.strip()).upper()  # "dp-compute proto" -> "DP_COMPUTE_PROTO"
        guess = difflib.get_close_matches(name, names, n=1) or difflib.get_close_matches(spelled, names, n=1)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        return f"{hint} (registered: {', '.join(self._entries)})"

    def register_dispatch_mode(self, name: str, dispatch_fn: DispatchFn, collect_fn: CollectFn) -> DispatchMode:
        """Add a user mode (verl's ``register_dispatch_mode``); the name must be new."""
        return self._add(name, UserMode(dispatch_fn, collect_fn, name))

    def register_spec(self, name: str, spec: MeshSpec) -> DispatchMode:
        """Add a named mode that is a spec (e.g. a split over a named mesh)."""
        if not isinstance(spec, MeshSpec):
            raise DispatchError(f"register_spec needs a MeshSpec, got {type(spec).__name__}")
        return self._add(name, spec.replace(name=name))

    def update_dispatch_mode(self, dispatch_mode: DispatchMode | str, dispatch_fn: DispatchFn, collect_fn: CollectFn) -> None:
        """Replace an existing mode's functions (verl's ``update_dispatch_mode``).

        Groups resolve modes when they bind their methods, so the change reaches groups built later.
        """
        name = self._name_of(dispatch_mode)
        self.mode(name)
        self._entries[name] = UserMode(dispatch_fn, collect_fn, name)

    def remove(self, dispatch_mode: DispatchMode | str) -> None:
        name = self._name_of(dispatch_mode)
        self.mode(name)
        del self._entries[name]

    def resolve(self, mode: ModeLike) -> ModeEntry:
        """The spec or user mode behind anything ``@register(dispatch_mode=...)`` accepts."""
        if isinstance(mode, (MeshSpec, UserMode)):
            return mode
        if isinstance(mode, Mapping):
            return UserMode.from_dict(mode)
        return self._entries[self.mode(self._name_of(mode)).name]

    def _add(self, name: str, entry: ModeEntry) -> DispatchMode:
        if not isinstance(name, str) or not name.isidentifier():  # what @register refuses early (register._normalize_mode)
            raise DispatchError(f"a dispatch mode name must be an identifier such as 'MY_MODE', got {name!r}")
        if name in self._entries:
            raise DispatchError(f"dispatch mode {name!r} already exists; use update_dispatch_mode to replace it")
        self._entries[name] = entry
        return DispatchMode(name)

    @staticmethod
    def _name_of(mode: object) -> str:
        if isinstance(mode, DispatchMode):
            return mode.name
        if isinstance(mode, str):
            return mode
        raise DispatchError(
            f"dispatch_mode must be a Dispatch member, a MeshSpec, a mode name or a dict with "
            f"dispatch_fn/collect_fn, got {type(mode).__name__}: {mode!r}"
        )


#: The registry behind :class:`Dispatch` and the module-level functions.
DEFAULT_REGISTRY = DispatchRegistry()


class _DispatchMeta(type):
    """Makes ``Dispatch.NAME`` find modes registered at runtime, like verl's DynamicEnum."""

    def __getattr__(cls, name: str) -> DispatchMode:
        if name.startswith("__") or name not in DEFAULT_REGISTRY:
            raise AttributeError(f"Dispatch has no mode {name!r} (registered: {', '.join(DEFAULT_REGISTRY.names())})")
        return DispatchMode(name)

    def __iter__(cls) -> Iterator[DispatchMode]:
        return iter([DispatchMode(n) for n in DEFAULT_REGISTRY.names()])

    def __contains__(cls, mode: object) -> bool:
        return mode in DEFAULT_REGISTRY

    def __getitem__(cls, name: str) -> DispatchMode:
        return DEFAULT_REGISTRY.mode(name)


class Dispatch(metaclass=_DispatchMeta):
    """verl's dispatch modes.  Members are :class:`DispatchMode` values; new ones appear at runtime."""

    ONE_TO_ALL = DispatchMode("ONE_TO_ALL")
    ALL_TO_ALL = DispatchMode("ALL_TO_ALL")
    RANK_ZERO = DispatchMode("RANK_ZERO")
    DP_COMPUTE = DispatchMode("DP_COMPUTE")
    DP_COMPUTE_PROTO = DispatchMode("DP_COMPUTE_PROTO")
    DP_COMPUTE_PROTO_WITH_FUNC = DispatchMode("DP_COMPUTE_PROTO_WITH_FUNC")
    DP_COMPUTE_METRIC = DispatchMode("DP_COMPUTE_METRIC")
    MEGATRON_COMPUTE = DispatchMode("MEGATRON_COMPUTE")
    MEGATRON_COMPUTE_PROTO = DispatchMode("MEGATRON_COMPUTE_PROTO")
    MEGATRON_PP_AS_DP = DispatchMode("MEGATRON_PP_AS_DP")
    MEGATRON_PP_AS_DP_PROTO = DispatchMode("MEGATRON_PP_AS_DP_PROTO")
    MEGATRON_PP_ONLY = DispatchMode("MEGATRON_PP_ONLY")

    @staticmethod
    def from_name(name: str) -> DispatchMode:
        return DEFAULT_REGISTRY.mode(name)

    @staticmethod
    def named(
        mesh: str,
        split: tuple[str, ...] = ("dp",),
        collect: Mapping[str, int] | None = MEGATRON_COLLECT,
        proto: bool = True,
        **options: Any,
    ) -> MeshSpec:
        """A spec over a named mesh of the group, e.g. ``Dispatch.named("rollout", collect={"tp": 0})``.

        Defaults suit DataProto batches over that mesh's dp axis (verl's nd-compute modes).
        """
        return MeshSpec(split=split, collect=collect, mesh=mesh, proto=proto, **options)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> MeshSpec:
    """verl's nd-compute mode: DataProto split over ``mesh_name``'s dp, collect tp0 / last pp / cp0.

    If the group declares no mesh of that name, the group asks the workers for what they registered
    with ``_register_dispatch_collect_info(mesh_name, dp_rank, is_collect)``, as verl does.
    """
    return MeshSpec(split=("dp",), collect=MEGATRON_COLLECT, mesh=mesh_name, proto=True, name=f"nd_compute[{mesh_name}]")


def register_dispatch_mode(name: str, dispatch_fn: DispatchFn, collect_fn: CollectFn) -> DispatchMode:
    """Add a user mode to the default registry; ``Dispatch.<name>`` works afterwards."""
    return DEFAULT_REGISTRY.register_dispatch_mode(name, dispatch_fn, collect_fn)


def update_dispatch_mode(dispatch_mode: DispatchMode | str, dispatch_fn: DispatchFn, collect_fn: CollectFn) -> None:
    """Replace a mode of the default registry with a user mode."""
    DEFAULT_REGISTRY.update_dispatch_mode(dispatch_mode, dispatch_fn, collect_fn)


__all__ = [
    "DEFAULT_MESH",
    "DEFAULT_REGISTRY",
    "Dispatch",
    "DispatchMode",
    "DispatchRegistry",
    "Execute",
    "UserMode",
    "make_nd_compute_dataproto_dispatch_fn",
    "register_dispatch_mode",
    "update_dispatch_mode",
]
