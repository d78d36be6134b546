"""The client of bc-command-queue: ``CommandQueueClient`` (the engine, bcx and
``await_command`` use it). The routes and their Structs are ``better_compute.wire.cmdq``;
approvers sign a batch with ``better_compute.crypto.sign_batch``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ..core.errors import BcError, ErrorCode
from ..wire.cmdq import (
    EVENTS,
    SERVICE,
    TERMINAL_STATES,
    AgentList,
    AgentView,
    ApproveBatch,
    BatchIdRequest,
    BatchList,
    BatchState,
    BatchView,
    CancelCommands,
    CancelReply,
    CloseBatch,
    CommandIdRequest,
    CommandList,
    CommandState,
    CommandStates,
    CommandStatesReply,
    CommandView,
    CreateBatch,
    EnqueueCommand,
    ListAgents,
    ListBatches,
    ListCommands,
    LiveWithRef,
    LiveWithRefReply,
    QuorumView,
    SiteAgentReply,
    SiteAgentRequest,
)
from ..wire.paging import DEFAULT_LIMIT
from ._base import ServiceClient

__all__ = ["CommandQueueClient"]


class CommandQueueClient(ServiceClient):
    """Calls to bc-command-queue over NATS; raises the service's ``BcError``s."""

    service = SERVICE

    async def enqueue(self, command: EnqueueCommand) -> CommandView:
        """Find the command by (node, key), or create it."""
        return await self._call("commands.enqueue", command, CommandView)

    async def get(self, *, id: str) -> CommandView:
        return await self._call("commands.get", CommandIdRequest(id=id), CommandView)

    async def list_commands(
        self,
        *,
        node_id: str | None = None,
        workflow_id: str | None = None,
        state: CommandState | None = None,
        kind: str | None = None,
        site_id: str | None = None,
        agent_id: str | None = None,
        batch_id: str | None = None,
        before: str | None = None,
        limit: int = 100,
    ) -> CommandList:
        req = ListCommands(
            node_id=node_id,
            workflow_id=workflow_id,
            state=state,
            kind=kind,
            site_id=site_id,
            agent_id=agent_id,
            batch_id=batch_id,
            before=before,
            limit=limit,
        )
        return await self._call("commands.list", req, CommandList)

    async def cancel(
        self,
        *,
        id: str | None = None,
        node_id: str | None = None,
        key_prefix: str | None = None,
        reason: str = "cancelled",
    ) -> list[str]:
        """Cancel one live command, or every live one under ``key_prefix``; returns their ids."""
        req = CancelCommands(id=id, node_id=node_id, key_prefix=key_prefix, reason=reason)
        return (await self._call("commands.cancel", req, CancelReply)).cancelled

    async def cancel_under(
        self,
        *,
        key_prefix: str,
        workflow_id: str | None = None,
        node_id: str | None = None,
        fence: bool = False,
        reason: str = "cancelled",
    ) -> CancelReply:
        """Cancel every live command under ``key_prefix`` of ``workflow_id`` (on any node) or
        on ``node_id``; with ``fence``, refuse later enqueues under it. The reply also names
        the claimed commands that may still run at their agents."""
        req = CancelCommands(
            key_prefix=key_prefix, workflow_id=workflow_id, node_id=node_id, fence=fence, reason=reason
        )
        return await self._call("commands.cancel", req, CancelReply)

    async def states(self, *, ids: list[str]) -> dict[str, str]:
        """``id -> state`` of the commands that exist (at most ``MAX_STATE_QUERY`` ids)."""
        return (await self._call("commands.states", CommandStates(ids=ids), CommandStatesReply)).states

    async def live_with_ref(
        self, *, agent_id: str, ref: str, key_prefix: str, node_id: str | None = None
    ) -> LiveWithRefReply:
        req = LiveWithRef(agent_id=agent_id, ref=ref, key_prefix=key_prefix, node_id=node_id)
        return await self._call("commands.live_with_ref", req, LiveWithRefReply)

    async def agents(
        self,
        *,
        site_id: str | None = None,
        role: str | None = None,
        connected: bool | None = None,
        limit: int = DEFAULT_LIMIT,
    ) -> list[AgentView]:
        """The first page; ``agents_page`` gives the cursor of the rest."""
        return (await self.agents_page(site_id=site_id, role=role, connected=connected, limit=limit)).agents

    async def agents_page(
        self,
        *,
        site_id: str | None = None,
        role: str | None = None,
        connected: bool | None = None,
        limit: int = DEFAULT_LIMIT,
        cursor: str | None = None,
    ) -> AgentList:
        """One page of agents (by site, then id); pass its ``next`` as ``cursor`` for the next."""
        req = ListAgents(site_id=site_id, role=role, connected=connected, limit=limit, cursor=cursor)
        return await self._call("agents.list", req, AgentList)

    async def site_agent(self, *, site_id: str | None = None, node_id: str | None = None) -> str | None:
        """A connected site agent of the site (or the node's site), the boot-lease holder
        first, or None."""
        req = SiteAgentRequest(site_id=site_id, node_id=node_id)
        return (await self._call("agents.site_agent_for", req, SiteAgentReply)).agent_id

    async def create_batch(
        self,
        *,
        kinds: list[str],
        nodes: list[str],
        tenant_id: str = "root",
        ttl_seconds: int = 24 * 3600,
        workflow_id: str | None = None,
        workflow_ids: list[str] | None = None,
        note: str | None = None,
        idempotency_key: str | None = None,
    ) -> BatchView:
        req = CreateBatch(
            tenant_id=tenant_id,
            kinds=kinds,
            nodes=nodes,
            ttl_seconds=ttl_seconds,
            workflow_id=workflow_id,
            workflow_ids=list(workflow_ids or []),
            note=note,
            idempotency_key=idempotency_key,
        )
        return await self._call("batches.create", req, BatchView)

    async def get_batch(self, *, id: str) -> BatchView:
        return await self._call("batches.get", BatchIdRequest(id=id), BatchView)

    async def close_batch(self, *, id: str, reason: str | None = None) -> BatchView:
        """Close a batch whose workflow failed or was aborted (again: the same batch)."""
        return await self._call("batches.close", CloseBatch(id=id, reason=reason), BatchView)

    async def reopen_batch(self, *, id: str) -> BatchView:
        """Open a closed batch again: its workflow was retried or resumed."""
        return await self._call("batches.reopen", BatchIdRequest(id=id), BatchView)

    async def list_batches(
        self, *, workflow_id: str | None = None, state: BatchState | None = None, limit: int = DEFAULT_LIMIT
    ) -> list[BatchView]:
        """The first page; ``batches_page`` gives the cursor of the rest."""
        return (await self.batches_page(workflow_id=workflow_id, state=state, limit=limit)).batches

    async def batches_page(
        self,
        *,
        workflow_id: str | None = None,
        state: BatchState | None = None,
        limit: int = DEFAULT_LIMIT,
        cursor: str | None = None,
    ) -> BatchList:
        """One page of batches, newest first; pass its ``next`` as ``cursor`` for the next."""
        req = ListBatches(workflow_id=workflow_id, state=state, limit=limit, cursor=cursor)
        return await self._call("batches.list", req, BatchList)

    async def approve_batch(self, *, batch_id: str, approver_id: str, signature: bytes) -> BatchView:
        req = ApproveBatch(batch_id=batch_id, approver_id=approver_id, signature=signature)
        return await self._call("batches.approve", req, BatchView)

    async def quorum(self) -> QuorumView:
        return await self._call("quorum.get", {}, QuorumView)

    async def wait(self, *, id: str, timeout: float = 60.0) -> CommandView:
        """Wait until the command settles (woken by its events; polled as a safety net).

        Raises:
            BcError: ``TIMEOUT`` when it is still live after ``timeout`` seconds.
        """
        import nats.errors  # loaded with the connection (``service.client.connect``)

        nc = self.api.nc
        woken = asyncio.Event()

        async def wake(_msg: Any) -> None:
            woken.set()

        sub = await nc.subscribe(self.api.subjects.event(EVENTS, id), cb=wake)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                woken.clear()
                view = await self.get(id=id)
                if view.state in TERMINAL_STATES:
                    return view
                left = deadline - loop.time()
                if left <= 0:
                    raise BcError(
                        ErrorCode.TIMEOUT,
                        f"command {id} still {view.state} after {timeout}s",
                        {"state": view.state},
                    )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, 1.0)):  # not wait_for: can drop a cancel
                        await woken.wait()
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
