"""Decoding bus payloads into structs, with ``INVALID_INPUT`` and ``details.path`` on bad input.

The compatibility rule (docs/compatibility.md): a message on the bus ignores fields it does not
know, and every field added to a message has a default. An old client is then understood by a
new service (the new field takes its default) and a new client by an old service (the new field
is dropped), so services are upgraded one at a time. Only settings files, written by people,
refuse unknown keys (``better_compute.config``). Build messages on :class:`Message`.

Every request is also checked as plain JSON before it meets its type, so what PostgreSQL or
the interpreter cannot take is ``INVALID_INPUT`` with the path of the offending value, never
``INTERNAL``: a string or key holding NUL (PostgreSQL refuses it), nesting deeper than
``MAX_DEPTH``, an integer beyond int64. Unknown fields are checked too: they are skipped by
the type, but a 10,000-deep one would still exhaust the decoder.

The full check walks the decoded value in Python, several times the cost of decoding it. So the
raw bytes are looked at first, at C speed (``_suspect``): only a request that holds a NUL escape,
a run of 19 digits or a 3-digit exponent, or that nests deeper than ``MAX_DEPTH`` once its
strings are set aside, is walked; any other cannot fail the check (``bench/bench_codec.py``).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from ..core.errors import BcError, ErrorCode, join_path
from ..core.names import describe_pattern

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "MAX_DEPTH",
    "Message",
    "check_json",
    "check_nesting",
    "convert",
    "decode",
    "encode",
    "validation_path",
]

T = TypeVar("T")

_PATH_RE = re.compile(r" - at `\$(.*)`$")
_REGEX_RE = re.compile(r"^Expected `str` matching regex '(.*)'$")
_FIELD_RE = re.compile(r"^Object (?:missing required|contains unknown) field `([^`]+)`")
_encoder = msgspec.json.Encoder()

MAX_DEPTH = 64
"""Arrays and objects nested in a request: deep enough for any real document."""
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# A JSON token the depth scan cares about: a string (skipped whole), a bracket, a comma or colon.
_TOKEN_RE = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},:]')
# Every digit as 0 and E as e, so one substring search finds a long number or a 3-digit exponent.
_NUMBERS = bytes.maketrans(b"123456789E", b"000000000e")
_LONG_NUMBER: tuple[bytes, ...] = (b"0" * 19, b"e000", b"e+000", b"e-000")
# Brackets of both kinds as one: nesting counts them alike (a '[' closed by '}' is malformed,
# which the typed decode refuses).
_PARENS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")


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
    text = _PATH_RE.sub("", str(exc))
    pattern = _REGEX_RE.match(text)
    rule = describe_pattern(pattern.group(1)) if pattern else None
    if rule is not None and isinstance(exc, msgspec.ValidationError):
        # a Name field: the same words, with an example, as parse_name gives
        return f"{validation_path(exc) or 'the value'} must be {rule}"
    return text


def _invalid(message: str, path: str) -> BcError:
    return BcError(ErrorCode.INVALID_INPUT, message, {"path": path})


def check_json(value: Any, path: str = "") -> None:
    """Refuse, with its path, a string or key holding NUL, nesting deeper than ``MAX_DEPTH``
    or an integer beyond int64 anywhere in a decoded JSON value."""
    _check(value, path, 0)


def _check(value: Any, path: str, depth: int) -> None:
    if isinstance(value, str):
        if "\x00" in value:
            raise _invalid("a string may not hold a NUL character (\\u0000)", path)
    elif isinstance(value, bool):
        return
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise _invalid(f"an integer must lie between {INT64_MIN} and {INT64_MAX} (int64)", path)
    elif isinstance(value, (dict, list)):
        if depth >= MAX_DEPTH:
            raise _invalid(f"JSON may nest at most {MAX_DEPTH} levels", path)
        if isinstance(value, dict):
            for key, item in value.items():
                if "\x00" in key:
                    raise _invalid("an object key may not hold a NUL character (\\u0000)", path)
                _check(item, join_path(path, key), depth + 1)
        else:
            for index, item in enumerate(value):
                _check(item, f"{path}[{index}]", depth + 1)


def check_nesting(raw: bytes, path: str) -> None:
    """Refuse bytes that are JSON nesting deeper than ``MAX_DEPTH`` (``INVALID_INPUT`` at
    ``path`` and where it nests too deep): for opaque bytes from outside (an agent's command
    result) that a reader later decodes as JSON, where it would exhaust the decoder. Bytes that
    are not JSON pass: they are not this check's to judge."""
    if not _too_deep(b"".join(raw.split(b'"')[::2])):
        return
    try:
        msgspec.json.decode(raw)
    except RecursionError:
        pass
    except msgspec.DecodeError:
        return
    else:
        if _depth(raw) <= MAX_DEPTH:
            return
    raise _invalid(f"JSON may nest at most {MAX_DEPTH} levels", join_path(path, _deep_path(raw)))


def _depth(data: bytes) -> int:
    """How deep JSON ``data`` nests, read from its tokens (strings skipped whole)."""
    depth = deepest = 0
    for m in _TOKEN_RE.finditer(data):
        tok = m.group()
        if tok in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif tok in (b"]", b"}"):
            depth -= 1
    return deepest


def _deep_path(data: bytes) -> str:
    """Where ``data`` first nests deeper than ``MAX_DEPTH``, read from its tokens: for JSON the
    decoder cannot even hold (it ran out of recursion)."""
    stack: list[list[Any]] = []  # per open array or object: its bracket, then the current index or key
    last_string = ""
    for m in _TOKEN_RE.finditer(data):
        tok = m.group()
        if tok in (b"[", b"{"):
            if len(stack) >= MAX_DEPTH:
                break
            stack.append([tok, 0 if tok == b"[" else ""])
        elif tok in (b"]", b"}"):
            if stack:
                stack.pop()
        elif tok == b",":
            if stack and stack[-1][0] == b"[":
                stack[-1][1] += 1
        elif tok == b":":
            if stack:
                stack[-1][1] = last_string
        else:
            last_string = tok[1:-1].decode("utf-8", "replace")
    path = ""
    for bracket, where in stack:
        path = f"{path}[{where}]" if bracket == b"[" else join_path(path, where)
    return path


def _too_deep(structure: bytes) -> bool:
    """Whether JSON whose strings are cut out (``structure``) may nest deeper than ``MAX_DEPTH``:
    its brackets lose their innermost pairs once a round (one ``replace``: a pair it makes is
    left for the next round); what is left after ``MAX_DEPTH`` rounds nests deeper (or does not
    pair up: malformed, which the full check reports)."""
    brackets = structure.translate(_PARENS, _NOT_BRACKET)
    for done in range(MAX_DEPTH + 1):
        if len(brackets) <= 2 * (MAX_DEPTH - done):
            return False  # too few brackets left to nest past the limit
        brackets = brackets.replace(b"()", b"")
    return True


def _suspect(raw: bytes) -> bool:
    """Whether the full check could refuse ``raw``. It cannot without a NUL (raw or escaped),
    an integer of 19 digits or more, a 3-digit exponent (beyond float) and deep nesting; the
    numbers and brackets are looked for outside strings."""
    if b"\\u0000" in raw or b"\x00" in raw or b'\\"' in raw:
        return True  # an escaped quote would make the cut below wrong: walk it
    # With no escaped quote, every '"' opens or closes a string: the even pieces lie outside.
    structure = b"".join(raw.split(b'"')[::2])
    numbers = structure.translate(_NUMBERS)
    return any(n in numbers for n in _LONG_NUMBER) or _too_deep(structure)


def decode(data: bytes, typ: type[T]) -> T:
    """JSON bytes to ``typ``; malformed or invalid input is ``INVALID_INPUT``."""
    raw = data or b"{}"
    unchecked: msgspec.ValidationError | None = None
    try:
        if _suspect(raw):
            check_json(msgspec.json.decode(raw))
    except RecursionError as exc:
        raise _invalid(f"JSON may nest at most {MAX_DEPTH} levels", _deep_path(raw)) from exc
    except msgspec.ValidationError as exc:
        unchecked = exc  # a number beyond float: the typed decode below names its path
    except msgspec.DecodeError as exc:
        raise _invalid(f"malformed JSON: {exc}", "") from exc
    try:
        value = msgspec.json.decode(raw, type=typ)
    except msgspec.ValidationError as exc:
        raise BcError(ErrorCode.INVALID_INPUT, _message(exc), {"path": validation_path(exc)}) from exc
    except msgspec.DecodeError as exc:
        raise BcError(ErrorCode.INVALID_INPUT, f"malformed JSON: {exc}", {"path": ""}) from exc
    except RecursionError as exc:  # never passed the check above; refused all the same
        raise _invalid(f"JSON may nest at most {MAX_DEPTH} levels", _deep_path(raw)) from exc
    if unchecked is not None:
        # in a field the type skips, but the rest of the request was never checked
        raise _invalid(_message(unchecked), "") from unchecked
    return value


def convert(value: Any, typ: type[T], *, strict: bool = True) -> T:
    """Python value (already decoded) to ``typ``; invalid input is ``INVALID_INPUT``."""
    try:
        check_json(value)
    except RecursionError as exc:
        raise _invalid(f"JSON may nest at most {MAX_DEPTH} levels", "") from exc
    try:
        return msgspec.convert(value, typ, strict=strict)
    except msgspec.ValidationError as exc:
        raise BcError(ErrorCode.INVALID_INPUT, _message(exc), {"path": validation_path(exc)}) from exc


def encode(value: Any) -> bytes:
    return _encoder.encode(value)
