"""The event feed as a whole: every kind on ``bc.events.<kind>.<id>``, its union, and one decoder.

Each service's events are in its own contract module (``wire.engine``: workflow and node;
``wire.cmdq``: command and batch; ``wire.pki``: join and cert). This module only names them
together, for readers of the whole feed (``bcx events tail``, the ``BC_EVENTS`` stream). The
schema of every kind, field by field, is docs/events.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from . import cmdq, engine, pki

__all__ = ["FEED_KINDS", "decode_feed_event", "event_node", "event_workflow"]

_DECODERS: Final[dict[str, Callable[[bytes], Any]]] = {
    engine.EVENTS: engine.decode_workflow_event,
    engine.NODE_EVENTS: engine.decode_node_event,
    cmdq.EVENTS: cmdq.decode_command_event,
    cmdq.BATCH_EVENTS: cmdq.decode_batch_event,
    pki.JOIN_EVENTS: pki.decode_join_event,
    pki.CERT_EVENTS: pki.decode_cert_event,
}

FEED_KINDS: Final = tuple(_DECODERS)
"""``workflow``, ``node``, ``command``, ``batch``, ``join``, ``cert``: the subject's third token."""


def decode_feed_event(kind: str, data: bytes) -> Any | None:
    """The typed event of ``kind`` in ``data``; None for an unknown kind or an event this version
    does not know (a newer publisher's), which a reader passes over."""
    decoder = _DECODERS.get(kind)
    return decoder(data) if decoder is not None else None


def event_node(event: Any) -> str | None:
    """The node an event is about, when it names one."""
    node = getattr(event, "node_id", None)
    return node if isinstance(node, str) else None


def event_workflow(event: Any) -> str | None:
    """The workflow an event is about, when it names one."""
    wf = getattr(event, "workflow_id", None)
    return wf if isinstance(wf, str) else None
