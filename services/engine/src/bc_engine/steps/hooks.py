"""The engine's hooks: how a plug-in of the engine (metal, ``bc_engine.metal``) adds what the
generic engine does not know, the way an app's plugins add their owner reconcilers.

* ``owners``: owner reconcilers by name; the key ``<owner>:<id>`` runs ``owners[owner](engine, id)``
  (a workflow started with ``owner`` queues it when it ends);
* ``wake_prefixes``: a command of no workflow whose key starts with the prefix wakes
  ``<owner>:<its node>`` when it settles;
* ``command_settled``: told of every command a step sent that succeeded (what it says of its node);
* ``payload_fillers``: fill in what a command's payload takes from its node (a BMC) before it is sent;
* ``event_handlers``: handlers of another service's events (``bc.events.<kind>.>``), by kind;
* ``side_loops``: loops the service runs beside the reconciler;
* ``routes``: ``bc.api.engine.*`` routes;
* ``host_config_owner``: the owner of a ``workflows.start`` whose profile has a ``hostConfig``;
* ``start_checks``: may refuse (raise a ``BcError``) a workflow on a node (its locked row, the
  workflow's owner); ``rerun_checks``: a retry or resume of one (the node's row, the verb);
* ``reopen``: a retried or resumed workflow's own clean-up undone, inside its transaction.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from nats.aio.msg import Msg

from better_compute.service import Handler
from better_compute.service.base import SideLoop

from .node import NodeInfo

__all__ = [
    "CommandSettled",
    "EngineHooks",
    "EventHandler",
    "OwnerReconciler",
    "PayloadFiller",
    "Publish",
    "Reopen",
    "RerunCheck",
    "StartCheck",
]

Publish = Callable[[str, str, Any], Awaitable[None]]  # (event kind, id, event): the service's feed
OwnerReconciler = Callable[[Any, str], Awaitable[None]]
# (node id, kind, payload, result) of a command that succeeded
CommandSettled = Callable[[str, str, Any, Any], Awaitable[None]]
EventHandler = Callable[[Msg], Awaitable[None]]
StartCheck = Callable[[Any, str | None], None]  # (node row, owner)
RerunCheck = Callable[[Any, str], None]  # (node row, verb)
Reopen = Callable[[Any, Any], Awaitable[None]]  # (connection, workflow row)


class PayloadFiller(Protocol):
    def needs(self, kind: str, payload: Any) -> bool:
        """Whether ``fill`` would add to this payload (so the node must be read for it)."""

    def fill(self, kind: str, payload: Any, node_id: str, node: NodeInfo | None) -> Any:
        """The payload with what it takes from the node; a ``BcError`` when the node lacks it."""


@dataclass
class EngineHooks:
    owners: dict[str, OwnerReconciler] = field(default_factory=dict)
    wake_prefixes: dict[str, str] = field(default_factory=dict)
    command_settled: list[CommandSettled] = field(default_factory=list)
    payload_fillers: list[PayloadFiller] = field(default_factory=list)
    event_handlers: dict[str, list[EventHandler]] = field(default_factory=dict)
    side_loops: dict[str, SideLoop] = field(default_factory=dict)
    routes: dict[str, Handler] = field(default_factory=dict)
    host_config_owner: str | None = None
    start_checks: list[StartCheck] = field(default_factory=list)
    rerun_checks: list[RerunCheck] = field(default_factory=list)
    reopen: list[Reopen] = field(default_factory=list)

    def on_event(self, kind: str, handler: EventHandler) -> None:
        self.event_handlers.setdefault(kind, []).append(handler)
