"""``MemoryStore``: the command queue's ``Store`` in memory, for unit tests.

The same operations as ``storage.PgStore``, each written after its statement in ``store`` (the
statement's name is in each method's docstring), on dicts, under a clock a test moves
(``advance``). No PostgreSQL, no NATS: a state machine of the queue (claims, runs, batches and
the quorum, the sweeper's expiry and dispatch) runs against it in milliseconds. The SQL stays the
truth; ``tests/integration/test_cmdq_store_contract.py`` runs one script against both stores.

Agents are said hello to (``agent_hello``) or, when a test does not care how, seeded by hand
(``agent_seen``, ``lease``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, cast

from better_compute.wire.cmdq import TERMINAL_STATES, CommandState

from ..rows import (
    ClaimedRow,
    ClaimStateRow,
    CommandRow,
    CommandStateRow,
    JournalRow,
    ProgressRow,
)
from ..storage import Claim, ClaimAnswer, NewCommand, Published, Report, Said, Store
from ._presence import Presence
from ._tables import _CLAIMED, _LIVE, _Command, _Journal

__all__ = ["MemoryStore"]


class MemoryStore(Presence):
    """``Store`` in memory. Its clock is the wall clock moved by ``advance`` (the service's parts
    stamp deadlines from the wall clock, as they do against PostgreSQL)."""

    # -- commands --------------------------------------------------------------------
    async def insert_many(
        self, news: Sequence[NewCommand], *, silent_after_ms: int
    ) -> list[CommandRow | None]:
        """``COMMAND_INSERT_MANY``: each as ``COMMAND_INSERT``"""
        return [await self.insert_command(n, silent_after_ms=silent_after_ms) for n in news]

    async def insert_command(self, new: NewCommand, *, silent_after_ms: int) -> CommandRow | None:
        """``COMMAND_INSERT``"""
        if any(c.node_id == new.node_id and c.key == new.key for c in self._t.commands.values()):
            return None
        now = self.now()
        pick = new.node_id if new.target == "node" else self._pick(new.site_id, new.kind, silent_after_ms)
        dispatched = new.may_dispatch and pick is not None
        target = cast(Literal["site", "node"], new.target)
        c = _Command(
            id=new.id, node_id=new.node_id, site_id=new.site_id, tenant_id=new.tenant_id, key=new.key,
            kind=new.kind, destructive=new.destructive, target=target, payload=new.payload,
            digest=new.digest, batch_id=new.batch_id, workflow_id=new.workflow_id, step=new.step,
            not_after=new.not_after_ms / 1000, created_at=now, updated_at=now,
            agent_id=pick if new.may_dispatch or new.target == "node" else None,
            state="dispatched" if dispatched else "pending", dispatched_at=now if dispatched else None,
        )  # fmt: skip
        self._t.commands[c.id] = c
        return c.row()

    async def command_by_id(self, command_id: str) -> CommandRow | None:
        """``COMMAND_BY_ID``"""
        c = self._cmd(command_id)
        return None if c is None else c.row()

    async def command_state(self, command_id: str) -> CommandStateRow | None:
        """``COMMAND_STATE``"""
        c = self._cmd(command_id)
        if c is None:
            return None
        return CommandStateRow(
            id=c.id, node_id=c.node_id, kind=c.kind, state=c.state, agent_id=c.agent_id,
            digest=c.digest, live=c.not_after > self.now(),
        )  # fmt: skip

    async def mark_published(self, command_id: str, agent_id: str, stream_seq: int) -> None:
        """``PUBLISHED``"""
        c = self._cmd(command_id, agent_id)
        if c is not None and c.state in ("dispatched", "acked"):
            c.published_at, c.publishes, c.stream_seq = self.now(), c.publishes + 1, stream_seq

    async def mark_published_many(self, marks: Sequence[Published]) -> None:
        """``PUBLISHED_MANY``: ``PUBLISHED`` of each"""
        for m in marks:
            await self.mark_published(m.command_id, m.agent_id, m.stream_seq)

    async def cancel(self, command_id: str, reason: str) -> list[CommandRow]:
        """``CANCEL_BY_ID``"""
        c = self._cmd(command_id)
        if c is None or c.state not in _LIVE:
            return []
        return [self._cancel(c, reason)]

    async def command_by_key(self, node_id: str, key: str) -> CommandRow | None:
        """``COMMAND_BY_NODE_KEY``"""
        found = [c for c in self._t.commands.values() if c.node_id == node_id and c.key == key]
        return found[0].row() if found else None

    async def command_states(self, ids: Sequence[str]) -> dict[str, str]:
        """``COMMAND_STATES``"""
        return {i: self._t.commands[i].state for i in ids if i in self._t.commands}

    async def list_commands(
        self,
        *,
        node_id: str | None,
        workflow_id: str | None,
        state: str | None,
        kind: str | None,
        site_id: str | None,
        agent_id: str | None,
        batch_id: str | None,
        before: str | None,
        limit: int,
    ) -> list[CommandRow]:
        """``LIST_COMMANDS``"""
        wanted = {
            "node_id": node_id, "workflow_id": workflow_id, "state": state, "kind": kind,
            "site_id": site_id, "agent_id": agent_id, "batch_id": batch_id,
        }  # fmt: skip
        found = [
            c
            for c in self._t.commands.values()
            if all(v is None or getattr(c, k) == v for k, v in wanted.items())
            and (before is None or c.id < before)
        ]
        return [c.row() for c in sorted(found, key=lambda c: c.id, reverse=True)[:limit]]

    def _under(self, prefix: str, *, node_id: str | None, workflow_id: str | None) -> list[_Command]:
        """``_KEY_UNDER`` with the node and workflow filters, by id."""
        return sorted(
            (
                c
                for c in self._t.commands.values()
                if (node_id is None or c.node_id == node_id)
                and (workflow_id is None or c.workflow_id == workflow_id)
                and (c.key == prefix or c.key.startswith((prefix + ":", prefix + "#")))
            ),
            key=lambda c: c.id,
        )

    def _cancel(self, c: _Command, reason: str) -> CommandRow:
        """``_CANCEL_SET``"""
        claimed = c.state in _CLAIMED
        return self._touch(
            c, reason=reason, state="cancelling" if claimed else "cancelled",
            finished_at=None if claimed else self.now(),
        )  # fmt: skip

    async def cancel_under(
        self, prefix: str, *, node_id: str | None, workflow_id: str | None, reason: str
    ) -> list[CommandRow]:
        """``CANCEL_BY_PREFIX``"""
        under = self._under(prefix, node_id=node_id, workflow_id=workflow_id)
        return [self._cancel(c, reason) for c in under if c.state in _LIVE]

    async def claimed_under(
        self, prefix: str, *, node_id: str | None, workflow_id: str | None, lost_after_ms: int
    ) -> list[ClaimedRow]:
        """``CLAIMED_UNDER_PREFIX``"""
        found = []
        for c in self._under(prefix, node_id=node_id, workflow_id=workflow_id):
            agent = self._t.agents.get(c.agent_id) if c.agent_id is not None else None
            if agent is None or c.acked_at is None or c.ended_at is not None:
                continue
            may_run = c.state in ("acked", "running", "cancelling", "cancelled", "expired") or (
                c.state == "failed" and c.reason == "interrupted"
            )
            j = self._t.journals.get((agent_id := c.agent_id or "", c.claim_journal or ""))
            seen = j.last_seen if j is not None and j.present else agent.last_seen
            if may_run and seen > self.now() - agent.quiet(lost_after_ms):
                found.append(ClaimedRow(id=c.id, agent_id=agent_id, claim_journal=c.claim_journal))
        return found

    async def fence(self, prefix: str, workflow_id: str, reason: str) -> None:
        """``KEY_FENCE_INSERT``"""
        self._t.fences.setdefault(prefix, (workflow_id, reason))

    async def fenced(self, key: str) -> bool:
        """``KEY_FENCED``: the key, or one of its prefixes ending before a ':' or '#'."""
        cuts = [key[:i] for i, ch in enumerate(key) if ch in ":#"]
        return any(p in self._t.fences for p in [*cuts, key])

    async def cancel_superseded(self, command_id: str) -> list[CommandRow]:
        """``CANCEL_SUPERSEDED``"""
        c = self._cmd(command_id)
        if c is None or c.state not in _LIVE:
            return []
        return [self._cancel(c, "attempt-superseded")]

    async def live_under(self, agent_id: str, prefix: str, node_id: str | None) -> list[tuple[str, str]]:
        """``LIVE_WITH_PREFIX``"""
        return [
            (c.id, c.payload)
            for c in self._under(prefix, node_id=node_id, workflow_id=None)
            if c.agent_id == agent_id
            and c.state in ("dispatched", "acked", "running")
            and c.not_after > self.now()
        ]

    # -- claims ----------------------------------------------------------------------
    async def journal_seen(self, agent_id: str, journal_id: str, *, present: bool) -> JournalRow:
        """``JOURNAL_SEEN``"""
        j = self._t.journals.get((agent_id, journal_id))
        if j is None:
            j = _Journal(generation=next(self._generations), last_seen=self.now(), present=present)
            self._t.journals[(agent_id, journal_id)] = j
        else:
            j.last_seen, j.present = self.now(), j.present or present
        return JournalRow(generation=j.generation, present=j.present)

    def _batch_admits(self, c: _Command, *, quorum: bool) -> bool:
        if not c.destructive:
            return True
        b = self._batch_of(c)
        if c.batch_id is None:
            return not quorum
        return b is not None and b.expires_at > self.now() and (not quorum or b.approved_at is not None)

    def _claimable(self, c: _Command, journal: str | None, claim_id: str | None) -> bool:
        """``_CLAIM_AGAIN``"""
        same_journal = journal is not None and c.claim_journal == journal
        return (
            c.state == "dispatched"
            or (c.state == "acked" and same_journal)
            or (c.state == "running" and same_journal and claim_id is not None and c.claim_id == claim_id)
        )

    async def ack(
        self,
        command_id: str,
        agent_id: str,
        digest: bytes,
        journal: str | None,
        signed_at_ms: int,
        *,
        quorum: bool,
        claim_id: str | None = None,
    ) -> CommandRow | None:
        """``ACK``"""
        c = self._cmd(command_id, agent_id)
        if (
            c is None
            or c.not_after <= self.now()
            or c.digest != digest
            or not self._claimable(c, journal, claim_id)
            or not self._batch_admits(c, quorum=quorum)
        ):
            return None
        signed = signed_at_ms if c.state == "dispatched" else c.claim_signed_ms
        acked_at = c.acked_at if c.acked_at is not None else self.now()
        return self._touch(
            c, state="acked" if claim_id is None else "running", acked_at=acked_at, claim_journal=journal,
            claim_signed_ms=signed, claim_id=claim_id,
        )  # fmt: skip

    async def claim_many(self, claims: Sequence[Claim]) -> list[ClaimAnswer]:
        """``CLAIM_MANY``: every named journal seen (not present), then each claim as ``ACK``"""
        journals = {
            (c.agent_id, c.journal): await self.journal_seen(c.agent_id, c.journal, present=False)
            for c in claims
            if c.journal is not None
        }
        return [
            ClaimAnswer(
                row=await self.ack(
                    c.command_id,
                    c.agent_id,
                    c.digest,
                    c.journal,
                    c.signed_at_ms,
                    quorum=c.quorum,
                    claim_id=c.claim_id,
                ),
                journal=journals.get((c.agent_id, c.journal)) if c.journal is not None else None,
            )
            for c in claims
        ]

    async def claim_state(self, command_id: str) -> ClaimStateRow | None:
        """``CLAIM_STATE``"""
        c = self._cmd(command_id)
        if c is None:
            return None
        b = self._batch_of(c)
        return ClaimStateRow(
            id=c.id, state=c.state, kind=c.kind, payload=c.payload, agent_id=c.agent_id, digest=c.digest,
            live=c.not_after > self.now(), destructive=c.destructive, claim_journal=c.claim_journal,
            claim_signed_ms=c.claim_signed_ms, claim_id=c.claim_id, has_batch=b is not None,
            batch_expired=b is not None and b.expires_at <= self.now(),
            batch_approved=b is not None and b.approved_at is not None,
        )  # fmt: skip

    async def claim_interrupted(
        self,
        command_id: str,
        agent_id: str,
        journal: str | None,
        signed_at_ms: int,
        generation: int,
        present: bool,
    ) -> CommandRow | None:
        """``CLAIM_INTERRUPTED``"""
        c = self._cmd(command_id, agent_id)
        if c is None or c.state not in _CLAIMED or (journal is not None and c.claim_journal == journal):
            return None
        signed_before = (c.claim_signed_ms or 0) < signed_at_ms
        if journal is None:
            newer = signed_before
        else:
            claimed_by = self._t.journals.get((agent_id, c.claim_journal or ""))
            older_generation = (claimed_by.generation if claimed_by is not None else 0) < generation
            newer = older_generation and (present or signed_before)
        if not newer:
            return None
        return self._touch(c, state="failed", reason="interrupted", finished_at=self.now())

    async def claim_rerun(self, command_id: str, agent_id: str, journal: str) -> CommandRow | None:
        """``CLAIM_RERUN``"""
        c = self._cmd(command_id, agent_id)
        if c is None or c.state not in _CLAIMED or c.claim_journal != journal or c.not_after <= self.now():
            return None
        return self._touch(c)

    async def claim_back_to_pending(
        self, command_id: str, agent_id: str, journal: str | None, claim_id: str | None = None
    ) -> CommandRow | None:
        """``CLAIM_BACK_TO_PENDING``"""
        c = self._cmd(command_id, agent_id)
        if c is None or not self._claimable(c, journal, claim_id):
            return None
        return self._touch(
            c, state="pending", reason="batch-not-approved", published_at=None,
            agent_id=c.agent_id if c.target == "node" else None, claim_journal=None, claim_signed_ms=None,
            claim_id=None,
        )  # fmt: skip

    async def claim_batch_expired(
        self, command_id: str, agent_id: str, journal: str | None, claim_id: str | None = None
    ) -> CommandRow | None:
        """``CLAIM_BATCH_EXPIRED``"""
        c = self._cmd(command_id, agent_id)
        if c is None or not self._claimable(c, journal, claim_id):
            return None
        return self._touch(c, state="expired", reason="batch-expired", finished_at=self.now())

    # -- runs ------------------------------------------------------------------------
    async def progress(self, command_id: str, agent_id: str, message: str | None) -> ProgressRow | None:
        """``PROGRESS``"""
        c = self._cmd(command_id, agent_id)
        if c is None or c.state not in ("acked", "running", "cancelling"):
            return None
        old = c.state
        row = self._touch(
            c,
            state="cancelling" if old == "cancelling" else "running",
            progress=message if message is not None else c.progress,
        )
        return ProgressRow(command=row, old_state=old)

    async def progress_many(self, said: Sequence[Said]) -> list[ProgressRow | None]:
        """``PROGRESS_MANY``: ``PROGRESS`` of each"""
        return [await self.progress(p.command_id, p.agent_id, p.message) for p in said]

    async def result_many(self, reports: Sequence[Report]) -> list[CommandRow | None]:
        """``RESULT_MANY``: ``RESULT`` of each"""
        return [
            await self.result(
                r.command_id,
                r.agent_id,
                status=r.status,
                reason=r.reason,
                result=r.result,
                signature=r.signature,
                attested=r.attested,
                journal=r.journal,
            )
            for r in reports
        ]

    async def result(
        self,
        command_id: str,
        agent_id: str,
        *,
        status: str,
        reason: str | None,
        result: bytes,
        signature: bytes | None,
        attested: bool,
        journal: str,
    ) -> CommandRow | None:
        """``RESULT``: a cancelling command's result is its agent's word that it stopped it."""
        c = self._cmd(command_id, agent_id)
        if c is None or c.state not in ("acked", "running", "cancelling"):
            return None
        now = self.now()
        if c.state != "cancelling":
            return self._touch(
                c, state=cast(CommandState, status), reason=reason, result=result,
                result_signature=signature, attested=attested, finished_at=now,
            )  # fmt: skip
        confirmed = journal == "" or c.claim_journal is None or c.claim_journal == journal
        said = f"the agent stopped: {status}" + (f" ({reason})" if reason is not None else "")
        progress = ((c.progress + "; ") if c.progress is not None else "") + said
        return self._touch(
            c, state="cancelled" if confirmed else "failed",
            reason=c.reason if confirmed else "interrupted", progress=progress[:500], result=None,
            result_signature=None, attested=False, ended_at=now if confirmed else c.ended_at,
            finished_at=now,
        )  # fmt: skip

    async def late_end(self, command_id: str, agent_id: str) -> list[CommandRow]:
        """``LATE_END``"""
        c = self._cmd(command_id, agent_id)
        if c is None or c.acked_at is None or c.ended_at is not None:
            return []
        if not (c.state in ("cancelled", "expired") or (c.state == "failed" and c.reason == "interrupted")):
            return []
        return [self._touch(c, ended_at=self.now())]

    # -- the sweeper -----------------------------------------------------------------
    def _where(self, keep: Iterable[_Command], *, by: str = "created_at", limit: int = 500) -> list[_Command]:
        return sorted(keep, key=lambda c: (getattr(c, by) or 0.0, c.id))[:limit]

    async def expire_due(self, *, quorum: bool) -> list[CommandRow]:
        """``EXPIRE_DUE``"""
        now = self.now()
        due = self._where(
            (c for c in self._t.commands.values() if c.state in _LIVE and c.not_after <= now), by="not_after"
        )
        rows = []
        for c in due:
            if c.state == "pending":
                b = self._batch_of(c)
                unapproved = b is None or b.approved_at is None
                reason = "quorum-not-reached" if c.destructive and quorum and unapproved else "not-dispatched"
            else:
                reason = "not-claimed" if c.state == "dispatched" else "not-finished"
            rows.append(self._touch(c, state="expired", reason=reason, finished_at=now))
        return rows

    async def expire_batch_expired(self) -> list[CommandRow]:
        """``EXPIRE_BATCH_EXPIRED``"""
        now = self.now()
        due = []
        for c in self._t.commands.values():
            b = self._batch_of(c)
            if (
                c.state in ("pending", "dispatched")
                and c.destructive
                and b is not None
                and b.expires_at <= now
            ):
                due.append(c)
        return [self._touch(c, state="expired", reason="batch-expired", finished_at=now) for c in due[:500]]

    def _silent_for(self, c: _Command, ms: int) -> bool:
        a = self._t.agents.get(c.agent_id) if c.agent_id is not None else None
        return a is not None and a.last_seen < self.now() - a.quiet(ms)

    async def reassign_silent(self, *, silent_after_ms: int) -> list[CommandRow]:
        """``REASSIGN_SILENT``"""
        due = [
            c
            for c in self._t.commands.values()
            if c.state == "dispatched"
            and c.target == "site"
            and not c.destructive
            and self._silent_for(c, silent_after_ms)
        ]
        return [
            self._touch(c, state="pending", agent_id=None, published_at=None, reason="agent-silent")
            for c in due[:500]
        ]

    async def fail_lost(self, *, lost_after_ms: int, silent_after_ms: int) -> list[CommandRow]:
        """``FAIL_LOST``: only while the agent's site is heard (another of its agents heard now and
        connected without a break for ``lost_after_ms``)."""
        now = self.now()
        cut = now - lost_after_ms / 1000

        def site_heard(agent_id: str | None) -> bool:
            a = self._t.agents.get(agent_id) if agent_id is not None else None
            return a is not None and any(
                b_id != agent_id and b.site_id == a.site_id and b.last_seen > now - b.quiet(silent_after_ms)
                and b.connected_at < cut
                for b_id, b in self._t.agents.items()
            )  # fmt: skip

        due = [
            c
            for c in self._t.commands.values()
            if c.state in ("acked", "running", "cancelling")
            and self._silent_for(c, lost_after_ms)
            and c.updated_at < cut
            and site_heard(c.agent_id)
        ]
        return [
            self._touch(c, state="failed", reason="agent-lost", finished_at=self.now()) for c in due[:500]
        ]

    async def dispatch_pending(
        self,
        *,
        quorum: bool,
        site_id: str | None,
        batch_id: str | None,
        limit: int,
        silent_after_ms: int,
    ) -> list[CommandRow]:
        """``DISPATCH_PENDING``"""
        now = self.now()

        def may_go(c: _Command) -> bool:
            b = self._batch_of(c)
            approved = b is not None and b.approved_at is not None and b.expires_at > now
            has_agent = c.target == "node" or any(
                a.site_id == c.site_id and a.role == "site" and a.last_seen > now - a.quiet(silent_after_ms)
                for a in self._t.agents.values()
            )
            return (
                c.state == "pending"
                and c.not_after > now
                and (not c.destructive or not quorum or approved)
                and (site_id is None or c.site_id == site_id)
                and (batch_id is None or c.batch_id == batch_id)
                and has_agent
            )

        rows = []
        for c in self._where(filter(may_go, self._t.commands.values()), limit=limit):
            agent = c.node_id if c.target == "node" else self._pick(c.site_id, c.kind, silent_after_ms)
            if agent is not None:
                rows.append(
                    self._touch(
                        c,
                        state="dispatched",
                        agent_id=agent,
                        dispatched_at=now,
                        published_at=None,
                        reason=None,
                    )
                )
        return rows

    async def republish_due(self, *, redeliver_after_ms: int, silent_after_ms: int) -> list[CommandRow]:
        """``REPUBLISH_DUE``"""
        now = self.now()

        def due(c: _Command) -> bool:
            if c.state != "dispatched":
                return False
            if c.published_at is None:
                return c.dispatched_at is not None and c.dispatched_at < now - 2.0
            stale = c.published_at < now - redeliver_after_ms / 1000
            return stale and self._connected(c.agent_id, silent_after_ms)

        return [
            c.row()
            for c in self._where(filter(due, self._t.commands.values()), by="dispatched_at", limit=200)
        ]

    async def purge_finished(self, *, retention_days: int) -> int:
        """``PURGE_FINISHED``"""
        cut = self.now() - retention_days * 86400
        gone = [c.id for c in self._t.commands.values() if c.state in TERMINAL_STATES and c.updated_at < cut]
        for ident in gone[:1000]:
            del self._t.commands[ident]
        return len(gone[:1000])


_CHECKED: type[Store] = MemoryStore  # mypy checks every operation against the protocol here
