"""Rows turned into the wire's views and events."""

from __future__ import annotations

import time

import msgspec

from better_compute.wire.cmdq import AgentStatus, AgentView, CommandEvent, CommandView

from .rows import AgentRow, CommandRow

__all__ = ["agent_view", "command_event", "command_view"]


def command_view(row: CommandRow, *, created: bool = False, full: bool = True) -> CommandView:
    """A command row as the wire's ``CommandView``; list pages leave out payload and result
    (``full=False``)."""
    return CommandView(
        id=row.id,
        node_id=row.node_id,
        site_id=row.site_id,
        tenant_id=row.tenant_id,
        agent_id=row.agent_id,
        kind=row.kind,
        key=row.key,
        target=row.target,
        state=row.state,
        reason=row.reason,
        progress=row.progress,
        destructive=row.destructive,
        batch_id=row.batch_id,
        workflow_id=row.workflow_id,
        step=row.step,
        payload=msgspec.json.decode(row.payload) if full else None,
        result=row.result if full else None,
        attested=row.attested,
        created=created,
        created_at=row.created_at,
        updated_at=row.updated_at,
        not_after=row.not_after,
    )


def command_event(row: CommandRow) -> CommandEvent:
    return CommandEvent(
        id=row.id,
        key=row.key,
        node_id=row.node_id,
        workflow_id=row.workflow_id,
        step=row.step,
        state=row.state,
        reason=row.reason,
        kind=row.kind,
        site_id=row.site_id,
        at=time.time(),
    )


def agent_view(row: AgentRow) -> AgentView:
    return AgentView(
        id=row.id,
        site_id=row.site_id,
        tenant_id=row.tenant_id,
        role=row.role,
        cert_id=row.cert_id,
        version=row.version,
        kinds=row.kinds,
        connected=row.connected,
        boot_lease=row.boot_lease,
        live_commands=row.live,
        connected_at=row.connected_at,
        last_seen=row.last_seen,
        status=_agent_status(row.status),
    )


def _agent_status(raw: str | None) -> AgentStatus | None:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=AgentStatus)
    except msgspec.MsgspecError:
        return None
