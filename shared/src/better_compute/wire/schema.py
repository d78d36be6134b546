"""A manifest derived from a msgspec Struct: one schema, written once as the Struct.

A command kind's payload is a Struct (``better_compute.wire.commands``); the command queue and a
profile step check a payload with the ``Manifest`` (did-you-mean, every problem at once, JSON
Schema for ``bcx``), and an agent decodes the same payload into the Struct. ``manifest_of`` builds
the manifest from the Struct, so the two never drift:

* field names are the Struct's encoded names (``rename="camel"``), in declaration order;
* ``X | None = None`` is an optional field, any other default a ``.default()``;
* ``str`` with ``msgspec.Meta(pattern, min_length, max_length)``, ``int`` with ``ge``/``le``,
  ``bool``, ``Literal[...]`` (an enum, in the order written), ``list[X]`` with
  ``min_length``/``max_length``, ``dict[str, X]``, a nested Struct, and ``Any`` (any JSON);
* a string whose pattern is ``SECRET_REF_PATTERN`` is a ``field.secret_ref()`` (the manifest also
  takes ``{"secretRef": "sec_…"}`` and hands the Struct the bare ``sec_…`` id).
"""

from __future__ import annotations

import types
import typing
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgspec

from ..core.errors import BcError, ErrorCode
from ..core.manifest import SECRET_REF_PATTERN, Field, Manifest, field, manifest

__all__ = ["manifest_of"]


@cache
def manifest_of(struct: type[msgspec.Struct]) -> Manifest:
    """The manifest of ``struct``'s fields (see the module's docstring for the mapping).

    Raises:
        BcError: ``INVALID_CONFIG`` for a field type the manifest cannot say.
    """
    hints = get_type_hints(struct, include_extras=True)
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    fields: dict[str, Field] = {}
    for f in info.fields:
        spec, nullable = _field(hints[f.name], f"{struct.__name__}.{f.name}")
        if f.default is not msgspec.NODEFAULT and f.default is not None:
            spec = spec.default(msgspec.to_builtins(f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            spec = spec.default(msgspec.to_builtins(f.default_factory()))
        elif nullable or not f.required:
            spec = spec.optional()
        fields[f.encode_name] = spec
    return manifest(fields)


def _meta(annotation: Any) -> tuple[Any, dict[str, Any]]:
    """The type under ``Annotated`` and its ``msgspec.Meta`` constraints, merged."""
    constraints: dict[str, Any] = {}
    while get_origin(annotation) is Annotated:
        annotation, *extras = get_args(annotation)
        for meta in extras:
            if isinstance(meta, msgspec.Meta):
                for name in ("pattern", "min_length", "max_length", "ge", "le"):
                    value = getattr(meta, name)
                    if value is not None:
                        constraints.setdefault(name, value)
    return annotation, constraints


def _field(annotation: Any, where: str) -> tuple[Field, bool]:
    """The field for one annotation, and whether it admits None."""
    annotation, meta = _meta(annotation)
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            raise _unsupported(where, annotation)
        spec, _ = _field(members[0], where)
        return spec, True
    return _plain(annotation, meta, where), False


def _plain(annotation: Any, meta: dict[str, Any], where: str) -> Field:
    origin = get_origin(annotation)
    if annotation is str:
        if meta.get("pattern") == SECRET_REF_PATTERN:
            return field.secret_ref()
        return field.string(
            pattern=meta.get("pattern"), min_length=meta.get("min_length"), max_length=meta.get("max_length")
        )
    if annotation is bool:
        return field.bool()
    if annotation is int:
        return field.int(min=meta.get("ge"), max=meta.get("le"))
    if annotation is Any or annotation is typing.Any:
        return field.json()
    if origin is Literal:
        return field.enum([str(v) for v in get_args(annotation)])
    if origin is list:
        (item,) = get_args(annotation)
        item_spec, _ = _field(item, f"{where}[]")
        return field.list(item_spec, min_items=meta.get("min_length"), max_items=meta.get("max_length"))
    if origin is dict:
        key, value = get_args(annotation)
        value_spec, _ = _field(value, f"{where}{{}}")
        if key is not str:
            raise _unsupported(where, annotation)
        return field.map(value_spec)
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return field.object(manifest_of(annotation))
    raise _unsupported(where, annotation)


def _unsupported(where: str, annotation: Any) -> BcError:
    return BcError(
        ErrorCode.INVALID_CONFIG,
        f"{where}: a manifest cannot say {annotation!r}",
        {"path": where},
    )
