"""Results stored on the sites' leaf nodes (``cmdq.site_domain`` set).

With the site streams on the leaves, an agent stores each result in its site's results stream
(``<ROOT>_SITE_<SITE>_RESULTS``, subject ``bc.site.<site>.results.<agent>``) instead of asking
the command queue: the leaf's JetStream takes it whether the link to the hub is up or not. Here
the command queue reads each site's stream through the site's JetStream domain with one durable
pull consumer (``command-queue``, shared by every instance: each message goes to one of them)
and applies each result as if the agent had sent it: the same signature check (signed by that
agent of that site; recent within the stream's age rather than two minutes, since a result
waits there as long as a cut lasts) and the same compare-and-set (``Runs.result``), so a result
read twice changes nothing. A message is acknowledged once applied or refused for good, and
handed back (nak, redelivered a moment later) when the store or bc-pki cannot answer now.

While a site's link is down its reader backs off (with jitter) and tries again; the other
sites' readers go on. A reader starts for each site whose streams the queue ensures (at an
agent's hello, at a delivery) and, at start, for every site of a known agent.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Final

import asyncpg
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from better_compute.backoff import Backoff
from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire import Subjects
from better_compute.wire.agent import Result, open_event, read_event

from .delivery import Streams
from .runs import Runs
from .signers import Signers
from .storage import Store

__all__ = ["CONSUMER", "SiteResults"]

CONSUMER: Final = "command-queue"
"""The durable consumer every instance of the queue reads a site's results stream with."""

_BATCH: Final = 64
_FETCH_S: Final = 1.0
_RETRY_DELAY_S: Final = 1.0
_SCAN_PAGE: Final = 500
_READ_BACKOFF_CAP_S: Final = 5.0
_TRANSIENT: Final = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)


class SiteResults:
    """Reads every site's results stream on its leaf and applies what it holds."""

    def __init__(
        self,
        *,
        store: Store,
        streams: Streams,
        subjects: Subjects,
        signers: Signers,
        runs: Runs,
        silent_after_ms: int,
        log: Any,
    ) -> None:
        self.store = store
        self.streams = streams
        self.subjects = subjects
        self.signers = signers
        self.runs = runs
        self.silent_after_ms = silent_after_ms
        self.freshness_ms = int(streams.max_age * 1000)
        self.log = log
        self._sites: asyncio.Queue[str] = asyncio.Queue()
        self._reading: set[str] = set()
        self.applied = 0
        """Results this instance read from the leaves and recorded (for tests and metrics)."""

    def watch(self, site_id: str) -> None:
        """Read this site's results stream from now on (once per site; safe to call often)."""
        if site_id not in self._reading:
            self._sites.put_nowait(site_id)

    async def run(self) -> None:
        """The side loop: a reader per site, for every site of a known agent and every site
        ``watch`` names later."""
        self._reading.clear()
        known = await self._known_sites()
        async with asyncio.TaskGroup() as tg:
            for site_id in known:
                self._start(tg, site_id)
            while True:
                site_id = await self._sites.get()
                if site_id not in self._reading:
                    self._start(tg, site_id)

    def _start(self, tg: asyncio.TaskGroup, site_id: str) -> None:
        self._reading.add(site_id)
        tg.create_task(self._read(site_id), name=f"site-results-{site_id}")

    async def _known_sites(self) -> set[str]:
        """The sites of every known agent; a store that cannot answer is waited out."""
        backoff = Backoff(first=0.5, cap=10.0)
        while True:
            try:
                return await self._scan_sites()
            except _TRANSIENT as exc:
                self.log.warning("site_results_scan_failed", error=type(exc).__name__)
            await asyncio.sleep(backoff.next())

    async def _scan_sites(self) -> set[str]:
        sites: set[str] = set()
        after: tuple[str, str] | None = None
        while True:
            rows = await self.store.list_agents(
                site_id=None, role=None, connected=None, silent_after_ms=self.silent_after_ms,
                limit=_SCAN_PAGE, after=after,
            )  # fmt: skip
            sites.update(r.site_id for r in rows)
            if len(rows) < _SCAN_PAGE:
                return sites
            after = (rows[-1].site_id, rows[-1].id)

    async def _read(self, site_id: str) -> None:
        # a try of an unreachable leaf is answered at once (no responders): cheap to repeat
        backoff = Backoff(first=0.2, cap=_READ_BACKOFF_CAP_S)
        psub: Any = None
        down = False
        while True:
            try:
                if psub is None:
                    psub = await self._subscribe(site_id)
                msgs = await psub.fetch(batch=_BATCH, timeout=_FETCH_S)
            except (TimeoutError, nats.errors.TimeoutError):
                continue  # nothing stored (a fetch's timeout also ends here)
            except Exception as exc:
                # the site's leaf is out of reach (its link is down), or its stream is gone;
                # anything else is logged in full, and the reader goes on after a pause
                if not isinstance(exc, nats.errors.Error | nats.js.errors.Error | BcError):
                    self.log.exception("site_results_read_failed", site_id=site_id)
                elif not down:
                    self.log.info("site_results_unreachable", site_id=site_id, error=type(exc).__name__)
                down = True
                if isinstance(exc, nats.js.errors.NotFoundError):
                    self.streams.forget(site_id)
                if psub is not None:
                    with contextlib.suppress(Exception):
                        await psub.unsubscribe()
                    psub = None
                await asyncio.sleep(backoff.next())
                continue
            if down:
                self.log.info("site_results_reachable", site_id=site_id)
                down = False
            backoff.reset()
            for msg in msgs:
                await self._apply(site_id, msg)

    async def _subscribe(self, site_id: str) -> Any:
        await self.streams.ensure_stream(site_id)
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.EXPLICIT,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_wait=30.0,
            max_deliver=-1,
            max_ack_pending=1024,
        )
        return await self.streams.js_of(site_id).pull_subscribe(
            self.subjects.site_results_all(site_id),
            durable=CONSUMER,
            stream=self.subjects.site_results_stream(site_id),
            config=config,
        )

    async def _apply(self, site_id: str, msg: Msg) -> None:
        """One stored result: applied and acknowledged, refused and acknowledged, or handed
        back for later when what it needs cannot answer now."""
        agent = msg.subject.rsplit(".", 1)[-1]
        try:
            doc, signature = open_event(msg.data)
            signer = await self.signers.check_event(
                site=site_id, agent=agent, kind="result", doc=doc, signature=signature,
                freshness_ms=self.freshness_ms,
            )  # fmt: skip
            event = read_event("result", doc)
            if not isinstance(event, Result):
                raise BcError(ErrorCode.INVALID_INPUT, "not a result", {"path": "event"})
            reply = await self.runs.result(event, signer)
        except BcError as err:
            if err.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT):
                await _nak(msg)
                return
            self.log.info(
                "stored_result_refused",
                site_id=site_id,
                agent_id=agent,
                code=err.code.value,
                reason=err.reason,
            )
            await _ack(msg)
            return
        except _TRANSIENT as exc:
            self.log.warning("stored_result_failed", site_id=site_id, error=type(exc).__name__)
            await _nak(msg)
            return
        except Exception:
            # a message nobody can read: logged once, never retried for ever
            self.log.exception("stored_result_failed", site_id=site_id, agent_id=agent)
            await _ack(msg)
            return
        if reply.recorded:
            self.applied += 1
        await _ack(msg)


async def _ack(msg: Msg) -> None:
    with contextlib.suppress(Exception):
        await msg.ack()


async def _nak(msg: Msg) -> None:
    with contextlib.suppress(Exception):
        await msg.nak(delay=_RETRY_DELAY_S)
