"""The bc-command-queue service process: start-up, routes and side loops.

Commands are rows in PostgreSQL (the truth) and deliveries on per-site JetStream streams (the
channel). The work is split by concern, each part a plain class given what it needs:

* ``commands``: enqueue, get, list, states, cancel, live-with-ref;
* ``agents``: agents' signed events (hello, heartbeat, claim, progress, result) and the
  agent routes;
* ``batches``: destructive-command batches, approvals and the quorum;
* ``sweeper``: expiry, reassignment, lost agents, dispatch of pending commands, publishing
  again what was not delivered, retention;
* ``delivery``: streams, consumers and publishing;
* ``site_results``: with the streams on the sites' leaves (``cmdq.site_domain``), the results
  the agents stored there, read and applied;
* ``storage``: the ``Store`` those parts change rows through (``PgStore`` here; an in-memory
  one in ``bc_command_queue.testing`` for unit tests), ``rows`` its row Structs;
* ``store``: every SQL statement.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from nats.aio.msg import Msg

from better_compute.app import load_app
from better_compute.clients.pki import PkiClient
from better_compute.config import Settings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.service import Handler, Service
from better_compute.service.events import ensure_events_stream

from . import metrics
from .agents import Agents
from .batches import Batches
from .commands import Commands
from .config import CmdqConfig, quorum_from_settings
from .delivery import Deliveries, Streams
from .events import CommandEvents
from .presence import Presence
from .rows import CommandRow
from .signers import Signers
from .site_results import SiteResults
from .storage import PgStore
from .sweeper import Sweeper

__all__ = ["CommandQueueService"]

EVENTS_STREAM_CHECK_S = 60.0


class Parts(NamedTuple):
    """The service's parts, made at start (they need the database, NATS and the app)."""

    commands: Commands
    agents: Agents
    batches: Batches
    sweeper: Sweeper


class CommandQueueService(Service):
    """Command queue: commands, per-site streams, agents, destructive-batch quorum"""

    name: ClassVar[str] = "bc-command-queue"
    api_name: ClassVar[str] = "command-queue"
    schema: ClassVar[str | None] = "cmdq"
    migrations_package: ClassVar[str | None] = "bc_command_queue.migrations"
    description: ClassVar[str] = "Command queue: commands, per-site streams, agents, destructive-batch quorum"
    audit_routes: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "commands.cancel": ("nodeId", "workflowId", "keyPrefix", "reason"),
        "batches.create": ("tenantId", "kinds", "nodes", "workflowId", "ttlSeconds", "note"),
        "batches.approve": ("batchId", "approverId"),  # approverId: the identity the signature proves
        "batches.close": ("id", "reason"),
        "batches.reopen": ("id",),
    }

    live_settings: ClassVar[tuple[str, ...]] = ("cmdq.quorum",)

    def __init__(self, settings: Settings, *, config: CmdqConfig | None = None) -> None:
        super().__init__(settings)
        self.config = config if config is not None else CmdqConfig.from_settings(settings.cmdq)
        self.signers: Signers | None = None
        self._parts: Parts | None = None
        self._store: PgStore | None = None
        self._presence: Presence | None = None
        self._site_results: SiteResults | None = None
        self._events = CommandEvents(self.publish_event, log=self.log)

    async def on_start(self) -> None:
        assert self.nc is not None
        assert self.api is not None
        assert self.db is not None
        app = load_app(self.settings.app)
        pki = PkiClient(self.api, timeout=5.0)
        self.signers = Signers(pki, ttl_seconds=self.config.cert_cache_seconds)
        streams = Streams(
            self.nc,
            self.subjects,
            replicas=self.config.stream_replicas,
            max_age_seconds=self.config.stream_max_age_seconds,
            ack_wait_seconds=self.config.ack_wait_ms / 1000,
            max_consumers=self.config.stream_max_consumers,
            inactive_seconds=self.config.consumer_inactive_ms / 1000,
            site_domain=self.config.site_domain,
            on_site=self._watch_site_results,
        )
        db, config, log = self.db, self.config, self.log
        rows = PgStore(db)
        deliveries = Deliveries(rows, streams, log)
        sweeper = Sweeper(
            store=rows,
            config=config,
            deliveries=deliveries,
            changed=self._changed,
            connected=lambda: self.nc is not None and self.nc.is_connected,
            log=log,
        )
        dispatch = sweeper.dispatch_pending
        batches = Batches(
            store=rows, config=config, app=app, changed=self._changed, dispatch_pending=dispatch, log=log,
            publish=self.publish_event,
        )  # fmt: skip
        sweeper.duties.append(batches.publish_expiries)
        sweeper.duties.append(batches.reload_quorum)  # an approvers file changed: in force at once
        presence = Presence(store=rows, config=config, log=log)
        agents = Agents(
            store=rows,
            config=config,
            streams=streams,
            deliveries=deliveries,
            pki=pki,
            signers=self.signers,
            changed=self._changed,
            dispatch_pending=dispatch,
            spawn=self._spawn,
            log=log,
            reruns=lambda kind, payload: app.command_kind(kind, path="kind").reruns(payload),
            presence=presence,
        )
        self._presence = presence
        commands = Commands(
            store=rows, config=config, app=app, deliveries=deliveries, changed=self._changed, log=log
        )
        if streams.on_leaves:
            self._site_results = SiteResults(
                store=rows, streams=streams, subjects=self.subjects, signers=self.signers,
                runs=agents.runs, silent_after_ms=config.silent_after_ms, log=log,
            )  # fmt: skip
            self.log.info("site_streams_on_leaves", site_domain=config.site_domain)
        self._parts = Parts(commands, agents, batches, sweeper)
        self._store = rows
        # The durable event feed: this service creates the stream (it holds the JetStream
        # rights); the others publish plain NATS on bc.events.> and the stream keeps it all.
        await self._ensure_events_stream()
        await batches.recount_all()
        # One instance handles each agent event (queue group); every instance evicts a
        # revoked certificate from its own cache.
        loop = asyncio.get_running_loop()

        def on_agent_event(msg: Msg) -> Coroutine[Any, Any, None]:
            # stamped as it arrives, before its task waits for the event loop: an event that
            # has not reached the store in agent_event_wait_ms is answered busy (agents.py)
            return agents.on_event(msg, received=loop.time())

        await self.nc.subscribe(
            self.subjects.agent_events_all(),
            queue=f"{self.subjects.root}.cmdq.agent-events",
            cb=self.on_message(on_agent_event),
        )
        await self.nc.subscribe(self.subjects.events_all("cert"), cb=self.on_message(self._on_cert_event))
        quorum = self.config.quorum
        if quorum.enabled:
            self.log.info("quorum_configured", threshold=quorum.threshold, approvers=sorted(quorum.approvers))
        else:
            # Loud: destructive commands (wipes, image writes, driver operations) then run unapproved.
            self.log.warning(
                "quorum_off",
                detail="no approvers are configured: destructive commands run without approval;"
                " set [cmdq.quorum] in bc.toml (or BC_CMDQ_QUORUM_FILE)",
            )

    async def apply_settings(self, settings: Settings, changed: list[str]) -> None:
        """``[cmdq.quorum]`` changed in the config file (inline approvers, or another file):
        the new quorum is in force at once and open batches' approvals are counted again."""
        del changed
        source = quorum_from_settings(settings.cmdq.quorum)
        if source.quorum.enabled != self.config.quorum.enabled:
            # as with an approvers file: a quorum turned off (or on) is a deliberate restart,
            # never an edit that a running service takes up
            raise BcError(
                ErrorCode.INVALID_CONFIG,
                "turning the quorum "
                + ("off" if self.config.quorum.enabled else "on")
                + " takes a restart of the command queue; list at least one approver to change them live",
                {"path": "cmdq.quorum.approvers"},
            )
        await self.parts.batches.adopt_quorum(source)

    @property
    def parts(self) -> Parts:
        assert self._parts is not None, "the service has not started"
        return self._parts

    def routes(self) -> Mapping[str, Handler]:
        commands, agents, batches = self.parts.commands, self.parts.agents, self.parts.batches
        return {
            "commands.enqueue": commands.enqueue,
            "commands.get": commands.get,
            "commands.states": commands.states,
            "commands.list": commands.list_commands,
            "commands.cancel": commands.cancel,
            "commands.live_with_ref": commands.live_with_ref,
            "agents.list": agents.list_agents,
            "agents.site_agent_for": agents.site_agent,
            "batches.create": batches.create,
            "batches.get": batches.get,
            "batches.list": batches.list_batches,
            "batches.approve": batches.approve,
            "batches.close": batches.close,
            "batches.reopen": batches.reopen,
            "quorum.get": batches.quorum,
        }

    async def collect_metrics(self) -> None:
        if self._store is not None:
            await metrics.collect(self._store, silent_after_ms=self.config.silent_after_ms)

    def side_loops(self) -> Mapping[str, Any]:
        sweeper = self.parts.sweeper
        loops = {
            "sweeper": sweeper.run,
            "retention": sweeper.retention,
            "events_stream": self._events_stream,
            "presence": self.parts.agents.presence.run,
        }
        if self._site_results is not None:
            loops["site_results"] = self._site_results.run
        return loops

    async def on_stop(self) -> None:
        if self._presence is not None:  # what was heard goes to the rows before the pool closes
            await self._presence.flush()

    def _watch_site_results(self, site_id: str) -> None:
        if self._site_results is not None:
            self._site_results.watch(site_id)

    async def _ensure_events_stream(self) -> bool:
        """The feed is for readers outside the control plane: a stream JetStream refuses (no
        room, no rights) is logged and tried again, never a reason to stop serving commands."""
        assert self.nc is not None
        try:
            await ensure_events_stream(self.nc, self.subjects, self.settings.events, self.log)
            return True
        except Exception as exc:
            self.log.warning("events_stream_unavailable", error=f"{type(exc).__name__}: {exc}")
            return False

    async def _events_stream(self) -> None:
        """Look again now and then: a stream deleted by hand, or refused at start, comes back."""
        while True:
            ok = await self._ensure_events_stream()
            await asyncio.sleep(EVENTS_STREAM_CHECK_S if ok else 5.0)

    async def sweep(self) -> None:
        """One pass of every timed duty; safe in several instances at once."""
        await self.parts.sweeper.sweep()

    async def purge(self) -> int:
        """Delete finished commands older than the retention (see ``Sweeper.purge``)."""
        return await self.parts.sweeper.purge()

    async def _changed(self, rows: Sequence[CommandRow]) -> None:
        """Publish each changed command's event, in the order of its states: the engine wakes
        on it."""
        metrics.observe_changes(rows)
        await self._events.changed(rows)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _on_cert_event(self, msg: Msg) -> None:
        cert_id = msg.subject.rsplit(".", 1)[-1]
        if self.signers is not None:
            self.signers.evict(cert_id)
        if self._parts is not None:
            await self.parts.agents.on_cert_event(cert_id)
