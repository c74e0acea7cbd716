"""The config schema's Hydra side: usp/contract/config_schema.py's dataclasses registered in Hydra's
ConfigStore, and the lookups the config layer makes in them (a key's field, its default, the
Enum-typed keys, every leaf key)."""
from __future__ import annotations

from enum import StrEnum
from functools import cache
from typing import Any, cast

from usp.contract import config_schema
from usp.contract.config_schema import UspConfig

SCHEMA_NAME = "usp_schema"
GROUPS = ("model", "parallelism", "optimizer", "cluster", "data", "fault_tolerance")


@cache  # once per process: storing the schema converts it to a config (~30 ms), and Hydra copies it on every load
def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=UspConfig)


def schema_field(dotted: str) -> Any:
    """The dataclasses.Field of a dotted schema key (train.seed, cluster.slurm.time), or None."""
    import typing
    from dataclasses import is_dataclass

    cls: Any = UspConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        found = cls.__dataclass_fields__.get(part)
        if found is None or i == len(parts) - 1:
            return found
        cls = typing.get_type_hints(cls)[part]
        if not is_dataclass(cls):
            return None
    return None


def default_of(dotted: str) -> Any:
    """The schema's default of a dotted key (an Enum default as its string), or None."""
    from dataclasses import MISSING

    found = schema_field(dotted)
    if found is None:
        return None
    value = found.default_factory() if found.default is MISSING and found.default_factory is not MISSING \
        else found.default
    return str(value) if isinstance(value, StrEnum) else value


@cache
def enum_keys(cls: Any = None, prefix: str = "") -> dict[str, type[StrEnum]]:
    """Every Enum-typed key (dotted) -> its Enum; read from the fields' annotation strings, without
    evaluating every annotation (schema_keys does, ~10 ms: this runs on every `usp plan`)."""
    import re
    from dataclasses import fields, is_dataclass

    out: dict[str, type[StrEnum]] = {}
    for f in fields(cls or UspConfig):
        for name in re.findall(r"\w+", str(f.type)):
            kind = getattr(config_schema, name, None)
            if isinstance(kind, type) and issubclass(kind, StrEnum):
                out[f"{prefix}{f.name}"] = kind
            elif isinstance(kind, type) and is_dataclass(kind) and not str(f.type).startswith("list"):
                out.update(enum_keys(cast(Any, kind), f"{prefix}{f.name}."))
    return out


@cache
def schema_keys(cls: Any = None, prefix: str = "") -> dict[str, Any]:
    """Every leaf key of the schema (dotted; a list of dataclasses as `key[].field`) -> its type (cached:
    don't change the dict)."""
    import typing
    from dataclasses import is_dataclass

    out: dict[str, Any] = {}
    for name, hint in typing.get_type_hints(cls or UspConfig).items():
        inner = typing.get_args(hint)
        if is_dataclass(hint):
            out.update(schema_keys(cast(Any, hint), f"{prefix}{name}."))
        elif typing.get_origin(hint) is list and inner and is_dataclass(inner[0]):
            out.update(schema_keys(cast(Any, inner[0]), f"{prefix}{name}[]."))
        else:
            out[f"{prefix}{name}"] = hint
    return out
