"""How a worker class and its constructor arguments travel to a group's processes, and one line naming what cannot.

A class travels by name when the workers can import it, otherwise by value (a class defined in
a script's ``__main__``), with every global its methods read.  Each role is pickled here, once,
when the group starts, by :class:`ClassPickler`; a class or constructor argument that cannot be
pickled is refused before any process starts, with one line that names the part that failed,
why it travels at all, and the fixes (:func:`sent_role`).  Without this a verl worker ported
from a script failed after its processes had started, with a 35-line Ray serialization
traceback ending in ``cannot pickle 'ConfigModuleInstance' object`` and nothing naming the cause.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import sys
import types
from typing import Any, Iterator, Mapping

from ray import cloudpickle
from ray.cloudpickle import cloudpickle as cloudpickle_parts  # what cloudpickle sends of a class or function

from rankmesh.errors import WorkerPickleError

from .files import is_ray_handle
from .hostapi import PickledClass, RoleInit


class ClassPickler(cloudpickle.CloudPickler):
    """cloudpickle, except that a module of any type travels by name, as cloudpickle sends plain modules.

    cloudpickle picks its module rule by exact type, so a module whose type subclasses
    ``ModuleType`` falls through to plain pickle, which refuses it.  torch's config modules are
    such (``torch.distributed.config`` is a ``ConfigModuleInstance``), and a class sent by value
    takes along every loaded submodule of a package global it reads whose name is also a name
    its code reads: a verl worker in ``__main__`` that reads ``dist`` and ``self.config`` takes
    ``torch.distributed.config``.  By name is sound for the reason it is for plain modules: a
    module's state never travels, each worker imports its own.
    """

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


class _Discard:
    """A file that keeps nothing: trial pickling measures nothing but success."""

    def write(self, data: Any) -> int:
        return len(data)


class _TrialPickler(ClassPickler):
    """:class:`ClassPickler` that leaves out ``skip`` (the walk's ancestors, so a method that
    names its own class is tried alone) and Ray's handles (:func:`.files.is_ray_handle`); Ray
    pickles those itself."""

    def __init__(self, skip: frozenset[int] = frozenset()) -> None:
        super().__init__(_Discard(), protocol=5)
        self._skip = skip

    def persistent_id(self, obj: Any) -> Any:
        if id(obj) in self._skip or is_ray_handle(obj):
            return id(obj)
        return None


def _pickle_error(obj: Any, skip: frozenset[int] = frozenset()) -> Exception | None:
    """Why ``obj`` does not pickle (leaving ``skip`` out), or None when it does."""
    try:
        _TrialPickler(skip).dump(obj)
    except Exception as exc:  # noqa: BLE001 - any failure of pickle is the answer
        return exc
    return None


def _by_value(obj: Any) -> bool:
    """Whether cloudpickle sends ``obj`` (a class or function) by value; a class of ``__main__`` is, should
    a cloudpickle release drop the private rule this asks."""
    by_reference = getattr(cloudpickle_parts, "_should_pickle_by_reference", None)
    if by_reference is None:
        return getattr(obj, "__module__", None) == "__main__"
    return not by_reference(obj)


def _parts(obj: Any) -> Iterator[tuple[str, Any]]:
    """What pickling ``obj`` takes along, each with the words that name it in a path."""
    if isinstance(obj, type) and _by_value(obj):
        for base in obj.__bases__:
            yield f"base {base.__qualname__}", base
        for name, value in cloudpickle_parts._class_getstate(obj)[0].items():
            yield f"{obj.__qualname__}.{name}", value
    elif isinstance(obj, (staticmethod, classmethod)):
        yield obj.__func__.__qualname__, obj.__func__
    elif isinstance(obj, property):
        yield from ((f.__qualname__, f) for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
    elif isinstance(obj, types.FunctionType) and _by_value(obj):
        attrs, slots = cloudpickle_parts._function_getstate(obj)
        yield from ((f"global {name}", value) for name, value in slots["__globals__"].items())
        yield from ((f"module {module.__name__}", module) for module in slots["_cloudpickle_submodules"])
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                yield f"variable {name}", cell.cell_contents
            except ValueError:  # an empty cell pickles
                continue
        yield from ((f"a default of {obj.__qualname__}", value) for value in obj.__defaults__ or ())
        yield from ((f"the default of {name}", value) for name, value in (obj.__kwdefaults__ or {}).items())
        yield from ((f"the annotation of {name}", value) for name, value in obj.__annotations__.items())
        yield from ((f".{name}", value) for name, value in attrs.items())
    elif isinstance(obj, Mapping):
        yield from ((f"[{key!r}]", value) for key, value in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from ((f"[{i}]", value) for i, value in enumerate(obj))
    elif not isinstance(obj, (type, types.ModuleType, types.FunctionType)) and hasattr(obj, "__dict__"):
        yield from ((f".{name}", value) for name, value in vars(obj).items())


def _unpicklable_path(obj: Any, where: str, max_depth: int = 12) -> tuple[list[tuple[str, Any]], Exception] | None:
    """The path from ``obj`` down to the first part that does not pickle on its own, and its error.

    Each step tries the parts alone, its ancestors left out; the last step is a part none of
    whose own parts fails, which is the one to name.
    """
    error = _pickle_error(obj)
    if error is None:
        return None
    path = [(where, obj)]
    try:
        while len(path) < max_depth:
            ancestors = frozenset(id(o) for _, o in path)
            for name, part in _parts(path[-1][1]):
                if id(part) in ancestors:
                    continue
                part_error = _pickle_error(part, ancestors)
                if part_error is not None:
                    path.append((name, part))
                    error = part_error
                    break
            else:
                break
    except Exception:  # noqa: BLE001 - _parts reads cloudpickle's private helpers: name what was found so far
        pass
    return path, error


def _travel_reason(cls: type) -> tuple[str, str]:
    """Why ``cls`` is pickled by value, and the fix that makes it travel by name."""
    name = cls.__qualname__
    if cls.__module__ == "__main__":
        return (f"{name} is defined in __main__, so it is pickled by value with every global its methods read",
                f"move {name} into a module the workers can import (a file next to the script: from workers import {cls.__name__})")
    if "<locals>" in name:
        return (f"{name} is defined inside a function, so it is pickled by value with every global its methods read",
                f"define {cls.__name__} at the top level of a module the workers can import")
    return (f"{name} is pickled by value (its module {cls.__module__} is registered for it, or does not define it by that name)",
            f"make {name} importable as {cls.__module__}.{name}, not registered with cloudpickle.register_pickle_by_value")


def _describe(path: list[tuple[str, Any]], error: Exception) -> str:
    """``ActorWorker.init_model -> global CONFIG.lock (a lock: TypeError: cannot pickle ...)``.

    A decorator's wrapped function is left out (``@register``'s closure holds the method of the same name).
    """
    text = ""
    for i, (name, part) in enumerate(path):
        if i and _same_function(path[i - 1][1], part):
            continue
        text += name if not text or name.startswith((".", "[")) else f" -> {name}"
    return f"{text} (a {type(path[-1][1]).__name__}: {type(error).__name__}: {error})"


def _same_function(outer: Any, inner: Any) -> bool:
    return isinstance(inner, types.FunctionType) and getattr(outer, "__qualname__", None) == inner.__qualname__


def _class_error(cls: type, path: list[tuple[str, Any]], error: Exception) -> WorkerPickleError:
    """The one-line error for a worker class that cannot be pickled."""
    by_value = [part for _, part in path if isinstance(part, type) and _by_value(part)] or [cls]
    why, move = _travel_reason(by_value[-1])
    named = [name.split(" ", 1)[1] for name, _ in path if name.startswith(("global ", "variable ", "module "))]
    keep_out = (f"stop reading {named[-1]} from the class (import or create it inside the method, or in __init__)" if named
                else f"create {path[-1][0]} in __init__ instead of keeping it on the class")
    return WorkerPickleError(
        f"cannot send worker class {cls.__qualname__} to its processes: {_describe(path[1:] or path, error)}; {why}. "
        f"Fix: {move}; or {keep_out}"
    )


def _argument_error(cls: type, path: list[tuple[str, Any]], error: Exception) -> WorkerPickleError:
    """The one-line error for a constructor argument that cannot be pickled."""
    return WorkerPickleError(
        f"cannot send the constructor arguments of {cls.__qualname__} to its processes: {_describe(path, error)}. "
        f"Fix: pass values that pickle (plain data, a dataclass, a DictConfig) and build the rest in {cls.__qualname__}.__init__"
    )


@dataclasses.dataclass(frozen=True)
class _SentRole(RoleInit):
    """A :class:`RoleInit` whose class travels as ``payload`` (pickled once, by :class:`ClassPickler`).

    Arguments stay with Ray's pickling, which knows its handles; a worker receives a plain RoleInit whose
    class the host loads when it builds the role (:func:`.hostapi.role_class`).
    """

    payload: bytes = dataclasses.field(default=b"", repr=False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return RoleInit, (PickledClass(self.payload), self.args, dict(self.kwargs))


def sent_role(cls: type, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> RoleInit:
    """``cls(*args, **kwargs)`` as it travels to every process, or a :class:`WorkerPickleError` naming what cannot travel."""
    buffer = io.BytesIO()
    try:
        ClassPickler(buffer, protocol=5).dump(cls)
    except Exception as exc:  # noqa: BLE001 - what failed is found and named below
        found = _unpicklable_path(cls, cls.__qualname__)
        path, error = found if found is not None else ([(cls.__qualname__, cls)], exc)
        raise _class_error(cls, path, error) from None
    named_args = {**{f"argument {i}": v for i, v in enumerate(args)}, **{f"argument {k}": v for k, v in kwargs.items()}}
    for where, value in named_args.items():
        found = _unpicklable_path(value, where)
        if found is not None:
            raise _argument_error(cls, *found) from None
    return _SentRole(cls, tuple(args), dict(kwargs), buffer.getvalue())
