"""Runs: an agent's ``progress`` and ``result`` of a claimed command.

A result settles the command by compare-and-set, so a duplicate or late one changes nothing
(but a late end still lets a step attempt waiting for the run go on); a node's signed result
counts as attested once its signature checks: against the certificate that signed the result's
event when that is the node's own (it is, from the node's bcd: no round trip), else through
bc-pki (any valid certificate of the node).
"""

from __future__ import annotations

import asyncio
from typing import Any

from better_compute.clients.pki import PkiClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import result_document
from better_compute.service.groups import GroupCommit, slot_by
from better_compute.service.killpoints import declare, kill_point
from better_compute.wire.agent import Progress, Result, ResultReply
from better_compute.wire.codec import check_nesting

from .delivery import Changed
from .rows import CommandRow, CommandStateRow, ProgressRow
from .signers import Signer
from .storage import Report, Said, Store, row_may_be_at_fault

__all__ = ["Runs"]

BEFORE_RESULT = declare("command-queue.before-result", "command-queue", "a result arrived, not recorded")
AFTER_RESULT = declare(
    "command-queue.after-result", "command-queue", "a result is settled, the agent and the engine do not know"
)


class Runs:
    """Applies ``progress`` and ``result`` events."""

    def __init__(
        self,
        *,
        store: Store,
        pki: PkiClient,
        changed: Changed,
        log: Any,
        slots: asyncio.Semaphore | None = None,
    ) -> None:
        self.store = store
        self.pki = pki
        self.changed = changed
        self.log = log
        self.slots = slots if slots is not None else asyncio.Semaphore(6)
        """The agent events' share of the store's connections (``Agents``): taken by each group
        while at the database, and by a result's checks and late ends."""
        self.said: GroupCommit[Said, ProgressRow | None] = GroupCommit(
            store.progress_many, key=lambda p: p.command_id, slots=self.slots, row_by_row=row_may_be_at_fault
        )
        """Progress arriving at the same moment, applied in one statement (``PROGRESS_MANY``)."""
        self.reported: GroupCommit[Report, CommandRow | None] = GroupCommit(
            store.result_many, key=lambda r: r.command_id, slots=self.slots, row_by_row=row_may_be_at_fault
        )
        """Results arriving at the same moment, applied in one statement (``RESULT_MANY``)."""

    async def progress(self, ev: Progress) -> None:
        message = ev.message[:500] if ev.message is not None else None
        row = await self.said(Said(command_id=ev.command_id, agent_id=ev.agent, message=message))
        if row is not None and row.old_state != row.command.state:
            await self.changed([row.command])

    async def result(
        self, ev: Result, signer: Signer | None = None, *, deadline: float | None = None
    ) -> ResultReply:
        """``signer``: the checked certificate that signed the event (its key may check the
        result's own signature without asking bc-pki). ``LateError`` when it waited for the store
        past ``deadline`` (nothing recorded: the agent reports again)."""
        # the engine reads a result as JSON: one nested past what a decoder can hold is refused here
        check_nesting(ev.result, "result")
        reason = ev.reason[:500] if ev.reason is not None else None
        attested = False
        if ev.result_signature is not None:
            async with slot_by(self.slots, deadline):
                cur = await self._command_of(ev)
                if cur.state not in ("acked", "running", "cancelling"):
                    await self._late_end(ev)
                    return ResultReply(recorded=False, state=cur.state)
            # Outside the store's slot: the check may ask bc-pki (a node that joined again since),
            # and a slow bc-pki must not hold the slots every claim and result needs (the
            # compare-and-set of ``reported`` below decides anyway).
            attested = await self._attest(cur.node_id, ev, signer)
        kill_point(BEFORE_RESULT)
        row = await self.reported(
            Report(
                command_id=ev.command_id,
                agent_id=ev.agent,
                status=ev.status,
                reason=reason,
                result=ev.result,
                signature=ev.result_signature,
                attested=attested,
                journal=ev.journal_id[:64] if isinstance(ev.journal_id, str) else "",
            ),
            deadline=deadline,
        )
        if row is None:  # settled already (a duplicate or late result), or not this agent's
            async with self.slots:
                cur = await self._command_of(ev)
                await self._late_end(ev)
            return ResultReply(recorded=False, state=cur.state)
        kill_point(AFTER_RESULT)
        self.log.info(
            "command_settled",
            command_id=ev.command_id,
            state=row.state,
            reason=reason,
            attested=attested,
            result_bytes=len(ev.result),
        )
        await self.changed([row])
        return ResultReply(recorded=True, state=row.state, attested=row.attested)

    async def _command_of(self, ev: Result) -> CommandStateRow:
        """The command a result is about; ``NOT_FOUND`` or ``PERMISSION_DENIED`` if not the
        reporting agent's."""
        cur = await self.store.command_state(ev.command_id)
        if cur is None:
            raise BcError(ErrorCode.NOT_FOUND, "no such command", {"path": "commandId"})
        if cur.agent_id != ev.agent:
            raise BcError(
                ErrorCode.PERMISSION_DENIED,
                "the command is not this agent's",
                {"path": "commandId", "reason": "not-yours"},
            )
        return cur

    async def _late_end(self, ev: Result) -> None:
        """The agent ran a command to its end after it was cancelled or expired: the result no
        longer counts, but a step attempt waiting for the run to end may go on now."""
        rows = await self.store.late_end(ev.command_id, ev.agent)
        if rows:
            self.log.info("command_ended_late", command_id=ev.command_id, status=ev.status)
            await self.changed(rows)

    async def _attest(self, node_id: str, ev: Result, signer: Signer | None) -> bool:
        """Check the node's signature over the result: with the certificate that signed the event
        when it is the node's (checked valid, cached for ``cert_cache_seconds`` at most and evicted
        on revocation, as for every event), else through bc-pki."""
        assert ev.result_signature is not None
        data = result_document(command_id=ev.command_id, node_id=node_id, status=ev.status, result=ev.result)
        if signer is not None and signer.agent_id == node_id and signer.verifies(ev.result_signature, data):
            return True
        # another certificate of the node signed it (a result journaled before the node joined
        # again), or not the node at all: bc-pki knows every certificate of the node
        try:
            verified = await self.pki.verify(signer_id=node_id, data=data, signature=ev.result_signature)
        except BcError as err:
            if err.code is ErrorCode.UNAUTHENTICATED:
                self.log.warning("result_signature_refused", command_id=ev.command_id, reason=err.reason)
                return False
            # bc-pki cannot answer now: the agent reports again later.
            raise BcError(ErrorCode.UNAVAILABLE, "cannot check the result's signature now") from err
        return verified.agent_id == node_id
