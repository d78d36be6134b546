"""The agent's reports to bc-pki about the node entries it served: ``tokens.burn`` (a served
entry asked for again from elsewhere) and ``tokens.confirm`` (its entry closed clean).

The iPXE answer never waits for bc-pki. A report is written to ``state_dir/netboot/reports/``
(0600) before anything is sent, and stays there until bc-pki has taken it: the sweep sends
each one again (signed anew each time) after a transient fault, across restarts of the agent,
until bc-pki answers. Both routes are idempotent at bc-pki, so a report whose answer was lost
is merely sent twice. A refusal that retrying cannot change (the token is unknown, or already
burned when a confirm arrives) drops the report, with a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any, Final

from better_compute.clients.pki import PkiClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import AgentIdentity
from better_compute.files import atomic_write
from better_compute.logging import get_logger

from .netboot import Hold

__all__ = ["SWEEP_SECONDS", "Reports"]

_TRANSIENT = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.INTERNAL})
SWEEP_SECONDS: Final = 5.0
"""How often unsent reports are tried again (a new one is sent at once)."""
MAX_AGE_SECONDS: Final = 24 * 3600.0
"""A report bc-pki never took in a day is dropped (the token it names has expired by then)."""


class Reports:
    def __init__(
        self, pki: PkiClient, identity: AgentIdentity, folder: Path, *, sweep_seconds: float = SWEEP_SECONDS
    ) -> None:
        self.pki = pki
        self.identity = identity
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.sweep_seconds = sweep_seconds
        self.log = get_logger(component="netboot-reports")
        self._wake = asyncio.Event()

    def burn(self, mark: dict[str, Any]) -> None:
        """Report the served mark of a MAC asked for again (``tokens.burn``)."""
        digest = str(mark.get("tokenSha256") or "")
        self._put("burn", digest, str(mark.get("mac") or ""), str(mark.get("reason") or ""))

    def confirm(self, hold: Hold) -> None:
        """Report a node entry closed clean (``tokens.confirm``)."""
        self._put("confirm", hold.token_sha256, hold.mac)

    def _put(self, kind: str, digest: str, mac: str, reason: str = "") -> None:
        if len(digest) != 64:
            return
        target = self.folder / f"{kind}-{digest}.json"
        if not target.exists():
            doc = {"kind": kind, "tokenSha256": digest, "mac": mac, "at": time.time()}
            atomic_write(target, json.dumps({**doc, "reason": reason} if reason else doc))
        self._wake.set()

    def unsent(self) -> list[Path]:
        # burns first: a confirm after a burn of the same token is refused anyway
        return sorted(self.folder.glob("burn-*.json")) + sorted(self.folder.glob("confirm-*.json"))

    async def run(self) -> None:
        """Send what is unsent, now and after each new report or ``sweep_seconds``."""
        while True:
            self._wake.clear()
            for path in self.unsent():
                await self._send(path)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.sweep_seconds):
                    await self._wake.wait()

    async def _send(self, path: Path) -> None:
        doc = _load(path)
        if doc is None:
            _drop(path)
            return
        kind, digest, mac = doc["kind"], doc["tokenSha256"], doc["mac"]
        try:
            if kind == "burn":
                burned = await self.pki.burn_join_token(
                    identity=self.identity, token_sha256=digest, mac=mac,
                    reason="boot-medium-fetched-twice" if doc.get("reason") == "boot-medium-fetched-twice"
                    else "boot-entry-fetched-twice",
                )  # fmt: skip
                self.log.warning(
                    "boot_entry_reported", mac=mac, join_token_id=burned.join_token_id,
                    node_id=burned.node_id, revoked_cert_ids=burned.revoked_cert_ids,
                )  # fmt: skip
            else:
                confirmed = await self.pki.confirm_join_token(
                    identity=self.identity, token_sha256=digest, mac=mac
                )
                self.log.info(
                    "boot_entry_confirmed", mac=mac, join_token_id=confirmed.join_token_id,
                    node_id=confirmed.node_id, cert_ids=confirmed.cert_ids,
                )  # fmt: skip
        except BcError as err:
            if err.code in _TRANSIENT and time.time() - float(doc.get("at", 0)) < MAX_AGE_SECONDS:
                self.log.info("boot_entry_report_deferred", kind=kind, mac=mac, code=err.code.value)
                return
            self.log.warning(
                "boot_entry_report_refused", kind=kind, mac=mac, code=err.code.value, reason=err.reason
            )
        _drop(path)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not all(
        isinstance(doc.get(k), str) for k in ("kind", "tokenSha256", "mac")
    ):
        return None
    return doc


def _drop(path: Path) -> None:
    path.unlink(missing_ok=True)
