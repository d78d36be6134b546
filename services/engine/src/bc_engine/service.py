"""The bc-engine service process."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Coroutine, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import msgspec
from nats.aio.msg import Msg

from better_compute.app import App, load_app
from better_compute.config import Settings, UserDataSettings
from better_compute.core.errors import BcError, ErrorCode
from better_compute.keyring import Keyring
from better_compute.metal.steps.joined import STEP_ID as WAIT_JOINED
from better_compute.provision import UserData
from better_compute.service import Database, Handler, Service
from better_compute.service.base import SideLoop
from better_compute.service.faults import is_transient
from better_compute.wire.cmdq import EVENTS as COMMAND_EVENTS
from better_compute.wire.cmdq import LIVE_STATES, MAX_STATE_QUERY, CommandEvent, decode_command_event
from better_compute.wire.pki import JOIN_EVENTS, JoinAccepted, JoinTokenConfirmed, decode_join_event

from . import metrics, store
from .api import EngineApi
from .core import queue
from .core.admission import Admission
from .core.engine import AGENT_POLL_S, Engine, OwnerReconciler
from .core.scheduler import Scheduler
from .core.shards import ShardLeases
from .metal.plugin import MetalPlugin
from .steps.events import WorkflowFeed
from .steps.hooks import EngineHooks, EventHandler
from .steps.host import StepHost
from .steps.runners import StepRunners

__all__ = ["EngineService", "waiting_commands"]

POLL_EVERY = 1.0  # the safety net; wake-ups do the real work
JOIN_PAGE = 200  # certificates per page of the join watch's look
JOIN_SKEW = timedelta(seconds=30)  # the join watch looks back this much more (clocks, slow commits)


async def _init_connection(conn: Any) -> None:
    for typ in ("json", "jsonb"):
        await conn.set_type_codec(typ, encoder=lambda v: v, decoder=json.loads, schema="pg_catalog")


async def waiting_commands(db: Database, shards: list[int]) -> dict[str, str]:
    """The command each running step of a workflow in ``shards`` waits on, with its workflow's
    reconciler key: what the command watch of the process that holds those shards looks at."""
    rows = await db.fetch(store.WAITING_COMMANDS, shards)
    return {r["command_id"]: r["rkey"] for r in rows}


def _owner_reconcilers(app: App) -> dict[str, OwnerReconciler]:
    found: dict[str, OwnerReconciler] = {}
    for module in (*app.modules, *app.plugins):
        for name, fn in (getattr(module, "reconcilers", None) or {}).items():
            found[name] = fn
    return found


def _in_turn(handlers: list[EventHandler]) -> Callable[[Msg], Coroutine[Any, Any, None]]:
    """One subscription's callback: the handlers of its event kind, one after the other."""

    async def each(msg: Msg) -> None:
        for handler in handlers:
            await handler(msg)

    return each


class EngineService(Service):
    """Provision engine: profiles, workflows, the reconciler, step execution."""

    name: ClassVar[str] = "bc-engine"
    api_name: ClassVar[str] = "engine"
    schema: ClassVar[str | None] = "engine"
    migrations_package: ClassVar[str | None] = "bc_engine.migrations"
    description: ClassVar[str] = "Provision engine: profiles, workflows, the reconciler, step execution"
    audit_routes: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "nodes.create": ("siteId", "tenantId", "labels", "name"),
        "nodes.update": ("siteId", "labels", "name", "clearName"),
        "nodes.label": ("set", "remove"),
        "nodes.delete": (),
        "nodes.maintenance": ("on", "reason"),
        "profiles.create": ("tenantId", "document.id", "document.version", "public", "replace"),
        "profiles.delete": ("tenantId", "id", "version"),
        "workflows.start": ("tenantId", "profileId", "profileVersion", "nodeId"),
        "workflows.abort": ("reason",),
        "workflows.retry": ("reason",),
        "workflows.resume": ("reason",),
        "images.register": ("tenantId", "name", "version", "url", "format", "signer", "public"),
        "images.delete": ("tenantId", "ref"),
        "images.signers.add": ("id",),
        "images.signers.remove": ("id",),
        "ramdisk.set": ("kernel", "initrd", "kernelSha256", "initrdSha256", "cmdline", "script"),
        "ramdisk.clear": (),
        **{
            f"metal.{verb}": ("nodeId", "tenantId", "image", "profile")
            for verb in ("adopt", "commission", "deploy", "inspect", "release", "retire")
        },
        "metal.enroll": ("siteId", "tenantId", "name"),
        "metal.power": ("nodeId", "action", "tenantId"),
        "metal.bootDevice": ("nodeId", "device", "tenantId"),
        "metal.bulk": ("verb", "nodeIds", "selector", "tenantId", "image", "profile"),
    }

    live_settings: ClassVar[tuple[str, ...]] = ("images", "ramdisk", "engine.site_admission")

    def make_database(self, url: str) -> Database:
        return Database(url, "engine", min_size=2, max_size=20, init=_init_connection)

    async def on_start(self) -> None:
        assert self.db is not None
        assert self.api is not None
        assert self.nc is not None
        self.app = with_user_data_settings(load_app(self.settings.app), self.settings.userdata)
        for plugin in self.app.plugins:  # what runs: the same list bcx plugins list shows
            source = self.app.plugin_sources.get(plugin.id)
            self.log.info(
                "plugin_loaded",
                plugin=plugin.id,
                entry_point=source.entry_point if source is not None else None,
                distribution=source.distribution if source is not None else None,
                version=source.version if source is not None else None,
                steps=sorted(s.id for s in plugin.steps),
            )
        self.leases = ShardLeases(
            self.db,
            self.instance,
            on_gained=self._shards_gained,
            on_lost=lambda _s: self.scheduler.drop(self._owns_key),
            log=self.log,
        )
        self.hooks = EngineHooks()
        self.engine = Engine(
            app=self.app,
            db=self.db,
            api=self.api,
            leases=self.leases,
            instance=self.leases.owner,  # settles are fenced on this life's leases
            log=self.log,
            publish=self.publish_event,
            owners=self.hooks.owners,
            events=WorkflowFeed(self.publish_event),
        )
        # the plug-ins of the engine register through its hooks: metal, then the app's plugins'
        # owner reconcilers (one of theirs of the same name wins, as before)
        self.hooks.on_event(JOIN_EVENTS, self._on_join)
        self.metal = metal = MetalPlugin(
            self.engine, images=self.settings.images, ramdisk=self.settings.ramdisk
        )
        metal.register(self.hooks)
        self.hooks.owners.update(_owner_reconcilers(self.app))
        await metal.start()
        self.steps = StepHost(self.engine, self.hooks)
        self.engine.runner = StepRunners(self.steps)
        if self.settings.cmdq.engine_key_file:  # a stack without NATS accounts (bcx dev up)
            self.engine.engine_key, _ = Keyring.load_or_create(Path(self.settings.cmdq.engine_key_file))
        self.scheduler = Scheduler(self.engine.reconcile, log=self.log)
        self.engine_api = EngineApi(
            app=self.app,
            db=self.db,
            wake=self.wake,
            publish=self.publish_event,
            quorum=self.steps.quorum,
            pki=self.engine.pki,
            hooks=self.hooks,
            site_admission=lambda: self.settings.engine.site_admission,
        )
        self.hooks.routes.update(metal.routes(self.engine_api, self.steps.quorum))
        self.engine.start_in = self.engine_api.start_in
        self.engine.wake = self.wake
        self.admission = Admission(
            self.db, limit=lambda: self.settings.engine.site_admission, wake=self.wake, log=self.log
        )
        self.engine.on_end = lambda _wf: self.admission.poke()
        self._poll_soon = asyncio.Event()
        self._gained: set[int] = set()  # shards taken since the poll's last look
        self._rkeys: dict[str, str] = {}
        root = self.subjects.root
        self._subs = [
            await self.nc.subscribe(f"{root}.engine.wake", cb=self._on_wake),
            await self.nc.subscribe(self.subjects.events_all(COMMAND_EVENTS), cb=self._on_command),
            *[
                await self.nc.subscribe(
                    self.subjects.events_all(kind), cb=self.on_message(_in_turn(handlers))
                )
                for kind, handlers in self.hooks.event_handlers.items()
            ],
        ]

    def routes(self) -> Mapping[str, Handler]:
        return self.engine_api.routes()

    async def apply_settings(self, settings: Settings, changed: list[str]) -> None:
        """``[images] signers`` changed in the config file: the catalog's allowlist rewritten
        (this engine's next registration and deploy, and every other engine's, use it);
        ``[ramdisk]``: the shipped profiles boot the new one from their next run;
        ``[engine] site_admission``: the next start and admission pass use it."""
        self.metal.check(settings.images, settings.ramdisk)  # wrong: nothing changes
        if any(path.startswith("ramdisk.") for path in changed):
            await self.metal.use_ramdisk(settings.ramdisk)
        if any(path.startswith("images.") for path in changed):
            await self.metal.use_images(settings.images)
        if "engine.site_admission" in changed:
            self.admission.poke()  # more room: admit at once (the lambdas read the new value)

    async def collect_metrics(self) -> None:
        if self.db is not None:
            await metrics.collect(self.db)

    def side_loops(self) -> Mapping[str, SideLoop]:
        return {
            "shard_leases": self.leases.run,
            "work_poll": self._poll_loop,
            "admission": self.admission.run,
            "command_watch": self._command_watch,
            "join_watch": self._join_watch,
            **self.hooks.side_loops,
        }

    def _owns_key(self, rkey: str) -> bool:
        return self.leases.owns(queue.shard_of(rkey)) is not None

    async def wake(self, rkey: str) -> None:
        """Tell whichever engine process owns the key to look at it now."""
        if self._owns_key(rkey):
            self.scheduler.now(rkey)
            return
        assert self.nc is not None
        await self.nc.publish(f"{self.subjects.root}.engine.wake", rkey.encode())

    async def _on_wake(self, msg: Msg) -> None:
        rkey = msg.data.decode(errors="replace")
        if self._owns_key(rkey):
            self.scheduler.now(rkey)

    async def _on_command(self, msg: Msg) -> None:
        match decode_command_event(msg.data):
            case CommandEvent(state=state) if state in LIVE_STATES:
                # dispatched, acked, running: nothing a workflow's step or a plug-in's owner
                # waits for (each waits for its command's end); a look now would only find it
                # live. A host converge's key was looked at on each (its bcd's hello put it out
                # again): 3.5 enqueues a machine in a 200-machine deploy, bench_fleet --agent-events
                return
            case CommandEvent(workflow_id=str() as workflow_id):
                rkey = self._rkeys.get(workflow_id)
                if rkey is None:
                    task = asyncio.create_task(self._wake_workflow(workflow_id))
                    self._inflight.add(task)
                    task.add_done_callback(self._inflight.discard)
                elif self._owns_key(rkey):
                    self.scheduler.now(rkey)
            case CommandEvent(workflow_id=None, key=key, node_id=node_id):
                # a plug-in's command of no workflow (a host section's converge, a discovered
                # node's inventory): its owner's key of the node (EngineHooks.wake_prefixes)
                for prefix, owner in self.hooks.wake_prefixes.items():
                    if key.startswith(prefix):
                        await self.wake(queue.owner_key(owner, node_id))
                        break
            case _:
                return  # not a command of a workflow, or not an event

    async def _on_join(self, msg: Msg) -> None:
        """A node's agent joined: the key of the node's workflows (the node id) is looked at now,
        so a ``wait.agentJoined`` settles at once, not at its next look. (Metal's handler of the
        same events records discovery joins and quarantines a burned token's node.)"""
        match decode_join_event(msg.data):
            case JoinAccepted(agent_id=agent_id, role=role) if role != "discovery" and agent_id.startswith(
                "node_"
            ):
                await self.wake(agent_id)
            case JoinTokenConfirmed(node_id=str() as node_id):
                await self.wake(node_id)  # its held join is valid now: wait.agentJoined settles
            case _:
                return

    async def _wake_workflow(self, workflow_id: str) -> None:
        assert self.db is not None
        try:
            rkey = await self.db.pool.fetchval(store.WORKFLOW_RKEY, workflow_id)
        except Exception as exc:
            if not is_transient(exc):
                raise
            return  # the database is away: the command watch wakes the key later
        if rkey is None:
            return
        if len(self._rkeys) > 100_000:
            self._rkeys.clear()
        self._rkeys[workflow_id] = rkey
        if self._owns_key(rkey):
            self.scheduler.now(rkey)

    def _shards_gained(self, shards: set[int]) -> None:
        self._gained |= shards
        self._poll_soon.set()

    async def _poll_loop(self) -> None:
        assert self.db is not None
        while True:
            mine = [s for s in range(queue.SHARDS) if self.leases.owns(s) is not None]
            self._gained &= set(mine)  # taken and lost again: the owner now runs them
            gained = sorted(self._gained)
            if gained:
                # each key of a shard just taken runs once now (store.GAINED_KEYS says why):
                # a cost per change of owner, not per machine and second
                keys = await self.db.fetch(store.GAINED_KEYS, gained, POLL_EVERY)
                now = time.time()
                for r in keys:
                    self.scheduler.at(r["rkey"], now, from_poll=True)
                self._gained -= set(gained)  # not before the look succeeded
                if keys:
                    self.log.info("gained_keys_run", shards=len(gained), keys=len(keys))
            if mine:
                rows = await self.db.fetch(store.DUE_KEYS, mine, POLL_EVERY)
                for r in rows:
                    self.scheduler.at(r["rkey"], float(r["at"]), from_poll=True)
            self._poll_soon.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancellation that lands in
            # the turn the event is set (shards gained), and the engine then never stopped.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_EVERY):
                    await self._poll_soon.wait()

    async def _command_watch(self) -> None:
        """The safety net for lost command events: every AGENT_POLL_S, one look at the state of
        every command a step of ours waits on (in bulk), waking the keys whose command settled."""
        assert self.db is not None
        assert self.api is not None
        while True:
            await asyncio.sleep(AGENT_POLL_S)
            mine = [s for s in range(queue.SHARDS) if self.leases.owns(s) is not None]
            found = await waiting_commands(self.db, mine) if mine else {}
            # a shard lost since the look is not ours to wake any more
            waiting = {cid: rkey for cid, rkey in found.items() if self._owns_key(rkey)}
            ids = list(waiting)
            for start in range(0, len(ids), MAX_STATE_QUERY):
                chunk = ids[start : start + MAX_STATE_QUERY]
                try:
                    states = await self.engine.cmdq.states(ids=chunk)
                except BcError as err:
                    self.log.warning("command_watch_failed", code=err.code.value)
                    break
                for cid in chunk:
                    if states.get(cid) not in LIVE_STATES:  # settled, or unknown to the queue
                        self.scheduler.now(waiting[cid])

    async def _join_watch(self) -> None:
        """The safety net for lost join events (``wait.agentJoined``): every AGENT_POLL_S, while
        a step of ours waits for a join, one look at the certificates bc-pki issued since the
        oldest such step started (newest first, a page at a time), waking each waiting node with
        a valid one issued after its step started (its first look saw none). A confirmed held join
        is a certificate of that time too, so a lost confirmation is caught as well. Nothing
        waits: one query of our own, no request; the cost follows the rollout under way, never
        the machines at rest."""
        assert self.db is not None
        while True:
            await asyncio.sleep(AGENT_POLL_S)
            mine = [s for s in range(queue.SHARDS) if self.leases.owns(s) is not None]
            rows = await self.db.fetch(store.WAITING_ACTION, mine, WAIT_JOINED) if mine else []
            waiting = {r["node_id"]: (r["rkey"], r["started_at"] - JOIN_SKEW) for r in rows}
            waiting = {n: w for n, w in waiting.items() if self._owns_key(w[0])}
            if not waiting:
                continue
            try:
                joined = await self._joined_since(min(since for _, since in waiting.values()))
            except BcError as err:
                self.log.warning("join_watch_failed", code=err.code.value)
                continue
            for node_id, (rkey, since) in waiting.items():
                if joined.get(node_id, since) > since:
                    self.scheduler.now(rkey)

    async def _joined_since(self, since: datetime) -> dict[str, datetime]:
        """Agent id -> when its newest valid certificate issued at or after ``since`` was."""
        found: dict[str, datetime] = {}
        cursor: str | None = None
        while True:
            page = await self.engine.pki.certificates_page(limit=JOIN_PAGE, cursor=cursor)
            for c in page.certificates:
                if c.state == "valid" and c.created_at >= since:
                    found[c.agent_id] = max(c.created_at, found.get(c.agent_id, c.created_at))
            cursor = page.next
            if not cursor or not page.certificates or page.certificates[-1].created_at < since:
                return found

    async def on_stop(self) -> None:
        for sub in getattr(self, "_subs", []):
            await sub.unsubscribe()
        if hasattr(self, "scheduler"):
            await self.scheduler.close(grace=self.stop_grace)
        if hasattr(self, "leases"):
            await self.leases.release_all()


def with_user_data_settings(app: App, settings: UserDataSettings) -> App:
    """The app with ``[userdata]`` of bc.toml (or ``BC_USERDATA_*``) over its ``UserData(...)``."""
    given = {k: v for k, v in msgspec.structs.asdict(settings).items() if v is not None}
    if not given:
        return app
    if app.provision is None:
        raise BcError(
            ErrorCode.INVALID_CONFIG,
            "[userdata] is set but the app has no provision module to render user data",
            {"path": "userdata"},
        )
    try:
        merged = dataclasses.replace(app.provision.user_data or UserData(), **given)
    except BcError as err:
        raise err.with_path_prefix("userdata") from None
    return dataclasses.replace(app, provision=dataclasses.replace(app.provision, user_data=merged))
