"""The host of the step runners: the little of the engine a runner and the step context use.

From the reconciler (``core.engine.Engine``): ``mark_sent``, ``mark_minted``, ``enqueue``
(``sent_command`` reads a command an earlier run enqueued by its id),
``waiting`` and ``profile``; here: the workflow's ``node`` (read with the pass, ``PASS_WORKFLOWS``),
whether a command goes in the workflow's batch (``quorum``), and the engine's hooks a command
passes through (``payload_fillers`` before it is sent, ``command_settled`` once it succeeded).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from better_compute.app import App
from better_compute.core.errors import BcError, ErrorCode
from better_compute.provision import Profile
from better_compute.wire.cmdq import CommandView, EnqueueCommand

from .. import store
from ..core.engine import Engine
from ..store import StepRow, WorkflowRow
from .hooks import EngineHooks
from .memo import AttemptMemos
from .node import NodeInfo, node_info
from .quorum import QuorumBatches, in_batch

__all__ = ["StepHost"]


INVENTORIES_KEPT = 4096
"""Node inventories an engine keeps (each a few KiB): the nodes whose workflows run now."""
_UNKNOWN: Any = object()


def _inventory(text: str) -> dict[str, Any] | None:
    value = json.loads(text)
    return value if isinstance(value, dict) else None


class StepHost:
    def __init__(self, engine: Engine, hooks: EngineHooks) -> None:
        self._engine = engine
        self.hooks = hooks
        self.app: App = engine.app
        self.db = engine.db
        self.log = engine.log
        self.pki = engine.pki
        self.secrets = engine.secrets
        self.cmdq = engine.cmdq
        self.quorum = QuorumBatches(
            app=engine.app, db=engine.db, cmdq=engine.cmdq, publish=engine.publish, log=engine.log,
            writes_disk=self.writes_disk,
        )  # fmt: skip
        self._nodes: dict[str, NodeInfo | None] = {}  # each running pass's workflow's node
        self._versions: dict[str, int | None] = {}
        """Each running pass's workflow's node's inventory version as the pass read it (None: no
        inventory), for its first control-plane step run; a step that ran may have changed it."""
        self._inventories: OrderedDict[str, tuple[int, str]] = OrderedDict()
        """The inventories read, by node: (version, JSON text), the least recently used dropped
        past ``INVENTORIES_KEPT``. Text: each run parses its own (a step may change its copy)."""
        self.memos = AttemptMemos()  # what earlier runs of each running attempt got back

    @property
    def start_in(self) -> Any:
        return self._engine.start_in

    @property
    def wake(self) -> Any:
        return self._engine.wake

    # -- the reconciler's record of what an attempt did ------------------------------

    async def mark_sent(self, workflow_id: str, idx: int, attempt: int) -> None:
        await self._engine.mark_sent(workflow_id, idx, attempt)

    async def mark_minted(self, workflow_id: str, idx: int, attempt: int, service: str) -> bytes:
        return await self._engine.mark_minted(workflow_id, idx, attempt, service)

    async def enqueue(self, cmd: EnqueueCommand) -> CommandView:
        return await self._engine.cmdq_enqueue(cmd)

    async def sent_command(self, command_id: str, cmd: EnqueueCommand) -> CommandView | None:
        """The command ``cmd`` of this attempt read by its id, which an earlier run's enqueue
        returned: what enqueueing it again would find (a (node, key) names one command for good,
        and an enqueue that finds one changes nothing), for one read by primary key instead of an
        insert that conflicts and a read by key. None when the id names another command (then
        enqueue); the command queue's errors as they are."""
        try:
            view = await self.cmdq.get(id=command_id)
        except BcError as err:
            if err.code == ErrorCode.NOT_FOUND:
                return None
            raise
        if (view.node_id, view.key, view.kind) != (cmd.node_id, cmd.key, cmd.kind):
            return None
        return view

    async def waiting(self, wf: WorkflowRow, step: StepRow, what: dict[str, Any] | None) -> None:
        await self._engine.waiting(wf, step, what)

    async def waiting_command(
        self, wf: WorkflowRow, step: StepRow, command_id: str | None, what: dict[str, Any] | None
    ) -> None:
        """A control-plane step waits on a command of its attempt (``command_id``, which the
        command watch then covers), or on none any more (None); ``what`` is its ``waitingFor``."""
        await self.db.execute(
            store.SET_WAITING_COMMAND, wf.id, step.idx, step.attempt, command_id,
            json.dumps(what) if what is not None else None,
        )  # fmt: skip
        step.command_id, step.waiting_for = command_id, what
        if what is not None:
            await self._engine.events.changed(wf, step.state, step)

    async def profile(self, wf: WorkflowRow) -> Profile | None:
        return await self._engine.profile(wf)

    # -- the node ------------------------------------------------------------------

    def pass_begins(self, wf: WorkflowRow, record: Any) -> None:
        if wf.state != "running":  # aborted: its attempts never run again (a resume starts anew)
            self.memos.drop(wf.id)
        info = record["node_info"]
        if isinstance(info, str):
            info = json.loads(info)
        self._nodes[wf.id] = node_info(info) if info is not None else None
        if info is not None:
            version = info.get("inventory_version")
            self._versions[wf.id] = int(version) if version is not None else None

    def pass_ends(self, wf: WorkflowRow) -> None:
        self._nodes.pop(wf.id, None)
        self._versions.pop(wf.id, None)

    async def node(self, wf: WorkflowRow) -> NodeInfo | None:
        """The workflow's node, read once per pass (with the pass's workflows, ``PASS_WORKFLOWS``)."""
        if wf.id not in self._nodes:
            self._nodes[wf.id] = await self._read_node(wf.node_id)
        return self._nodes[wf.id]

    async def node_info(self, node_id: str) -> NodeInfo | None:
        """A node as steps see it (a command a step sends may be for another node)."""
        return await self._read_node(node_id)

    async def node_inventory(self, wf: WorkflowRow, node_id: str) -> dict[str, Any] | None:
        """The node's stored inventory (``ctx.node.inventory``), or None, for a control-plane
        step run of ``wf``'s pass. The first run of a pass goes by the version its pass read: no
        read without an inventory, none for the version kept (engine migration 0012: a new
        version for every change, by any statement); a later run of the same pass reads it."""
        version = self._versions.pop(wf.id, _UNKNOWN)
        if version is None:
            return None
        kept = self._inventories.get(node_id)
        if kept is not None and kept[0] == version:
            self._inventories.move_to_end(node_id)
            return _inventory(kept[1])
        row = await self.db.fetchrow(store.NODE_INVENTORY, node_id)
        if row is None or row["inventory"] is None:
            self._inventories.pop(node_id, None)
            return None
        self._inventories[node_id] = (int(row["inventory_version"]), row["inventory"])
        self._inventories.move_to_end(node_id)
        while len(self._inventories) > INVENTORIES_KEPT:
            self._inventories.popitem(last=False)
        return _inventory(row["inventory"])

    async def _read_node(self, node_id: str | None) -> NodeInfo | None:
        if node_id is None:
            return None
        row = await self.db.fetchrow(store.NODE, node_id)
        return node_info(row) if row is not None else None

    async def site_agent_for(self, node_id: str) -> str | None:
        site = await self.db.fetchval(store.NODE_SITE, node_id)
        return (
            await self.cmdq.site_agent(site_id=site) if site else await self.cmdq.site_agent(node_id=node_id)
        )

    # -- the quorum ----------------------------------------------------------------

    async def writes_disk(self, wf: WorkflowRow) -> bool | None:
        """Whether the workflow's profile says what it boots writes a disk (``writesDisk``)."""
        profile = await self.profile(wf)
        return profile.writes_disk if profile is not None else None

    async def in_batch(self, wf: WorkflowRow, kind: str) -> bool:
        """Whether a command of ``kind`` of this workflow goes inside its batch (``quorum.in_batch``).
        A boot command only when the workflow has a batch (the quorum is on): otherwise it is
        an ordinary command, handed to another site agent when its own falls silent."""
        if wf.batch_id is None:
            known = self.app.command_kinds.get(kind)
            return known is not None and known.destructive
        return in_batch(self.app, kind, writes_disk=await self.writes_disk(wf))

    # -- the hooks a command passes through ---------------------------------------------

    def needs_node(self, kind: str, payload: Any) -> bool:
        """Whether a payload filler takes something from the command's node."""
        return any(f.needs(kind, payload) for f in self.hooks.payload_fillers)

    def fill_payload(self, kind: str, payload: Any, node_id: str, node: NodeInfo | None) -> Any:
        """The payload with what the fillers take from the node (``BcError`` when it lacks it)."""
        for filler in self.hooks.payload_fillers:
            if filler.needs(kind, payload):
                payload = filler.fill(kind, payload, node_id, node)
        return payload

    async def command_settled(self, node_id: str, kind: str, payload: Any, result: Any) -> None:
        """A command a step sent succeeded: the hooks keep what it says of its node."""
        for hook in self.hooks.command_settled:
            await hook(node_id, kind, payload, result)
