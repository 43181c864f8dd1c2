"""``@register``: mark a worker method as callable through a worker group, and how.

The decorator stores a frozen :class:`MethodSpec` on the function as ``__rankmesh_register__``
(an explicit attribute, not a magic string) and wraps the function so that, on the worker side,
``DataProtoFuture`` arguments are materialized before the body runs.  The group reads the spec
with :func:`registered_methods` when it binds; nothing else is stored anywhere.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, TypeVar

from rankmesh.data import DataProtoFuture
from rankmesh.dispatch.modes import DEFAULT_REGISTRY, Dispatch, DispatchMode, Execute, ModeLike, UserMode
from rankmesh.dispatch.spec import MeshSpec
from rankmesh.errors import DispatchError
from rankmesh.backend import CALL_RECEIVE

F = TypeVar("F", bound=Callable[..., Any])

#: Attribute holding a registered method's :class:`MethodSpec`.
REGISTER_ATTR = "__rankmesh_register__"


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` said about one worker method.

    ``padding``: ``True`` pads uneven batches for this method, ``False`` never pads (even when the
    batch or ``DataProtoConfig`` asks for it), ``None`` leaves it to the spec and the batch.
    ``receive``: how each rank receives its inputs (:data:`rankmesh.backend.CALL_RECEIVE`):
    ``"cow"`` copy-on-write views of the shared bytes (the default: nothing copied until the
    worker writes, then only the written pages), ``"copy"`` one private copy up front, for methods
    that overwrite most of their input.  A group's ``set_receive`` overrides it.
    """

    dispatch_mode: DispatchMode | MeshSpec | UserMode
    execute_mode: Execute = Execute.ALL
    blocking: bool = True
    materialize_futures: bool = True
    padding: bool | None = None
    receive: str = "cow"

    def __post_init__(self) -> None:
        if not isinstance(self.execute_mode, Execute):
            raise DispatchError(f"execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {self.execute_mode!r}")
        for attr in ("blocking", "materialize_futures"):
            if not isinstance(getattr(self, attr), bool):
                raise DispatchError(f"{attr} must be a bool, got {getattr(self, attr)!r}")
        if self.padding is not None and not isinstance(self.padding, bool):
            raise DispatchError(f"padding must be True, False or None, got {self.padding!r}")
        if self.receive not in CALL_RECEIVE:
            raise DispatchError(f"receive must be one of {CALL_RECEIVE}, got {self.receive!r}")


def _normalize_mode(mode: ModeLike) -> DispatchMode | MeshSpec | UserMode:
    if isinstance(mode, (DispatchMode, MeshSpec, UserMode)):
        return mode
    if isinstance(mode, Mapping):
        return UserMode.from_dict(mode)
    if isinstance(mode, str):
        # A name is looked up when a group binds (a registry may learn it after this class is
        # defined, so an unknown identifier waits for that); one that is no identifier can never be
        # registered (DispatchRegistry._add), so it is refused here, at class definition.
        if not mode.isidentifier():
            raise DispatchError(
                f"dispatch_mode={mode!r} can never name a dispatch mode: mode names are identifiers"
                f"{DEFAULT_REGISTRY.choices(mode)}; or pass a Dispatch member, e.g. Dispatch.DP_COMPUTE_PROTO"
            )
        return DispatchMode(mode)
    raise DispatchError(
        f"dispatch_mode must be a Dispatch member, a MeshSpec, a mode name or a dict with "
        f"dispatch_fn/collect_fn, got {type(mode).__name__}: {mode!r}"
    )


def materialize_futures(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Replace every top-level ``DataProtoFuture`` argument by its data (``.get()``)."""
    if not any(isinstance(a, DataProtoFuture) for a in (*args, *kwargs.values())):
        return args, kwargs
    args = tuple(a.get() if isinstance(a, DataProtoFuture) else a for a in args)
    kwargs = {k: v.get() if isinstance(v, DataProtoFuture) else v for k, v in kwargs.items()}
    return args, kwargs


def register(
    dispatch_mode: ModeLike = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    *,
    padding: bool | None = None,
    receive: str = "cow",
) -> Callable[[F], F]:
    """Expose a worker method on worker groups.

    ``dispatch_mode`` is a :class:`Dispatch` member, a :class:`MeshSpec`, a registered mode name,
    or verl's ``{"dispatch_fn": ..., "collect_fn": ...}`` dict.  ``blocking=False`` makes the
    group method return a future.  ``materialize_futures=False`` hands ``DataProtoFuture``
    arguments to the method unfetched.  ``receive="copy"`` gives each rank one private copy of its
    inputs up front instead of copy-on-write views (for methods that overwrite their input; see
    :class:`MethodSpec`).  Works for ``def`` and ``async def`` methods.
    """
    spec = MethodSpec(_normalize_mode(dispatch_mode), execute_mode, blocking, materialize_futures, padding, receive)
    return functools.partial(_decorate, spec)  # type: ignore[return-value]


def _decorate(spec: MethodSpec, func: F) -> F:
    if not callable(func):
        raise DispatchError(f"@register decorates a method, got {func!r}")
    materialize = spec.materialize_futures
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            if materialize:
                args, kwargs = materialize_futures(args, kwargs)
            return await func(*args, **kwargs)

    else:

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if materialize:
                args, kwargs = materialize_futures(args, kwargs)
            return func(*args, **kwargs)

    setattr(wrapper, REGISTER_ATTR, spec)
    return wrapper  # type: ignore[return-value]


def method_spec(func: Any) -> MethodSpec | None:
    """The :class:`MethodSpec` of a registered function, or ``None``."""
    spec = getattr(func, REGISTER_ATTR, None)
    return spec if isinstance(spec, MethodSpec) else None


def registered_methods(cls: type) -> dict[str, tuple[Callable[..., Any], MethodSpec, bool]]:
    """Every registered method of ``cls`` (own and inherited): name -> (function, spec, is_static)."""
    found: dict[str, tuple[Callable[..., Any], MethodSpec, bool]] = {}
    for name in dir(cls):
        attr = inspect.getattr_static(cls, name, None)
        static = isinstance(attr, staticmethod)
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        spec = method_spec(attr)
        if spec is not None:
            found[name] = (attr, spec, static)
    return found
