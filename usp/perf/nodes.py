"""Field access for a config node, a dataclass or a plain dict alike (the planner reads composed
configs, plan.yaml dicts and dataclasses through it). Pure Python."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


def getter(obj) -> Callable[..., Any]:
    """g(key, default) over `obj`."""
    if isinstance(obj, dict):
        return lambda k, d=None: obj.get(k, d)
    return lambda k, d=None: getattr(obj, k, d)
