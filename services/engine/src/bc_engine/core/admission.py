"""Per-site admission: how many of a site's workflows run their steps at once.

A bulk verb over 10,000 machines on 10 sites started 10,000 workflows at once, and each step's
deadline ran while its commands queued behind the site's other 999 machines at the site agent
(3 to 6 commands a second there): 5,088 inspections failed ``TIMEOUT`` (bench/README.md). A
command's ``not_after`` is signed and checked at the agent, so a command may not simply wait
longer; the workflow must not start its step before the site can serve it.

So a workflow on a node is *admitted* before it runs a step: at its start when its site has room
(``[engine] site_admission`` running admitted workflows, and none waiting before it), else by an
admission pass, oldest first per site, when the site's running workflows end. A waiting workflow
is ``running`` with no step started: no deadline runs, nothing is sent, and its pass (if woken)
costs one read. ``workflows.why`` says where it stands in its site's line.

Every engine runs the pass every ``ADMIT_EVERY`` seconds, and when one of its workflows ended (at
most every ``ADMIT_GAP``), under a transaction-level advisory lock, so two engines never admit for
the same room at once: ``store.ADMIT_PICK`` chooses, ``store.ADMIT_MARK`` admits by id and puts
the keys in the work queue in the same statement (a lost wake-up costs at most the work queue's
poll); then the keys are woken. A 10 s statement timeout: no plan holds the lock for long.
Workflows started by a step (``ctx.workflows.start``) and an operator's single power or
boot-device action are admitted at once: the first because its parent holds the room already
and may wait for it, the second because it must never wait behind a rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from .. import store

__all__ = ["ADMIT_EVERY", "Admission"]

ADMIT_EVERY = 2.0  # seconds between an engine's admission passes (a workflow's end brings one sooner)
ADMIT_GAP = 0.5  # ... but never sooner than this after the last: ends come by the hundred a minute


class Admission:
    """One engine's admission passes (a side loop of the service)."""

    def __init__(
        self,
        db: Any,
        *,
        limit: Callable[[], int],
        wake: Callable[[str], Awaitable[None]],
        log: Any,
    ) -> None:
        self.db = db
        self.limit = limit
        self.wake = wake
        self.log = log
        self._soon = asyncio.Event()

    def poke(self) -> None:
        """A workflow ended: its site may have room now."""
        self._soon.set()

    async def run(self) -> None:
        while True:
            self._soon.clear()
            await self.admit()
            await asyncio.sleep(ADMIT_GAP)
            with contextlib.suppress(TimeoutError):
                # jittered, so the engines' passes do not all fall at once
                async with asyncio.timeout(ADMIT_EVERY * random.uniform(0.75, 1.25)):
                    await self._soon.wait()

    async def admit(self) -> list[tuple[str, str]]:
        """One pass; the (key, site) of each workflow it admitted. Nothing when another engine's
        pass holds the lock (its own result covers this moment) or no limit is in force."""
        setting = self.limit()
        # no limit (any longer): whatever waits from an earlier limit is admitted at once
        limit = setting if setting > 0 else 2**31 - 1
        async with self.db.transaction() as conn:
            if not await conn.fetchval(store.ADMIT_LOCK):
                return []
            await conn.execute(store.ADMIT_TIMEOUT)
            ids = [r["id"] for r in await conn.fetch(store.ADMIT_PICK, limit)]
            if not ids:
                return []
            rows = await conn.fetch(store.ADMIT_MARK, ids)
        picked = [(str(r["rkey"]), str(r["site_id"])) for r in rows]
        if picked:
            per_site = Counter(site for _, site in picked)
            self.log.info("workflows_admitted", count=len(picked), sites=dict(per_site), limit=setting)
            for rkey, _site in picked:
                await self.wake(rkey)
        return picked
