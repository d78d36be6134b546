"""The ``StepContext`` a control-plane step's ``run(input, ctx)`` receives."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec

from better_compute.clients._base import unavailable
from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision import step_command_key
from better_compute.provision.results import latest_result
from better_compute.wire.cmdq import CommandView, EnqueueCommand

from .. import store
from .node import NodeInfo

if TYPE_CHECKING:
    from .host import StepHost
    from .memo import AttemptMemo

__all__ = ["EngineSql", "NodeInfo", "RunContext", "StepCommands", "latest_result"]

T = TypeVar("T")


class EngineSql:
    """``ctx.sql``: the engine's database for a step's own tables (``plg_<plugin>_…``)."""

    def __init__(self, pool: Any, conn: Any = None) -> None:
        self._pool = pool
        self._conn = conn

    async def query(self, sql: str, *args: Any) -> Sequence[Mapping[str, Any]]:
        if self._conn is not None:
            rows = await self._conn.fetch(sql, *args)
        else:
            rows = await self._pool.fetch(sql, *args)
        return [dict(r) for r in rows]

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[EngineSql]:
        if self._conn is not None:
            async with self._conn.transaction():  # a savepoint inside the outer one
                yield self
            return
        async with self._pool.acquire() as conn, conn.transaction():
            yield EngineSql(self._pool, conn)

    def transaction(self) -> Any:
        return self._tx()

    @property
    def connection(self) -> Any:
        """The asyncpg connection of a transaction (None outside one)."""
        return self._conn


class StepCommands:
    """``ctx.commands``: enqueue through the command-queue on behalf of this step run.

    Fills in the workflow coordinates and its batch for the kinds it covers (``quorum.in_batch``), checks the
    step's declared ``sends``, and records that the attempt sent something, so a retry
    or an abort knows to cancel what is still live.
    """

    def __init__(
        self,
        host: StepHost,
        *,
        workflow: store.WorkflowRow,
        step: store.StepRow,
        memo: AttemptMemo | None = None,
    ) -> None:
        self._host = host
        self._wf = workflow
        self._step = step
        self._memo = memo  # the attempt's commands an earlier run saw end (``memo``)

    async def enqueue(self, cmd: EnqueueCommand) -> CommandView:
        base = step_command_key(self._step)
        if cmd.key != base and not cmd.key.startswith(base + ":"):
            # what an attempt sends is found (cancelled, waited for, fenced) by its key prefix
            raise BcError(
                ErrorCode.INVALID_INPUT,
                f"a command of this step attempt is keyed {base} or {base}:<name> (step_command_key)",
                {"path": "key"},
            )
        if self._memo is not None and (ended := self._memo.command(cmd.node_id, cmd.key, cmd.kind)):
            return ended  # it ended in an earlier run of this attempt, and never changes again
        view = None
        if self._memo is not None and (sent := self._memo.sent.get((cmd.node_id, cmd.key))):
            # an earlier run of this attempt enqueued it: read it by its id (``sent_command``)
            view = await self._queue(self._host.sent_command(sent, cmd))
        payload = cmd.payload
        if view is None:
            view, payload = await self._send(cmd)
        if view.state == "succeeded":  # what it says of the node: the power a BMC showed
            try:
                result = json.loads(view.result) if view.result else None
            except (ValueError, RecursionError):
                result = None
            await self._host.command_settled(cmd.node_id, view.kind, payload, result)
        if self._memo is not None:
            self._memo.keep_command(cmd.node_id, view)
        return view

    async def _queue(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except BcError as err:
            if (marked := unavailable(err, "bc-command-queue")) is not None:
                raise marked from err  # the engine waits for the command queue
            raise

    async def _send(self, cmd: EnqueueCommand) -> tuple[CommandView, Any]:
        """Enqueue ``cmd`` (find-before-create by key); the view and the payload as sent."""
        sends = list(self._step.sends or [])
        if self._host.needs_node(cmd.kind, cmd.payload):
            # the workflow's own node as the pass read it (ctx.node); another node read now
            if cmd.node_id == self._wf.node_id:
                node = await self._host.node(self._wf)
            else:
                node = await self._host.node_info(cmd.node_id)
            payload = self._host.fill_payload(cmd.kind, cmd.payload, cmd.node_id, node)
            cmd = msgspec.structs.replace(cmd, payload=payload)
        batched = await self._host.in_batch(self._wf, cmd.kind)
        full = msgspec.structs.replace(
            cmd,
            workflow_id=self._wf.id,
            step=self._step.idx,
            batch_id=self._wf.batch_id if batched else None,
            in_batch=batched,
            sends=sends or None,
            tenant_id=self._wf.tenant_id,
        )
        if not self._step.sent_commands:
            # once per attempt, as an agent step does: a later run of a superseded attempt is
            # refused by the command queue, where the supersede fenced the attempt's key
            await self._host.mark_sent(self._wf.id, self._step.idx, self._step.attempt)
            self._step.sent_commands = True
        return await self._queue(self._host.enqueue(full)), full.payload

    async def site_agent_for(self, node_id: str) -> str | None:
        agent: str | None = await self._queue(self._host.site_agent_for(node_id))
        return agent


class StepWorkflows:
    """``ctx.workflows``: start child workflows inside the step's own transaction.

    ``start(tx, ...)`` must be given a transaction from ``ctx.sql.transaction()``, so the
    child exists exactly when the step's own writes commit. Children are woken once the
    step's run returns; the work queue's poll would find them anyway.
    """

    def __init__(self, start_in: Any, *, tenant_id: str) -> None:
        self._start_in = start_in
        self._tenant_id = tenant_id
        self.started: list[str] = []  # reconciler keys to wake

    async def start(
        self,
        tx: Any,
        *,
        profile_id: str,
        profile_version: int | None = None,
        node_id: str | None = None,
        owner: str | None = None,
    ) -> str:
        conn = getattr(tx, "connection", None)
        if conn is None:
            raise BcError(
                ErrorCode.INVALID_STATE,
                "ctx.workflows.start needs a transaction: async with ctx.sql.transaction() as tx",
                {"path": "tx"},
            )
        wf = await self._start_in(
            conn,
            tenant_id=self._tenant_id,
            profile_id=profile_id,
            profile_version=profile_version,
            node_id=node_id,
            owner=owner,
            admission=False,  # this step holds its site's room and may wait for its children
        )
        self.started.append(wf["rkey"])
        return str(wf["id"])


@dataclass
class RunContext:
    """One run of one control-plane step."""

    workflow_id: str
    step: int
    attempt: int
    idempotency_key: str
    batch_id: str | None
    node: NodeInfo | None
    sql: EngineSql
    pki: Any
    secrets: Any
    workflows: StepWorkflows
    commands: StepCommands
    log: Any
    tenant_id: str = "root"
    profile: Any = None  # the pinned Profile the workflow runs
    provision: Any = None  # the app's ProvisionModule (user-data settings, config units)
    memo: AttemptMemo | None = None  # what earlier runs of this attempt got back (``once``)

    async def once(self, name: str, load: Callable[[], Awaitable[T]]) -> T:
        """What ``load()`` gave the first run of this attempt that asked for ``name``; the later
        runs (a step waiting on its commands runs again at each one's end) get the same without
        calling it. Kept in this engine's memory only, dropped when the attempt settles: a run on
        another engine, or after a restart, calls ``load`` again, so it must be a read whose
        answer the attempt may take once (what an operator changes meanwhile is for the next
        attempt)."""
        if self.memo is None:
            return await load()
        if name in self.memo.found:
            return cast(T, self.memo.found[name])
        value = await load()
        self.memo.found[name] = value
        return value

    async def from_step(self, action: str) -> Any:
        """The latest succeeded result of ``action`` in this workflow."""
        return await latest_result(self.sql, self.workflow_id, action)
