"""The audit contract every service with a store serves: ``bc.api.<service>.audit.list``.

An audit entry is one operator action that changed state (docs/audit.md): who asked (the NATS
user the server named, or the requester's claimed identity, the ``Bc-Actor`` header), when, the
route, its target and a short, whitelisted detail (never a secret value).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from .paging import Cursor

__all__ = ["ACTOR_HEADER", "MAX_ACTOR", "AuditEntry", "AuditList", "ListAudit"]

ACTOR_HEADER: Final = "Bc-Actor"
"""The request header naming who asks (``alice@ops-laptop``, ``service:bc-engine``)."""
MAX_ACTOR: Final = 128
"""An actor longer than this is cut: it is a claim, shown in tables, not a document."""


class ListAudit(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """``audit.list``: the newest entries first, at or after ``since`` (epoch seconds), of one
    actor when ``who`` is given (``who`` ending in ``*`` matches a prefix)."""

    since: Annotated[float, msgspec.Meta(ge=0, le=32_503_680_000)] | None = None
    """Epoch seconds (up to the year 3000)."""
    who: Annotated[str, msgspec.Meta(max_length=MAX_ACTOR + 1)] | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 100
    cursor: Cursor | None = None


class AuditEntry(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    id: int
    at: float
    service: str
    actor: str | None
    """Who asked: the NATS user when ``verified``, else what the request said (its
    ``Bc-Actor`` header); None when it did not say (an SDK client without one)."""
    action: str
    """The route: ``workflows.abort``, ``tokens.issue``, ``batches.approve``, …"""
    target: str | None
    detail: dict[str, Any] = msgspec.field(default_factory=dict)
    verified: bool = False
    """``actor`` is the NATS user nats-server named for the request (an operator's own user in
    the deployed OPS account), not a claim."""


class AuditList(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    entries: list[AuditEntry]
    next: str | None = None
