"""Reports to bc-pki of a node's boot entry asked for again (``tokens.burn``).

The iPXE answer never waits for bc-pki: a report is a task that tries until bc-pki takes it
(a jittered backoff over transient faults, for as long as the served mark lasts), once per
token in a process life.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from better_compute.clients.pki import PkiClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import AgentIdentity
from better_compute.logging import get_logger

from .netboot import SERVED_WINDOW_S

__all__ = ["BurnReports"]

_TRANSIENT = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT})


class BurnReports:
    def __init__(self, pki: PkiClient, identity: AgentIdentity) -> None:
        self.pki = pki
        self.identity = identity
        self.log = get_logger(component="netboot-reports")
        self._reported: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def report(self, mark: dict[str, Any]) -> None:
        digest = str(mark.get("tokenSha256") or "")
        if not digest or digest in self._reported:
            return
        self._reported.add(digest)
        task = asyncio.get_running_loop().create_task(
            self._send(digest, str(mark.get("mac") or "")), name=f"burn-report-{digest[:8]}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, digest: str, mac: str) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + SERVED_WINDOW_S
        attempt = 0
        while True:
            try:
                burned = await self.pki.burn_join_token(
                    identity=self.identity, token_sha256=digest, mac=mac, reason="boot-entry-fetched-twice"
                )
            except BcError as err:
                if err.code not in _TRANSIENT or loop.time() > until:
                    self.log.warning("boot_entry_report_refused", mac=mac, code=err.code.value)
                    return
                await asyncio.sleep(random.uniform(0, min(5.0, 0.2 * 2**attempt)))
                attempt += 1
                continue
            self.log.warning(
                "boot_entry_reported", mac=mac, join_token_id=burned.join_token_id, node_id=burned.node_id,
                revoked_cert_ids=burned.revoked_cert_ids,
            )  # fmt: skip
            return

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
