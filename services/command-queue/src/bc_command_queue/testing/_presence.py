"""``MemoryStore``'s agents: presence, boot leases, revoked certificates, and the metrics' counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..rows import (
    AgentCountRow,
    AgentRow,
    AgentSeenRow,
    Beat,
    CommandRow,
    CutOffRow,
    LiveCountRow,
)
from ..storage import AgentHello
from ._tables import _CLAIMED, _LIVE, Tables, _Agent, _Journal

__all__ = ["Presence"]

_OUT = ("dispatched", "acked", "running")


class Presence(Tables):
    """Agents' operations of the ``Store``, each after its statement (named in its docstring)."""

    def _seen(self, agent_id: str) -> AgentSeenRow:
        a = self._t.agents[agent_id]
        return AgentSeenRow(id=agent_id, site_id=a.site_id, role=a.role)

    def _revoked(self, agent_id: str) -> bool:
        a = self._t.agents.get(agent_id)
        return a is not None and a.cert_id in self._t.revoked

    async def agent_hello(self, hello: AgentHello) -> bool:
        """``AGENT_UPSERT``: a new agent is taken as it is; a known one only by a newer event of a
        certificate that is not revoked."""
        h, now = hello, self.now()
        a = self._t.agents.get(h.agent_id)
        if a is not None and (a.last_signed_ms >= h.signed_at_ms or h.cert_id in self._t.revoked):
            return False
        self._t.agents[h.agent_id] = _Agent(
            site_id=h.site_id, role=h.role, kinds=h.kinds, last_seen=now, tenant_id=h.tenant_id,
            cert_id=h.cert_id, incarnation=h.incarnation, version=h.version, connected_at=now,
            last_signed_ms=h.signed_at_ms, status=h.status, beat_gap_ms=h.gap_ms,
        )  # fmt: skip
        return True

    async def agent_heartbeat(
        self, agent_id: str, signed_at_ms: int, cert_id: str, status: str | None, *, silent_after_ms: int
    ) -> AgentSeenRow | None:
        """``AGENT_HEARTBEAT``"""
        a = self._t.agents.get(agent_id)
        if a is None or a.last_signed_ms >= signed_at_ms or cert_id in self._t.revoked:
            return None
        now = self.now()
        if a.last_seen < now - a.quiet(silent_after_ms):
            a.connected_at = now  # the first word after a silence: a new connection
        a.beat_gap_ms = 0
        a.last_seen, a.last_signed_ms, a.cert_id = now, signed_at_ms, cert_id
        a.status = status if status is not None else a.status
        return self._seen(agent_id)

    async def agent_leave(
        self, agent_id: str, signed_at_ms: int, *, silent_after_ms: int
    ) -> AgentSeenRow | None:
        """``AGENT_LEAVE``"""
        a = self._t.agents.get(agent_id)
        if a is None or a.last_signed_ms >= signed_at_ms:
            return None
        a.last_seen, a.last_signed_ms = self.now() - silent_after_ms / 1000 - 1, signed_at_ms
        a.beat_gap_ms = 0
        return self._seen(agent_id)

    async def agents_heard(self, beats: Sequence[Beat], *, silent_after_ms: int) -> list[str]:
        """``AGENTS_HEARD``"""
        applied: list[str] = []
        for b in sorted(beats, key=lambda b: b.agent_id):
            a = self._t.agents.get(b.agent_id)
            if a is None or a.last_signed_ms >= b.signed_at_ms or b.cert_id in self._t.revoked:
                continue
            heard = self.now() - b.age_ms / 1000
            if a.last_seen < heard - a.quiet(silent_after_ms):
                a.connected_at = heard
            a.beat_gap_ms = b.gap_ms
            a.last_seen, a.last_signed_ms, a.cert_id = max(a.last_seen, heard), b.signed_at_ms, b.cert_id
            a.status = b.status if b.status is not None else a.status
            if b.journal_id:
                j = self._t.journals.get((b.agent_id, b.journal_id))
                if j is None:
                    j = _Journal(generation=next(self._generations), last_seen=heard, present=True)
                    self._t.journals[(b.agent_id, b.journal_id)] = j
                j.last_seen, j.present = max(j.last_seen, heard), True
            applied.append(b.agent_id)
        return applied

    async def all_cancelling(self) -> dict[str, list[str]]:
        """``ALL_CANCELLING``"""
        found: dict[str, list[str]] = {}
        for c in sorted(self._t.commands.values(), key=lambda c: c.id):
            if c.state == "cancelling" and c.agent_id is not None:
                ids = found.setdefault(c.agent_id, [])
                if len(ids) < 256:
                    ids.append(c.id)
        return found

    async def agent_by_id(self, agent_id: str) -> AgentSeenRow | None:
        """``AGENT_AGAIN``"""
        return self._seen(agent_id) if agent_id in self._t.agents else None

    async def renew_lease(self, site_id: str, agent_id: str, *, ttl_ms: int) -> bool:
        """``LEASE_RENEW``"""
        if self._revoked(agent_id):
            return False
        holder, until = self._t.leases.get(site_id, (agent_id, 0.0))
        if holder != agent_id and until > self.now():
            return False
        self._t.leases[site_id] = (agent_id, self.now() + ttl_ms / 1000)
        return True

    async def release_lease(self, site_id: str, agent_id: str) -> None:
        """``LEASE_RELEASE``"""
        if self._t.leases.get(site_id, (None, 0.0))[0] == agent_id:
            del self._t.leases[site_id]

    async def cut_off(self, cert_id: str, *, silent_after_ms: int) -> CutOffRow:
        """``CERT_REVOKED_MARK``, ``CERT_REVOKED_CUT_OFF``, ``CERT_REVOKED_LEASES``,
        ``CERT_REVOKED_REASSIGN``"""
        self._t.revoked.add(cert_id)
        silent = self.now() - silent_after_ms / 1000 - 1
        ids = [agent_id for agent_id, a in self._t.agents.items() if a.cert_id == cert_id]
        for agent_id in ids:
            a = self._t.agents[agent_id]
            a.last_seen, a.beat_gap_ms = min(a.last_seen, silent), 0
        self._t.leases = {site: held for site, held in self._t.leases.items() if held[0] not in ids}
        back = [
            self._touch(c, state="pending", agent_id=None, published_at=None, reason="agent-revoked")
            for c in self._t.commands.values()
            if c.agent_id in ids and c.state == "dispatched" and c.target == "site"
        ]
        return CutOffRow(agents=[self._seen(i) for i in ids], reassigned=back)

    async def must_stop(self, command_ids: Sequence[str], agent_id: str) -> list[str]:
        """``MUST_STOP``"""
        return [i for i in command_ids if (c := self._cmd(i, agent_id)) is None or c.state not in _CLAIMED]

    async def cancelling(self, agent_id: str) -> list[str]:
        """``AGENT_CANCELLING``"""
        found = [
            c.id for c in self._t.commands.values() if c.agent_id == agent_id and c.state == "cancelling"
        ]
        return sorted(found)[:256]

    async def agent_commands_to_republish(self, agent_id: str) -> list[CommandRow]:
        """``AGENT_COMMANDS_TO_REPUBLISH``"""
        found = [
            c
            for c in self._t.commands.values()
            if c.agent_id == agent_id and c.state in ("dispatched", "acked")
        ]
        return [c.row() for c in sorted(found, key=lambda c: c.dispatched_at or 0.0)]

    async def list_agents(
        self,
        *,
        site_id: str | None,
        role: str | None,
        connected: bool | None,
        silent_after_ms: int,
        limit: int,
        after: tuple[str, str] | None,
    ) -> list[AgentRow]:
        """``AGENTS_LIST``"""
        now = self.now()
        rows = []
        for agent_id, a in sorted(self._t.agents.items(), key=lambda item: (item[1].site_id, item[0])):
            heard = a.last_seen > now - a.quiet(silent_after_ms)
            if (
                (site_id is not None and a.site_id != site_id)
                or (role is not None and a.role != role)
                or (connected is not None and heard != connected)
                or (after is not None and (a.site_id, agent_id) <= after)
            ):
                continue
            holder, until = self._t.leases.get(a.site_id, (None, 0.0))
            live = sum(1 for c in self._t.commands.values() if c.agent_id == agent_id and c.state in _OUT)
            row = AgentRow(
                id=agent_id, site_id=a.site_id, tenant_id=a.tenant_id, role=a.role, cert_id=a.cert_id,
                version=a.version, kinds=a.kinds, connected_at=a.connected_at, last_seen=a.last_seen,
                status=a.status, connected=heard, boot_lease=holder == agent_id and until > now, live=live,
            )  # fmt: skip
            rows.append(row)
        return rows[:limit]

    async def site_of_node(self, node_id: str) -> str | None:
        """``SITE_OF_NODE``"""
        if node_id in self._t.agents:
            return self._t.agents[node_id].site_id
        found = sorted((c.id, c.site_id) for c in self._t.commands.values() if c.node_id == node_id)
        return found[-1][1] if found else None

    async def pick_site_agent(self, site_id: str, *, silent_after_ms: int, kind: str | None) -> str | None:
        """``PICK_SITE_AGENT``"""
        return self._pick(site_id, kind, silent_after_ms)

    # -- metrics ---------------------------------------------------------------------
    async def live_counts(self) -> list[LiveCountRow]:
        """``LIVE_BY_STATE``"""
        counted = Counter((c.kind, c.state, c.site_id) for c in self._t.commands.values() if c.state in _LIVE)
        return [LiveCountRow(kind=k, state=st, site=site, n=n) for (k, st, site), n in counted.items()]

    async def agents_connected(self, *, silent_after_ms: int) -> list[AgentCountRow]:
        """``AGENTS_CONNECTED``"""
        now = self.now()
        counted = Counter(
            (a.site_id, a.role)
            for a in self._t.agents.values()
            if a.last_seen > now - a.quiet(silent_after_ms)
        )
        return [AgentCountRow(site=site, role=role, n=n) for (site, role), n in counted.items()]

    async def batches_waiting(self) -> int:
        """``BATCHES_WAITING``"""
        now = self.now()
        return sum(
            1
            for b in self._t.batches.values()
            if b.approved_at is None and b.closed_at is None and b.expires_at > now
        )
