"""A dataclass rebuilt from the plain values YAML gives, every value checked against its field's type,
and back. For plan.yaml (usp/contract/plan_file.py): the file is written from typed objects and read
back into the same types, so no reader works on a dict.

Hand-written rather than OmegaConf.structured + to_object, which rebuilds the config schema: measured,
OmegaConf refuses the plan's frozen dataclasses (OptimSettings, BatchPlan: ReadonlyConfigError on the
merge). Here a plan of a 16,384-rank run is read and rebuilt in 0.04 s (this project's VM), which
every rank does at start-up."""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from functools import cache
from typing import Any

from usp.errors import PlanError

_NONE = type(None)


class PlanFileError(PlanError):
    """plan.yaml doesn't hold what its version says (edited by hand, written by another usp)."""


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def rebuild(cls: Any, value: Any, source: str = "plan.yaml") -> Any:
    """`value` (dicts, lists, strings, numbers) as an instance of the type `cls`; PlanFileError naming
    the dotted key of the first value that doesn't fit, and `source`, the file it came from."""
    return _Rebuild(source).value(cls, value, "")


class _Rebuild:
    def __init__(self, source: str) -> None:
        self.source = source

    def value(self, cls: Any, value: Any, where: str) -> Any:
        if dataclasses.is_dataclass(cls) and isinstance(cls, type):
            return self.dataclass(cls, value, where)
        origin, args = typing.get_origin(cls), typing.get_args(cls)
        if origin in (typing.Union, types.UnionType):
            if value is None and _NONE in args:
                return None
            inner = [a for a in args if a is not _NONE]
            return self.value(inner[0], value, where) if len(inner) == 1 else self.first_fitting(inner, value, where)
        if origin is list:
            kind = args[0] if args else Any
            return [self.value(kind, v, f"{where}[{i}]") for i, v in enumerate(self.expect(list, value, where))]
        if origin is tuple:
            items = self.expect((list, tuple), value, where)
            repeated = len(args) == 2 and args[1] is Ellipsis
            kinds = [args[0]] * len(items) if repeated else list(args or [Any] * len(items))
            return tuple(self.value(k, v, f"{where}[{i}]") for i, (k, v) in enumerate(zip(kinds, items)))
        if origin is dict:
            key_type, value_type = args if args else (Any, Any)
            return {self.value(key_type, k, where): self.value(value_type, v, f"{where}.{k}")
                    for k, v in self.expect(dict, value, where).items()}
        return self.leaf(cls, value, where)

    def first_fitting(self, kinds: list, value: Any, where: str) -> Any:
        for kind in kinds:
            try:
                return self.value(kind, value, where)
            except PlanFileError:
                continue
        raise self.error(where, value, " or ".join(getattr(k, "__name__", str(k)) for k in kinds))

    def dataclass(self, cls: type, value: Any, where: str) -> Any:
        given = self.expect(dict, value, where)
        hints = _hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = [k for k in given if k not in known]
        if unknown:
            raise PlanFileError(f"{self.source} has a key {cls.__name__} doesn't know", key=_key(where, unknown[0]),
                                value=given[unknown[0]], fix=self.fix)
        values = {}
        for name, f in known.items():
            if name in given:
                values[name] = self.value(hints[name], given[name], _key(where, name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanFileError(f"{self.source} lacks a key", key=_key(where, name), value=None, fix=self.fix)
        return cls(**values)

    def leaf(self, cls: Any, value: Any, where: str) -> Any:
        if cls is Any or cls is object:
            return value
        if isinstance(cls, type) and issubclass(cls, enum.Enum):
            try:
                return cls(value)
            except ValueError:
                raise self.error(where, value, f"one of {', '.join(str(m.value) for m in cls)}") from None
        checks = {bool: lambda v: isinstance(v, bool), str: lambda v: isinstance(v, str),
                  int: lambda v: isinstance(v, int) and not isinstance(v, bool),
                  float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
        if cls in (dict, list):
            return self.expect(cls, value, where)
        if cls not in checks:
            return value
        if not checks[cls](value):
            raise self.error(where, value, cls.__name__)
        return float(value) if cls is float else value

    def expect(self, kind, value: Any, where: str) -> Any:
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise self.error(where, value, {"dict": "a mapping", "list": "a list"}.get(names, names))
        return value

    @property
    def fix(self) -> str:
        if self.source == "plan.yaml":
            return "plan the run again (the same usp train / usp submit command writes a new plan.yaml)"
        return f"correct {self.source}"

    def error(self, where: str, value: Any, wanted: str) -> PlanFileError:
        return PlanFileError(f"{self.source} holds {value!r} where {wanted} belongs", key=where or self.source,
                             value=value, fix=self.fix)


def _key(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def plain(value: Any) -> Any:
    """A typed object as the plain values YAML writes: dataclasses as dicts (init fields only), enums as
    their values, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
