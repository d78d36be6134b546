"""Prefixed, time-sortable identifiers: ``node_01J…``, ``wf_01J…``, ``cmd_01J…``.

The body is a ULID-like 26-character Crockford base32 string: 48 bits of
milliseconds then 80 random bits, so ids sort by creation time and compare as text.
Within one process ids made in the same millisecond still increase.
"""

from __future__ import annotations

import os
import re
import threading
import time

from .errors import BcError, ErrorCode
from .names import got

__all__ = ["ID_PREFIXES", "id_time_ms", "new_id", "parse_id"]

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DECODE = {c: i for i, c in enumerate(_ALPHABET)}

ID_PREFIXES = frozenset(
    {
        "node", "wf", "step", "cmd", "batch", "agent", "site", "tok", "cert", "sec",
        "prof", "img", "svc", "tenant", "appr", "evt", "lease", "rule",
    }
)  # fmt: skip

_EXAMPLE_BODY = "01JD8Q5X3N4V7W2K9M6R0T1B5C"
_ID_RE = re.compile(r"^([a-z][a-z0-9]*)_([0-9A-HJKMNP-TV-Z]{26})$")

_lock = threading.Lock()
_last_ms = -1
_last_rand = 0


def _encode(value: int, length: int) -> str:
    chars = []
    for _ in range(length):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_id(prefix: str) -> str:
    """A new id with ``prefix`` (one of ``ID_PREFIXES``)."""
    if prefix not in ID_PREFIXES:
        raise BcError(ErrorCode.INVALID_INPUT, f"unknown id prefix {prefix!r}", {"path": "prefix"})
    global _last_ms, _last_rand
    with _lock:
        now = time.time_ns() // 1_000_000
        if now <= _last_ms:
            now = _last_ms
            rand = (_last_rand + 1) & ((1 << 80) - 1)
        else:
            rand = int.from_bytes(os.urandom(10), "big")
        _last_ms, _last_rand = now, rand
    return f"{prefix}_{_encode(now, 10)}{_encode(rand, 16)}"


def parse_id(value: object, prefix: str | None = None, *, path: str = "id") -> str:
    """Return ``value`` if it is a well-formed id (with ``prefix`` when given);
    ``INVALID_INPUT`` at ``path``, with an example of the id expected, otherwise."""
    m = _ID_RE.match(value) if isinstance(value, str) else None
    if m is None or (prefix is not None and m.group(1) != prefix) or not isinstance(value, str):
        example = f"{prefix or 'node'}_{_EXAMPLE_BODY}"
        want = f"{prefix}_" if prefix else "a prefix such as node_"
        raise BcError(
            ErrorCode.INVALID_INPUT,
            f"{path or 'the id'} must be an id: {want} and 26 characters of Crockford base32,"
            f" e.g. {example}; got {got(value)}",
            {"path": path},
        )
    return value


def id_time_ms(value: str) -> int:
    """Milliseconds since the epoch at which the id was made."""
    body = parse_id(value).split("_", 1)[1]
    ms = 0
    for c in body[:10]:
        ms = ms * 32 + _DECODE[c]
    return ms
