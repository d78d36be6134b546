"""Decoding bus payloads into structs, with ``INVALID_INPUT`` and ``details.path`` on bad input.

The compatibility rule (docs/compatibility.md): a message on the bus ignores fields it does not
know, and every field added to a message has a default. An old client is then understood by a
new service (the new field takes its default) and a new client by an old service (the new field
is dropped), so services are upgraded one at a time. Only settings files, written by people,
refuse unknown keys (``better_compute.config``). Build messages on :class:`Message`.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from ..core.errors import BcError, ErrorCode

__all__ = ["Message", "convert", "decode", "encode", "validation_path"]

T = TypeVar("T")

_PATH_RE = re.compile(r" - at `\$(.*)`$")
_FIELD_RE = re.compile(r"^Object (?:missing required|contains unknown) field `([^`]+)`")
_encoder = msgspec.json.Encoder()


class Message(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Base of a message on the bus: frozen, keyword-only, camelCase on the wire, unknown fields
    ignored. A field added later must have a default."""


def validation_path(exc: msgspec.ValidationError | msgspec.DecodeError) -> str:
    """``$.steps[2].port`` in msgspec's message becomes ``steps[2].port``; a missing or unknown
    field's path names the field itself (``profileId``, ``steps[2].use``, ``cmdq.heartbeat_ms``)."""
    text = str(exc)
    m = _PATH_RE.search(text)
    where = m.group(1).lstrip(".") if m else ""
    field = _FIELD_RE.match(text)
    if field:
        return f"{where}.{field.group(1)}" if where else field.group(1)
    return where


def _message(exc: Exception) -> str:
    return _PATH_RE.sub("", str(exc))


def decode(data: bytes, typ: type[T]) -> T:
    """JSON bytes to ``typ``; malformed or invalid input is ``INVALID_INPUT``."""
    try:
        return msgspec.json.decode(data or b"{}", type=typ)
    except msgspec.ValidationError as exc:
        raise BcError(ErrorCode.INVALID_INPUT, _message(exc), {"path": validation_path(exc)}) from exc
    except msgspec.DecodeError as exc:
        raise BcError(ErrorCode.INVALID_INPUT, f"malformed JSON: {exc}", {"path": ""}) from exc


def convert(value: Any, typ: type[T], *, strict: bool = True) -> T:
    """Python value (already decoded) to ``typ``; invalid input is ``INVALID_INPUT``."""
    try:
        return msgspec.convert(value, typ, strict=strict)
    except msgspec.ValidationError as exc:
        raise BcError(ErrorCode.INVALID_INPUT, _message(exc), {"path": validation_path(exc)}) from exc


def encode(value: Any) -> bytes:
    return _encoder.encode(value)
