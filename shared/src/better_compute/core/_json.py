"""Checking, deep-freezing and thawing JSON values.

Definitions (manifest defaults, profile documents) hold JSON data frozen so a caller cannot
change a registered definition behind the registry's back: objects become ``MappingProxyType``
over a private dict, arrays become tuples. ``thaw`` gives back fresh, mutable ``dict``/``list``
data that can be encoded or handed to a step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .errors import BcError, ErrorCode, join_path

__all__ = ["freeze_json", "thaw_json"]

# Deep enough for any real document; stops a self-referencing list from recursing forever.
_MAX_DEPTH = 64


def freeze_json(value: object, *, path: str, code: ErrorCode) -> Any:
    """A deep-frozen copy of ``value``, or ``BcError(code)`` at the first non-JSON part.

    JSON here means ``None``, ``bool``, ``int``, finite ``float``, ``str``, a mapping with
    ``str`` keys, or a list/tuple of JSON values. Sets, bytes, NaN and other objects are refused.
    """
    return _freeze(value, path, code, 0)


def _freeze(value: object, path: str, code: ErrorCode, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise BcError(code, f"nested deeper than {_MAX_DEPTH} levels", {"path": path})
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BcError(code, f"{value!r} is not a JSON number", {"path": path})
        return value
    if isinstance(value, Mapping):
        frozen: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise BcError(code, f"object keys must be strings, got {type(key).__name__}", {"path": path})
            frozen[key] = _freeze(item, join_path(path, key), code, depth + 1)
        return MappingProxyType(frozen)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item, f"{path}[{index}]", code, depth + 1) for index, item in enumerate(value))
    raise BcError(code, f"{type(value).__name__} is not a JSON value", {"path": path})


def thaw_json(value: Any) -> Any:
    """A fresh, mutable copy of a value made by ``freeze_json``."""
    if isinstance(value, Mapping):
        return {key: thaw_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw_json(item) for item in value]
    return value
