"""Names: tenants, sites and the like, checked where they enter with the field and an example.

A name may stand as one NATS subject token (``bc.site.<site>.cmd.*``) and as a key in every
service's store, so it is short and plain: 1 to 64 letters, digits, ``_`` or ``-``, starting
with a letter or digit. ``Name`` is the type for a wire field; ``parse_name`` checks a value a
handler holds. Both refuse with the same message (``describe_pattern`` gives it to the codec
for a ``Name`` field), so a caller reads the same words from every service.
"""

from __future__ import annotations

import re
from typing import Annotated, Final

import msgspec

from .errors import BcError, ErrorCode

__all__ = [
    "MAX_NAME",
    "NAME_PATTERN",
    "NODE_NAME_PATTERN",
    "Name",
    "NodeName",
    "describe_pattern",
    "got",
    "parse_name",
]

MAX_NAME: Final = 64
NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
_NAME_RE: Final = re.compile(NAME_PATTERN)
_NAME_RULE: Final = (
    f"1 to {MAX_NAME} letters, digits, '_' or '-', starting with a letter or digit, e.g. 'lab-1'"
)

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
"""A tenant, site or similar name: it may stand as one subject token."""

# A node's name is a host name (one DNS label or several, lowercase): it has no '_', so it can
# never be taken for a node id (node_…), and bcx takes either where it takes a node.
NODE_NAME_PATTERN: Final = r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$"
_NODE_NAME_RULE: Final = (
    "1 to 63 lowercase letters, digits, '-' or '.', starting and ending with a letter or digit,"
    " e.g. 'lab1-m001'"
)
NodeName = Annotated[str, msgspec.Meta(pattern=NODE_NAME_PATTERN)]
"""A node's name, unique in its site (``bcx nodes enroll --name``)."""

_RULES: Final = {NAME_PATTERN: _NAME_RULE, NODE_NAME_PATTERN: _NODE_NAME_RULE}


def got(value: object) -> str:
    """What a refused value was, without quoting it (a caller may have put a secret in the
    wrong field, and errors never carry secrets): its type, or a string's length."""
    if isinstance(value, str):
        return f"a string of {len(value)} characters" if value else "an empty string"
    return "null" if value is None else f"a {type(value).__name__}"


def describe_pattern(pattern: str) -> str | None:
    """The rule, with an example, of a pattern this module defines; None for any other."""
    return _RULES.get(pattern)


def parse_name(value: object, *, path: str) -> str:
    """Return ``value`` if it is a well-formed name; ``INVALID_INPUT`` at ``path`` otherwise."""
    if isinstance(value, str) and _NAME_RE.match(value):
        return value
    raise BcError(ErrorCode.INVALID_INPUT, f"{path or 'the name'} must be {_NAME_RULE}", {"path": path})
