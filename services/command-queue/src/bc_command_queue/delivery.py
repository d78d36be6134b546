"""Delivery: a JetStream stream per site, a durable pull consumer per agent.

Streams are created on demand (an idempotent ``add_stream``), with work-queue retention: a
message leaves the stream once its agent acknowledged it. Every publication carries
``Nats-Msg-Id: <command>:<agent>:<n>``, where ``n`` counts the publications recorded in
PostgreSQL: publishing again what may not have reached the stream (same ``n``) adds nothing
if it did, while a deliberate new delivery (``n + 1``) is not swallowed by the stream's
duplicate window even when the first one was consumed.

Where the streams live is ``cmdq.site_domain``: by default in the services' own JetStream (the
hub's); with a domain template, each site's command stream and results stream live on the
site's leaf node, in its JetStream domain, managed through ``$JS.<domain>.API`` across the leaf
link (``SiteResults`` reads the results). Deliveries are published on the command subject as
ever: the leaf's stream takes them (its interest crosses the link), and while the link is down
nothing takes them, so they wait in PostgreSQL and the sweeper publishes them after.

``Deliveries`` publishes commands only after their change committed, never while a row is
locked: a publication that fails (or an instance that dies before it) leaves the command
dispatched without ``published_at``, and the sweeper publishes it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as Nats
from nats.js import api

from better_compute.core.errors import BcError, ErrorCode
from better_compute.service.groups import GroupCommit
from better_compute.service.killpoints import declare, kill_point
from better_compute.wire import Subjects
from better_compute.wire.agent import CommandDelivery
from better_compute.wire.codec import encode

from .rows import CommandRow
from .storage import Published, Store, row_may_be_at_fault

__all__ = ["INACTIVE_SECONDS", "MAX_CONSUMERS", "Changed", "Deliveries", "Streams", "consumer_name"]

Changed = Callable[[Sequence[CommandRow]], Awaitable[None]]
"""Publishes the event of each changed command row (the engine wakes on it)."""

BEFORE_PUBLISH = declare(
    "command-queue.before-publish", "command-queue", "a command is dispatched in PostgreSQL, not published"
)
AFTER_PUBLISH = declare(
    "command-queue.after-publish", "command-queue", "a delivery is on the site's stream, not recorded"
)

_DUPLICATE_WINDOW_S: Final = 120.0
_CONSUMER_KNOWN_S: Final = 30.0
"""An agent's consumer made or found this recently is not asked for again at its next hello (a
retried hello, or the other agents of a storm): nats-server takes a consumer's creation through
its JetStream API queue, seconds each with a thousand consumers on a stream, and a storm of them
overflows that queue, which then drops every request in it (the 10,000-machine deploy,
bench/README.md "Agent events shed"). Half the inactivity threshold when that is shorter (a
consumer nats-server deleted for it is never taken as there); one deleted by hand within it is
made again at a hello after it."""
_CREATIONS_IN_FLIGHT: Final = 32
"""Consumer creations one queue instance has at nats-server at once; the other agents' hellos
wait in memory for their turn. nats-server's JetStream API queue drops every request in it past
10,000 pending (its consumer probes and claims among them), and the single flight per agent bounds
creations only by the agents that say hello at once (10,000 after a site's outage)."""
_STREAM_IN_USE: Final = 10058  # "stream name already in use with a different configuration"
MAX_CONSUMERS: Final = 100_000
"""Consumers a site's stream holds by default (``cmdq.stream_max_consumers``): one per agent of
the site (each machine's bcd, its site agents). Given explicitly: nats-server 2.15 gives a stream
that sets none (or -1) a default of 1000, so the 1001st agent of a site got no consumer and never
received a command."""
INACTIVE_SECONDS: Final = 86_400.0
"""By default nats-server deletes an agent's consumer nobody pulled from for a day
(``cmdq.consumer_inactive``): a retired node's, a replaced identity's. An agent pulls without
pause while it runs (an idle one holds a 20 s pull open), so only an agent that is gone, or off
for that long, loses its consumer. Nothing of it is lost: the stream (work-queue retention) keeps
a message until a consumer acknowledges it, and the agent's next hello makes the consumer again,
which delivers from the first message still on the agent's subject."""


def consumer_name(agent_id: str) -> str:
    """The durable consumer of an agent (agent ids are already valid consumer names)."""
    return agent_id


class Streams:
    """Creates streams and consumers and publishes deliveries."""

    def __init__(
        self,
        nc: Nats,
        subjects: Subjects,
        *,
        replicas: int = 1,
        max_age_seconds: int = 7 * 24 * 3600,
        ack_wait_seconds: float = 30.0,
        max_consumers: int = MAX_CONSUMERS,
        inactive_seconds: float = INACTIVE_SECONDS,
        site_domain: str = "",
        on_site: Callable[[str], None] | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=5.0)
        self.subjects = subjects
        self.replicas = replicas
        self.max_age = float(max_age_seconds)
        self.ack_wait = ack_wait_seconds
        self.max_consumers = max_consumers
        self.inactive = inactive_seconds or None
        """Seconds of no pull after which the server deletes an agent's consumer; None: never."""
        self.site_domain = site_domain
        self.on_site = on_site
        """Called with a site whose streams were just ensured on its leaf (``site_domain``)."""
        self._known: set[str] = set()
        self._js_of: dict[str, Any] = {}
        self._consumers: dict[tuple[str, str], float] = {}  # (site, agent) -> when made or found
        self._making: dict[tuple[str, str], asyncio.Future[tuple[str, str]]] = {}
        self._creating = asyncio.Semaphore(_CREATIONS_IN_FLIGHT)
        self._prune_at = 1024
        self._seen_reconnects = self._reconnects()

    @property
    def on_leaves(self) -> bool:
        """Whether each site's streams live on its leaf node (``cmdq.site_domain`` set)."""
        return bool(self.site_domain)

    def domain_of(self, site_id: str) -> str | None:
        """The JetStream domain holding the site's streams; None: the services' own."""
        return self.site_domain.replace("{site}", site_id) if self.site_domain else None

    def js_of(self, site_id: str) -> Any:
        """The JetStream context of the site's streams (``$JS.<domain>.API`` on a leaf)."""
        domain = self.domain_of(site_id)
        if domain is None:
            return self.js
        js = self._js_of.get(domain)
        if js is None:
            js = self._js_of[domain] = self.nc.jetstream(domain=domain, timeout=5.0)
        return js

    async def ensure_stream(self, site_id: str) -> str:
        name = self.subjects.site_stream(site_id)
        if name in self._known:
            return name
        await self._add_stream(site_id, name, self.subjects.site_cmd_all(site_id))
        if self.on_leaves:
            await self._add_stream(
                site_id, self.subjects.site_results_stream(site_id), self.subjects.site_results_all(site_id)
            )
        self._known.add(name)
        if self.on_leaves and self.on_site is not None:
            self.on_site(site_id)
        return name

    async def _add_stream(self, site_id: str, name: str, subject: str) -> None:
        config = api.StreamConfig(
            name=name,
            subjects=[subject],
            retention=api.RetentionPolicy.WORK_QUEUE,
            storage=api.StorageType.FILE,
            # a leaf node is one server: its streams have one replica
            num_replicas=1 if self.on_leaves else self.replicas,
            max_age=self.max_age,
            duplicate_window=_DUPLICATE_WINDOW_S,
            discard=api.DiscardPolicy.OLD,
            max_consumers=self.max_consumers,
        )
        js = self.js_of(site_id)
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            # Another instance made it first, maybe with settings of an older version: use it.
            if exc.err_code != _STREAM_IN_USE:
                raise _unavailable("cannot create the site's stream", exc) from exc
            await self._raise_consumer_limit(js, name)
        except (nats.errors.Error, TimeoutError) as exc:
            raise _unavailable("cannot create the site's stream", exc) from exc

    async def _raise_consumer_limit(self, js: Any, name: str) -> None:
        """An existing stream (an older version made it without a consumer limit, which
        nats-server 2.15 reads as 1000) takes ``max_consumers`` agents. Its other settings stay
        as they are; a server that refuses the change keeps the stream as it is."""
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            info = await js.stream_info(name)
            if info.config.max_consumers is None or info.config.max_consumers < self.max_consumers:
                await js.update_stream(replace(info.config, max_consumers=self.max_consumers))

    def forget(self, site_id: str) -> None:
        """Check the site's stream again before the next publication (it may be gone), and its
        agents' consumers at their next hello."""
        self._known.discard(self.subjects.site_stream(site_id))
        self._consumers = {k: t for k, t in self._consumers.items() if k[0] != site_id}

    async def ensure_consumer(self, site_id: str, agent_id: str) -> tuple[str, str]:
        """The site's stream and the agent's durable consumer on it, created when missing. One
        creation at a time for an agent (a hello retried meanwhile waits for it), none for one
        made in the last ``_CONSUMER_KNOWN_S``, and at most ``_CREATIONS_IN_FLIGHT`` at once."""
        key = (site_id, agent_id)
        reconnects = self._reconnects()
        if reconnects != self._seen_reconnects:  # a server come back may have lost them
            self._seen_reconnects = reconnects
            self._consumers.clear()
        made = self._consumers.get(key)
        if made is not None and time.monotonic() - made < self._known_for():
            return self.subjects.site_stream(site_id), consumer_name(agent_id)
        making = self._making.get(key)
        if making is not None:
            return await asyncio.shield(making)
        fut: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
        self._making[key] = fut
        try:
            async with self._creating:
                names = await self._ensure_consumer(site_id, agent_id)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved, even when nobody else waited
            raise
        else:
            fut.set_result(names)
            self._remember(key)
            return names
        finally:
            del self._making[key]

    def _reconnects(self) -> int:
        stats = getattr(self.nc, "stats", None)
        return int(stats.get("reconnects", 0)) if isinstance(stats, dict) else 0

    def _known_for(self) -> float:
        """How long a consumer made is taken as there: less than the inactivity after which
        nats-server deletes it (counted from its last pull, which is after it was made)."""
        if self.inactive is None:
            return _CONSUMER_KNOWN_S
        return min(_CONSUMER_KNOWN_S, self.inactive / 2)

    def _remember(self, key: tuple[str, str]) -> None:
        now = time.monotonic()
        self._consumers[key] = now
        if len(self._consumers) > self._prune_at:  # what is old goes, in time linear overall
            known_for = self._known_for()
            self._consumers = {k: t for k, t in self._consumers.items() if now - t < known_for}
            self._prune_at = 2 * len(self._consumers) + 1024

    async def _ensure_consumer(self, site_id: str, agent_id: str) -> tuple[str, str]:
        stream = await self.ensure_stream(site_id)
        durable = consumer_name(agent_id)
        config = api.ConsumerConfig(
            durable_name=durable,
            filter_subject=self.subjects.site_cmd(site_id, agent_id),
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_wait=self.ack_wait,
            max_deliver=-1,
            max_ack_pending=1024,
            # a consumer made before this was set (or with another value) takes it at this hello
            inactive_threshold=self.inactive,
        )
        js = self.js_of(site_id)
        try:
            await js.add_consumer(stream, config)
        except nats.js.errors.NotFoundError:
            self.forget(site_id)
            stream = await self.ensure_stream(site_id)
            await self._add_consumer(js, stream, config)
        except nats.js.errors.BadRequestError as exc:
            # It exists with other settings (an older version made it): keep using it. Any
            # other refusal (the stream's consumer limit reached) leaves the agent without one:
            # its hello fails and is tried again, rather than binding to nothing and waiting
            # forever for commands that go to no consumer.
            try:
                await js.consumer_info(stream, durable)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as info_exc:
                raise BcError(
                    ErrorCode.UNAVAILABLE,
                    f"cannot create the agent's consumer: {exc.description or type(exc).__name__}",
                ) from info_exc
        except (nats.errors.Error, TimeoutError) as exc:
            raise _unavailable("cannot create the agent's consumer", exc) from exc
        return stream, durable

    async def _add_consumer(self, js: Any, stream: str, config: api.ConsumerConfig) -> None:
        try:
            await js.add_consumer(stream, config)
        except (nats.errors.Error, TimeoutError) as exc:
            raise _unavailable("cannot create the agent's consumer", exc) from exc

    async def publish(
        self, *, site_id: str, agent_id: str, command_id: str, body: bytes, generation: int
    ) -> tuple[int, bool]:
        """Publish a delivery; returns its stream sequence and whether the stream already held
        this very publication (its duplicate window remembered the message id).

        Raises:
            BcError: ``UNAVAILABLE`` when the stream does not take it (it is published again
                later: the command stays ``dispatched`` without ``published_at``).
        """
        stream = await self.ensure_stream(site_id)
        subject = self.subjects.site_cmd(site_id, agent_id)
        headers = {"Nats-Msg-Id": f"{command_id}:{agent_id}:{generation}"}
        try:
            ack: Any = await self.js.publish(subject, body, timeout=3.0, stream=stream, headers=headers)
        except nats.js.errors.NoStreamResponseError:
            # The stream is gone (deleted, or the server lost it): make it again, once.
            self.forget(site_id)
            stream = await self.ensure_stream(site_id)
            try:
                ack = await self.js.publish(subject, body, timeout=3.0, stream=stream, headers=headers)
            except (nats.errors.Error, TimeoutError) as exc:
                raise _unavailable("the site's stream did not take the command", exc) from exc
        except (nats.errors.Error, TimeoutError) as exc:
            self.forget(site_id)
            raise _unavailable("the site's stream did not take the command", exc) from exc
        return int(ack.seq), bool(ack.duplicate)


class Deliveries:
    """Publishes dispatched commands on their sites' streams and records each publication."""

    def __init__(self, store: Store, streams: Streams, log: Any) -> None:
        self.store = store
        self.streams = streams
        self.log = log
        self.marks: GroupCommit[Published, None] = GroupCommit(
            self._mark_many, key=lambda m: m.command_id, row_by_row=row_may_be_at_fault
        )
        """Publications recorded at the same moment go in one statement (``PUBLISHED_MANY``)."""

    async def _mark_many(self, marks: Sequence[Published]) -> list[None]:
        await self.store.mark_published_many(marks)
        return [None] * len(marks)

    async def publish(self, row: CommandRow, *, again: bool = False) -> bool:
        """Publish a delivery. ``again``: the same publication as the last recorded one (a
        no-op while the stream's duplicate window remembers it); otherwise a new one."""
        generation = max(row.publishes - 1, 0) if again else row.publishes
        assert row.agent_id is not None  # dispatched: it has its agent
        kill_point(BEFORE_PUBLISH)
        try:
            seq, duplicate = await self.streams.publish(
                site_id=row.site_id,
                agent_id=row.agent_id,
                command_id=row.id,
                body=delivery_body(row),
                generation=generation,
            )
        except BcError as err:
            self.log.warning("delivery_deferred", command_id=row.id, error=err.message)
            return False
        kill_point(AFTER_PUBLISH)
        if again and duplicate:
            # The stream holds it already: recorded, it would count as a new publication and
            # the next one ``again`` would be a new copy (an agent saying hello every second
            # piled one up a second on its subject).
            return True
        await self.marks(Published(command_id=row.id, agent_id=row.agent_id, stream_seq=seq))
        return True

    async def deliver(self, rows: Sequence[CommandRow], *, again: bool = False) -> bool:
        """Publish each row in turn; False when a stream is in trouble (the sweeper publishes
        the rest later). With the streams on the sites' leaves, a site whose stream does not
        take a delivery (its link is down) is skipped and the other sites' rows still go."""
        failed: set[str] = set()
        for row in rows:
            if row.site_id in failed:
                continue
            if not await self.publish(row, again=again):
                if not self.streams.on_leaves:
                    return False
                failed.add(row.site_id)
        return not failed


def delivery_body(row: CommandRow) -> bytes:
    """A ``commands`` row as the delivery its agent receives."""
    assert row.agent_id is not None  # dispatched: it has its agent
    return encode(
        CommandDelivery(
            id=row.id,
            kind=row.kind,
            payload=msgspec.Raw(row.payload.encode()),
            node_id=row.node_id,
            site_id=row.site_id,
            agent_id=row.agent_id,
            key=row.key,
            destructive=row.destructive,
            not_after_ms=int(row.not_after * 1000),
            batch_id=row.batch_id,
            workflow_id=row.workflow_id,
            step=row.step,
        )
    )


def _unavailable(message: str, exc: BaseException) -> BcError:
    return BcError(ErrorCode.UNAVAILABLE, f"{message}: {type(exc).__name__}")
