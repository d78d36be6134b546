"""Node agents' presence, held in memory and written once a ``presence_write_ms``.

A fleet's machines each run a ``bcd`` that heartbeats every ``cmdq.heartbeat`` (5 s): a thousand
machines are 200 heartbeats a second. Each used to be three statements (the agent's ``last_seen``,
its journal's, its cancelled commands), two of them commits with fsync; on a loaded machine
PostgreSQL's commits held the service's connections, and the engine's requests waited behind
thousands of heartbeats for a connection (``commands.enqueue`` unanswered for more than 10 s).

Here a node agent's heartbeat, once its signature checks, is answered from memory and kept (the
newest per agent); every ``presence_write_ms`` all of them are written in one statement
(``AGENTS_HEARD``: ``last_seen`` set to when each was heard, so the silence rules see the same
times as before, late by nothing), and the cancelled commands of every agent are read once, for
the next replies. Each instance holds only the heartbeats that reached it (the agent events'
queue group); the rows stay the truth for every instance's sweeper, as before. A heartbeat is
at most ``presence_write_ms`` late in the rows, far below ``cmdq.silent_after``; a cancel reaches
a heartbeat's reply at most that much later (the check before each try is the prompt path).

A machine's agent with nothing to do heartbeats every ``cmdq.idle_heartbeat`` (30 s), not every
``cmdq.heartbeat``, and each heartbeat says the gap until its next one: that gap is held here with
the heartbeat and written with it (``agents.beat_gap_ms``), and every silence rule counts the agent
silent only after three such gaps (``store._QUIET``).

A site agent's heartbeat still goes to the rows at once: it renews its site's boot lease, and
its answer says whether it holds it (a handful of agents).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Final

from better_compute.core.errors import BcError, ErrorCode
from better_compute.service.faults import describe, is_transient

from .config import CmdqConfig
from .rows import Beat
from .storage import Store

__all__ = ["Presence"]

_KNOWN_MAX: Final = 1_000_000
"""Agent ids remembered as known; past that the memory starts again (each then costs a read)."""


class _Heard:
    __slots__ = ("cert_id", "gap_ms", "heard", "journal_id", "signed_at_ms", "status")

    def __init__(
        self, signed_at_ms: int, cert_id: str, status: str | None, journal_id: str, heard: float, gap_ms: int
    ) -> None:
        self.signed_at_ms = signed_at_ms
        self.cert_id = cert_id
        self.status = status
        self.journal_id = journal_id
        self.heard = heard
        self.gap_ms = gap_ms


class Presence:
    """Node agents' heartbeats: answered from memory, written together (see the module).

    Args:
        clock: monotonic seconds (a test gives its own).
    """

    def __init__(
        self,
        *,
        store: Store,
        config: CmdqConfig,
        log: Any,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.config = config
        self.log = log
        self.clock = clock
        self._pending: dict[str, _Heard] = {}
        self._newest: dict[str, int] = {}
        """The newest signing time heard here per agent (a replay to this instance is answered
        at once as one; to another, the statement's own check refuses it)."""
        self._known: set[str] = set()
        self._cancelling: dict[str, list[str]] = {}
        self._write_lock = asyncio.Lock()

    @property
    def pending(self) -> int:
        """Heartbeats heard and not written yet."""
        return len(self._pending)

    async def heard(
        self,
        agent_id: str,
        *,
        signed_at_ms: int,
        cert_id: str,
        status: str | None,
        journal_id: str,
        gap_ms: int = 0,
    ) -> list[str] | None:
        """A node agent's checked heartbeat: kept for the next write. Returns its cancelled
        commands (as of the last write), or None for an event older than one heard here.
        ``gap_ms``: the gap it announced until its next heartbeat, as kept
        (``CmdqConfig.silence_gap_ms``).

        Raises:
            BcError: ``NOT_FOUND`` for an agent that never said hello.
        """
        if agent_id not in self._known:
            if await self.store.agent_by_id(agent_id) is None:
                raise BcError(ErrorCode.NOT_FOUND, "unknown agent: say hello first")
            if len(self._known) >= _KNOWN_MAX:
                self._known.clear()
                self._newest.clear()
            self._known.add(agent_id)
        if signed_at_ms <= self._newest.get(agent_id, 0):
            return None
        self._newest[agent_id] = signed_at_ms
        self._pending[agent_id] = _Heard(signed_at_ms, cert_id, status, journal_id, self.clock(), gap_ms)
        return list(self._cancelling.get(agent_id, ()))

    def forget(self, agent_id: str) -> None:
        """The agent left or said hello (written at once): a heartbeat held for it is older."""
        self._pending.pop(agent_id, None)

    async def write(self) -> int:
        """Write what was heard since the last write, in one statement; read the cancels for the
        next replies. Returns the heartbeats written. A store fault keeps them for the next try
        (their times stay when they were heard) and raises."""
        async with self._write_lock:
            beats, self._pending = self._pending, {}
            now = self.clock()
            rows = [
                Beat(agent_id=agent_id, signed_at_ms=h.signed_at_ms, cert_id=h.cert_id, status=h.status,
                     journal_id=h.journal_id, age_ms=max(0.0, (now - h.heard) * 1000), gap_ms=h.gap_ms)
                for agent_id, h in beats.items()
            ]  # fmt: skip
            try:
                silent_ms = self.config.silent_after_ms
                applied = set(await self.store.agents_heard(rows, silent_after_ms=silent_ms))
            except BaseException:
                for agent_id, h in beats.items():  # newer ones heard meanwhile win
                    held = self._pending.get(agent_id)
                    if held is None or held.signed_at_ms < h.signed_at_ms:
                        self._pending[agent_id] = h
                raise
            # not applied: unknown (asked again at its next heartbeat), an older event or a
            # revoked certificate; nothing to keep
            self._known.difference_update(b.agent_id for b in rows if b.agent_id not in applied)
            self._cancelling = await self.store.all_cancelling()
            return len(rows)

    @property
    def write_every_s(self) -> float:
        """``presence_write_ms``, or less where the heartbeat or the silence is short (the tests'
        200 ms heartbeat and 1.5 s silence): a row is never more than a heartbeat late."""
        cfg = self.config
        return min(cfg.presence_write_ms, cfg.heartbeat_ms, cfg.silent_after_ms / 4) / 1000

    async def run(self) -> None:
        """Write every ``write_every_s``; a store outage is logged, the heartbeats kept."""
        while True:
            await asyncio.sleep(self.write_every_s)
            try:
                await self.write()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.log.warning("presence_write_failed", error=describe(exc), held=self.pending)

    async def flush(self) -> None:
        """At stop: what was heard goes to the rows (best effort)."""
        try:
            await self.write()
        except Exception as exc:
            self.log.warning("presence_write_failed", error=describe(exc), held=self.pending)
