"""Claims: an agent's ``ack`` of a delivered command, taken or refused.

A claim is taken only when the command is dispatched to this agent, its digest matches and,
for a destructive command, its batch is valid under the approvers configured now; another
journal's claim of a command that may have started settles it ``interrupted``, unless that
journal is older than the one that claimed it (journals are numbered by the queue at first sight:
``generation``, which a retried, re-signed claim cannot change). A ``rerun`` claim lets the
journal that started an idempotent command and died run it again.

A claim that names the id its agent journaled with it (``Ack.claim_id``) marks the command
``running`` when taken: the agent runs it on that answer and sends no ``running`` mark (a signed
event and a statement a command). Such a command is claimed again only by the same journal with
the same id (the answer was lost, or the agent died before it journaled the start); under
another id (the entry lost with the machine's power, the journal restored from an older copy) it
is refused ``running``, and the agent treats it as a command an earlier process of it started.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from better_compute.service.groups import GroupCommit, slot_by
from better_compute.service.killpoints import declare, kill_point
from better_compute.wire.agent import Ack, AckReply
from better_compute.wire.cmdq import TERMINAL_STATES

from .commands import invalid
from .config import CmdqConfig
from .delivery import Changed
from .rows import ClaimStateRow
from .storage import Claim, ClaimAnswer, Store, row_may_be_at_fault

__all__ = ["Claims"]

BEFORE_CLAIM = declare("command-queue.before-claim", "command-queue", "an agent's claim arrived, not applied")
AFTER_CLAIM = declare(
    "command-queue.after-claim", "command-queue", "a claim is committed, the agent has no answer"
)


class Claims:
    """Applies ``ack`` events by compare-and-set on the command's state."""

    def __init__(
        self,
        *,
        store: Store,
        config: CmdqConfig,
        changed: Changed,
        log: Any,
        reruns: Callable[[str, Any], bool] = lambda _kind, _payload: False,
        slots: asyncio.Semaphore | None = None,
    ) -> None:
        self.reruns = reruns
        """Whether a command of a kind, with a payload, may run again after an interruption
        (the kind's manifest says it is idempotent)."""
        self.store = store
        self.config = config
        self.changed = changed
        self.log = log
        self.slots = slots if slots is not None else asyncio.Semaphore(config.agent_event_slots)
        """The agent events' share of the store's connections: taken by each group of claims
        while at the database, and by a claim that was not taken while it finds out why."""
        self.taken: GroupCommit[Claim, ClaimAnswer] = GroupCommit(
            store.claim_many, key=lambda c: c.command_id, slots=self.slots, row_by_row=row_may_be_at_fault
        )
        """Claims arriving at the same moment, applied in one statement (``CLAIM_MANY``)."""

    async def ack(self, ev: Ack, *, deadline: float | None = None) -> AckReply:
        """A claim. Taken when the command is dispatched to this agent, its digest matches and,
        for a destructive command, its batch is unexpired and approved under the approvers
        configured now; or when this very journal claimed it already (its answer was lost).
        Another journal's claim of a command that may have started settles it ``interrupted``.
        ``LateError`` when it waited for the store past ``deadline`` (nothing done: the agent asks
        again)."""
        try:
            digest = bytes.fromhex(ev.digest)
        except ValueError as exc:
            raise invalid("digest", "expected hex") from exc
        if not isinstance(ev.journal_id, str) or len(ev.journal_id) > 64:
            raise invalid("journalId", "a journal id is at most 64 characters")
        if not isinstance(ev.claim_id, str) or len(ev.claim_id) > 64:
            raise invalid("claimId", "a claim id is at most 64 characters")
        journal = ev.journal_id or None
        claim_id = (ev.claim_id or None) if journal is not None else None  # only a journal's claims
        quorum = self.config.quorum.enabled
        if ev.rerun:
            async with slot_by(self.slots, deadline):
                return await self._rerun(ev, digest, journal)
        kill_point(BEFORE_CLAIM)
        answer = await self.taken(
            Claim(
                command_id=ev.command_id, agent_id=ev.agent, digest=digest, journal=journal,
                signed_at_ms=ev.signed_at_ms, quorum=quorum, claim_id=claim_id,
            ),
            deadline=deadline,
        )  # fmt: skip
        if answer.row is not None:
            kill_point(AFTER_CLAIM)
            await self.changed([answer.row])
            return AckReply(proceed=True, state=answer.row.state)
        seen = answer.journal
        generation = (seen.generation, seen.present) if seen is not None else (0, False)
        async with slot_by(self.slots, deadline):
            return await self._not_taken(ev, digest, journal, claim_id, generation, quorum=quorum)

    async def _not_taken(
        self,
        ev: Ack,
        digest: bytes,
        journal: str | None,
        claim_id: str | None,
        generation: tuple[int, bool],
        *,
        quorum: bool,
    ) -> AckReply:
        """Why a claim was not taken (``generation``: its journal's, and whether that journal
        said hello itself), and what follows from it."""
        cur = await self.store.claim_state(ev.command_id)
        if cur is None:
            return AckReply(proceed=False, reason="unknown-command")
        # Not for good: the command may be handed to this agent later (another agent fell
        # silent), and a genuine delivery may follow one that was not what we sent.
        if cur.agent_id != ev.agent:
            return AckReply(proceed=False, reason="not-yours", again=True)
        if cur.digest != digest:
            self.log.warning("claim_digest_mismatch", command_id=ev.command_id, agent_id=ev.agent)
            return AckReply(proceed=False, reason="digest-mismatch", again=True)
        state = cur.state
        if state in TERMINAL_STATES:
            return AckReply(proceed=False, state=state, reason=state)
        if state == "cancelling":
            # Cancelled after a claim: the agent says it never started it with a result.
            return AckReply(proceed=False, state=state, reason="cancelling")
        if not cur.live:
            return AckReply(proceed=False, state=state, reason="expired")
        same_journal = journal is not None and cur.claim_journal == journal
        same_claim = same_journal and claim_id is not None and cur.claim_id == claim_id
        if state == "running" and same_journal and not same_claim:
            # The journal started it (it reported running, or claimed it under another id), so
            # it never claims it again: this is a late copy of its claim, or the journal was
            # restored from an older copy. Either way it must not run now; what runs, if
            # anything, reports as before.
            return AckReply(proceed=False, state=state, reason="running")
        if state in ("acked", "running") and not same_journal:
            return await self._interrupt(ev, journal, generation, cur)
        if (state in ("dispatched", "acked") or same_claim) and cur.destructive:
            batch_valid = (
                cur.has_batch and not cur.batch_expired and (not quorum or cur.batch_approved)
            ) or (not cur.has_batch and not quorum)
            if not batch_valid:
                return await self._refuse_for_batch(ev, journal, claim_id, cur)
        # pending, or changed meanwhile: it comes again in a later delivery
        return AckReply(proceed=False, state=state, reason=state, again=True)

    async def _rerun(self, ev: Ack, digest: bytes, journal: str | None) -> AckReply:
        """The journal that claimed a command started it and its process died: it runs again
        only when the kind is idempotent for the payload and nothing else changed meanwhile."""
        cur = await self.store.claim_state(ev.command_id)
        if cur is None:
            return AckReply(proceed=False, reason="unknown-command")
        if cur.agent_id != ev.agent or cur.digest != digest:
            return AckReply(proceed=False, reason="not-yours")
        state = cur.state
        if state == "cancelling":
            return AckReply(proceed=False, state=state, reason="cancelling")
        if state not in ("acked", "running"):
            return AckReply(proceed=False, state=state, reason=state)
        if journal is None or cur.claim_journal != journal:
            return AckReply(proceed=False, state=state, reason="claimed-by-another-journal")
        payload = msgspec.json.decode(cur.payload)
        if cur.destructive or not self.reruns(cur.kind, payload):
            return AckReply(proceed=False, state=state, reason="not-idempotent")
        row = await self.store.claim_rerun(ev.command_id, ev.agent, journal)
        if row is None:
            return AckReply(proceed=False, state=state, reason="expired")
        self.log.info("command_rerun", command_id=ev.command_id, agent_id=ev.agent, kind=cur.kind)
        return AckReply(proceed=True, state=row.state, rerun=True)

    async def _interrupt(
        self, ev: Ack, journal: str | None, generation: tuple[int, bool], cur: ClaimStateRow
    ) -> AckReply:
        """A newer journal of the agent claims a command that may have started: settle it
        ``failed`` (``interrupted``); it never runs again."""
        row = await self.store.claim_interrupted(
            ev.command_id, ev.agent, journal, ev.signed_at_ms, *generation
        )
        if row is None:
            # From a journal older than the one that claimed it (a late claim of a process that
            # was replaced, however recently it signed it), or a late unnamed copy.
            self.log.info("claim_superseded", command_id=ev.command_id, agent_id=ev.agent)
            return AckReply(proceed=False, state=cur.state, reason="claimed-by-another-journal")
        self.log.warning("command_interrupted", command_id=ev.command_id, agent_id=ev.agent, was=cur.state)
        await self.changed([row])
        return AckReply(proceed=False, state="failed", reason="interrupted")

    async def _refuse_for_batch(
        self, ev: Ack, journal: str | None, claim_id: str | None, cur: ClaimStateRow
    ) -> AckReply:
        """A destructive command claimed outside a valid batch: it expires with its batch, or
        goes back to pending until the batch is approved again."""
        expired = cur.has_batch and cur.batch_expired
        refuse = self.store.claim_batch_expired if expired else self.store.claim_back_to_pending
        row = await refuse(ev.command_id, ev.agent, journal, claim_id)
        if row is None:  # changed meanwhile
            return AckReply(proceed=False, state=cur.state, reason=cur.state, again=True)
        self.log.warning("claim_refused_batch", command_id=ev.command_id, state=row.state, reason=row.reason)
        await self.changed([row])
        return AckReply(proceed=False, state=row.state, reason=row.reason, again=not expired)
