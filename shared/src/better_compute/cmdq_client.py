"""The command queue over NATS: its messages (beyond ``wire.cmdq``) and a client.

``CommandQueueClient`` is what the engine, bcx and ``await_command`` use. Every route is
``bc.api.command-queue.<resource>.<verb>``:

========================  ========================  ====================================
route                     request                   result
========================  ========================  ====================================
``commands.enqueue``      ``EnqueueCommand``        ``CommandView`` (``created`` says if new)
``commands.get``          ``CommandIdRequest``      ``CommandView``
``commands.list``         ``ListCommands``          ``CommandList`` (newest first, no results)
``commands.cancel``       ``CancelCommands``        ``CancelReply``
``commands.live_with_ref````LiveWithRef``           ``LiveWithRefReply``
``agents.list``           ``ListAgents``            ``AgentList``
``agents.site_agent_for`` ``SiteAgentRequest``      ``SiteAgentReply``
``batches.create``        ``CreateBatch``           ``BatchView``
``batches.get``           ``BatchIdRequest``        ``BatchView``
``batches.list``          ``ListBatches``           ``BatchList``
``batches.approve``       ``ApproveBatch``          ``BatchView``
``quorum.get``            ``{}``                    ``QuorumView``
========================  ========================  ====================================

Approvers sign ``batch_document(...)`` with their Ed25519 key, on their own machine (``bcx
batches approve --key-file``); only the signature travels.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
import nats.errors
from cryptography.hazmat.primitives.asymmetric import ed25519

from .core.errors import BcError, ErrorCode
from .core.names import Name
from .pki_client import signing_payload
from .service.client import ApiClient
from .wire.cmdq import (
    TERMINAL_STATES,
    AgentStatus,
    CancelCommands,
    CommandState,
    CommandStates,
    CommandStatesReply,
    CommandView,
    EnqueueCommand,
    LiveWithRef,
    LiveWithRefReply,
)
from .wire.paging import DEFAULT_LIMIT, Cursor

__all__ = [
    "BATCH_PURPOSE",
    "AgentList",
    "AgentView",
    "ApprovalView",
    "ApproveBatch",
    "ApproverView",
    "BatchIdRequest",
    "BatchList",
    "BatchState",
    "BatchView",
    "CancelReply",
    "CommandIdRequest",
    "CommandList",
    "CommandQueueClient",
    "CreateBatch",
    "ListAgents",
    "ListBatches",
    "ListCommands",
    "QuorumView",
    "SiteAgentReply",
    "SiteAgentRequest",
    "batch_document",
    "sign_batch",
]

T = TypeVar("T")

BATCH_PURPOSE: Final = "cmdq.batch"
BatchState = Literal["open", "approved", "expired"]

Limit = Annotated[int, msgspec.Meta(ge=1, le=1000)]
Text = Annotated[str, msgspec.Meta(max_length=200)]
KindName = Annotated[str, msgspec.Meta(max_length=128)]
NodeIdText = Annotated[str, msgspec.Meta(max_length=64)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=False):
    pass


class _Req(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    pass


# -- commands -----------------------------------------------------------------------


class CommandIdRequest(_Req, frozen=True, kw_only=True):
    id: str


class ListCommands(_Req, frozen=True, kw_only=True):
    """Filters combine with AND; ``before`` is the ``next`` of the previous page."""

    node_id: str | None = None
    workflow_id: str | None = None
    state: CommandState | None = None
    kind: KindName | None = None
    site_id: str | None = None
    agent_id: str | None = None
    batch_id: str | None = None
    before: str | None = None
    limit: Limit = 100


class CommandList(_Msg, frozen=True, kw_only=True):
    commands: list[CommandView]
    next: str | None = None


class CancelReply(_Msg, frozen=True, kw_only=True):
    cancelled: list[str]
    running: list[str] = []
    """Commands under the prefix an agent claimed and may still be running: cancelling does
    not recall them. One leaves this list with its agent's result (even a late one, which
    no longer counts), or when its agent is lost."""


# -- agents -------------------------------------------------------------------------


class ListAgents(_Req, frozen=True, kw_only=True):
    site_id: str | None = None
    role: str | None = None
    connected: bool | None = None
    """True: connected only; False: silent only; unset: every agent."""
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None
    """The ``next`` of the page before (by site, then id)."""


class AgentView(_Msg, frozen=True, kw_only=True):
    id: str
    site_id: str
    tenant_id: str
    role: str
    cert_id: str
    version: str | None = None
    kinds: list[str] | None = None
    connected: bool
    boot_lease: bool = False
    live_commands: int = 0
    connected_at: float
    last_seen: float
    status: AgentStatus | None = None
    """What the agent last said of itself (drivers, cache use, last error)."""


class AgentList(_Msg, frozen=True, kw_only=True):
    agents: list[AgentView]
    next: str | None = None
    """The cursor of the next page; None after the last."""


class SiteAgentRequest(_Req, frozen=True, kw_only=True):
    """The site is ``site_id``; without it, the site the node is known in here (its own
    agent's certificate, else its latest command). Give ``site_id`` when you know it."""

    site_id: str | None = None
    node_id: str | None = None


class SiteAgentReply(_Msg, frozen=True, kw_only=True):
    agent_id: str | None = None


# -- batches and the quorum -------------------------------------------------------


class CreateBatch(_Req, frozen=True, kw_only=True):
    """A destructive batch's scope: the command kinds and nodes it covers, until it expires."""

    tenant_id: Name = "root"
    kinds: Annotated[list[KindName], msgspec.Meta(min_length=1, max_length=64)]
    nodes: Annotated[list[NodeIdText], msgspec.Meta(min_length=1, max_length=10_000)]
    ttl_seconds: Annotated[int, msgspec.Meta(ge=60, le=30 * 24 * 3600)] = 24 * 3600
    workflow_id: str | None = None
    workflow_ids: Annotated[list[str], msgspec.Meta(max_length=10_000)] = []
    """A bulk verb's batch (``metal.bulk``): the workflows it admits, instead of ``workflow_id``."""
    note: Text | None = None
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    """The same key returns the first batch (``CONFLICT`` with another scope)."""


class BatchIdRequest(_Req, frozen=True, kw_only=True):
    id: str


class ListBatches(_Req, frozen=True, kw_only=True):
    workflow_id: str | None = None
    state: BatchState | None = None
    limit: Limit = DEFAULT_LIMIT
    cursor: Cursor | None = None
    """The ``next`` of the page before (newest first)."""


class ApprovalView(_Msg, frozen=True, kw_only=True):
    approver_id: str
    at: float
    counted: bool
    """False when the approver is no longer configured (the signature is kept, not counted)."""


class BatchView(_Msg, frozen=True, kw_only=True):
    id: str
    tenant_id: str
    kinds: list[str]
    nodes: list[str]
    workflow_id: str | None = None
    workflow_ids: list[str] = []
    """A bulk verb's batch: the workflows it admits (signed, like ``workflow_id``)."""
    note: str | None = None
    state: BatchState
    threshold: int
    """Approvals needed (M), as configured now."""
    approvals: list[ApprovalView] = []
    created_at: float
    expires_at_ms: int
    document: bytes
    """What approvers sign; ``batch_document`` rebuilds it from the fields above."""
    created: bool = False


class BatchList(_Msg, frozen=True, kw_only=True):
    batches: list[BatchView]
    next: str | None = None
    """The cursor of the next page; None after the last. A page of big batches (many
    nodes) holds fewer than ``limit``."""


class ApproveBatch(_Req, frozen=True, kw_only=True):
    batch_id: str
    approver_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    signature: Annotated[bytes, msgspec.Meta(max_length=512)]
    """Ed25519 over ``batch_document(...)`` of the batch."""


class ApproverView(_Msg, frozen=True, kw_only=True):
    id: str
    public_key: str


class QuorumView(_Msg, frozen=True, kw_only=True):
    enabled: bool
    threshold: int = 0
    approvers: list[ApproverView] = []


def batch_document(
    *,
    batch_id: str,
    tenant_id: str,
    kinds: list[str],
    nodes: list[str],
    expires_at_ms: int,
    workflow_id: str | None,
    workflow_ids: list[str] | None = None,
) -> bytes:
    """The canonical bytes approvers sign for a batch (scope and expiry included).

    A bulk verb's batch names its set of workflows (``workflowIds``); other batches' documents
    have no such key, so they stay what they were.
    """
    scope: dict[str, Any] = {
        "batchId": batch_id,
        "tenantId": tenant_id,
        "kinds": sorted(set(kinds)),
        "nodes": sorted(set(nodes)),
        "expiresAtMs": expires_at_ms,
        "workflowId": workflow_id,
    }
    if workflow_ids:
        scope["workflowIds"] = sorted(set(workflow_ids))
    return signing_payload(BATCH_PURPOSE, scope)


def sign_batch(batch: BatchView, private_key: ed25519.Ed25519PrivateKey) -> bytes:
    """Sign ``batch`` as an approver, after checking that its document is what its fields say.

    Raises:
        BcError: ``INVALID_STATE`` (reason ``document-mismatch``) when the document the
            service sent is not the canonical document of the batch's scope: signing it
            could approve something other than what is shown.
    """
    expected = batch_document(
        batch_id=batch.id,
        tenant_id=batch.tenant_id,
        kinds=batch.kinds,
        nodes=batch.nodes,
        expires_at_ms=batch.expires_at_ms,
        workflow_id=batch.workflow_id,
        workflow_ids=batch.workflow_ids,
    )
    if expected != batch.document:
        raise BcError(
            ErrorCode.INVALID_STATE,
            "the batch's document does not match its scope; not signing",
            {"reason": "document-mismatch"},
        )
    return private_key.sign(expected)


# -- the client -----------------------------------------------------------------------


class CommandQueueClient:
    """Calls to bc-command-queue over NATS; raises the service's ``BcError``s."""

    service: Final = "command-queue"

    def __init__(self, api: ApiClient, *, timeout: float = 10.0) -> None:
        self.api = api
        self.timeout = timeout

    async def _call(self, route: str, payload: Any, typ: type[T]) -> T:
        return await self.api.call_as(self.service, route, payload, typ, timeout=self.timeout)

    async def enqueue(self, command: EnqueueCommand) -> CommandView:
        """Find the command by (node, key), or create it."""
        return await self._call("commands.enqueue", command, CommandView)

    async def get(self, command_id: str) -> CommandView:
        return await self._call("commands.get", CommandIdRequest(id=command_id), CommandView)

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

    async def states(self, ids: list[str]) -> dict[str, str]:
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

    async def get_batch(self, batch_id: str) -> BatchView:
        return await self._call("batches.get", BatchIdRequest(id=batch_id), BatchView)

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

    async def approve_batch(self, batch_id: str, *, approver_id: str, signature: bytes) -> BatchView:
        req = ApproveBatch(batch_id=batch_id, approver_id=approver_id, signature=signature)
        return await self._call("batches.approve", req, BatchView)

    async def quorum(self) -> QuorumView:
        return await self._call("quorum.get", {}, QuorumView)

    async def wait(self, command_id: str, *, timeout: float = 60.0) -> CommandView:
        """Wait until the command settles (woken by its events; polled as a safety net).

        Raises:
            BcError: ``TIMEOUT`` when it is still live after ``timeout`` seconds.
        """
        nc = self.api.nc
        woken = asyncio.Event()

        async def wake(_msg: Any) -> None:
            woken.set()

        sub = await nc.subscribe(self.api.subjects.event("command", command_id), cb=wake)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while True:
                woken.clear()
                view = await self.get(command_id)
                if view.state in TERMINAL_STATES:
                    return view
                left = deadline - loop.time()
                if left <= 0:
                    raise BcError(
                        ErrorCode.TIMEOUT,
                        f"command {command_id} still {view.state} after {timeout}s",
                        {"state": view.state},
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), timeout=min(left, 1.0))
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
