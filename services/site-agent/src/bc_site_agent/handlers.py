"""The command handlers of the site agent: BMC commands through a driver, boot entries.

A BMC command carries ``bmc`` (driver, address, credentialsRef, …). The credential is fetched
for that one command through the secrets fetch gate (bc-secrets answers only while the command
is live and carries the reference), parsed, handed to the driver, and dropped when the call
returns: never logged (registered with the log redactor at once), never written anywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from better_compute.agent import Command, CommandHandler, CommandRejected
from better_compute.clients.secrets import SecretsClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import AgentIdentity
from better_compute.logging import get_logger, register_secret
from better_compute.metal.commands import COMMAND_KINDS

from . import metrics
from .cache import SiteCache
from .drivers import BmcCredentials, BmcTarget, Driver, make_driver
from .netboot import BootEntries, normalize_mac
from .relay import HttpRelay

__all__ = ["SiteHandlers"]

_WAIT_FOR = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT})
_POWERS_ON = frozenset({"on", "cycle", "reset"})
VALIDATE_SECONDS = 15.0
"""``management.validate`` tries a BMC that does not answer this long at most, then says so."""


class SiteHandlers:
    """Handlers by command kind, plus what ``/healthz`` reports about them."""

    def __init__(
        self,
        *,
        secrets: SecretsClient,
        identity: AgentIdentity,
        entries: BootEntries,
        cache: SiteCache,
        public_url: str,
        relay: HttpRelay,
    ) -> None:
        self.relay = relay
        self.secrets = secrets
        self.identity = identity
        self.entries = entries
        self.cache = cache
        self.public_url = public_url.rstrip("/")
        self.log = get_logger(component="handlers")
        self.last_error: str | None = None
        self.last_error_at_ms: int | None = None
        self.commands_run = 0

    def handlers(self) -> dict[str, CommandHandler]:
        ops = self._operations()
        return {**ops, "driver.invoke": self._driver_invoke, "site.httpProxy": self._http_proxy}

    def _operations(self) -> dict[str, CommandHandler]:
        """The driver operations, by ``<concern>.<operation>``: each a command kind of its own,
        and also what ``driver.invoke`` runs (a profile step's ``use`` on a site agent)."""
        return {
            "power.setPower": self._bmc(self._power),
            "management.setBootDevice": self._bmc(self._boot),
            "media.insert": self._bmc(self._insert),
            "media.eject": self._bmc(self._eject),
            "management.inventory": self._bmc(self._inventory),
            "management.validate": self._validate,
            "netboot.setEntry": self._set_entry,
            "netboot.clearEntry": self._clear_entry,
        }

    async def _driver_invoke(self, cmd: Command) -> Any:
        payload = cmd.payload if isinstance(cmd.payload, dict) else {}
        operation = str(payload.get("operation", ""))
        handler = self._operations().get(operation)
        if handler is None:
            raise CommandRejected(f"unsupported-operation: this site agent has no {operation or '?'}")
        kind = COMMAND_KINDS.get(operation)
        raw = payload.get("input") or {}
        try:
            value = kind.payload.validate(raw) if kind is not None else raw
        except BcError as err:
            raise err.with_path_prefix("input") from None
        return await handler(dataclasses.replace(cmd, kind=operation, payload=value))

    # -- credentials -------------------------------------------------------------------

    async def _fetch(self, ref: str, deadline: float, *, what: str, path: str) -> bytes:
        """The value behind ``ref`` through the secrets gate (sealed), while this command is live;
        UNAVAILABLE and TIMEOUT are tried again until the command's deadline."""
        delay = 0.2
        while True:
            try:
                return await self.secrets.fetch(ref=ref, identity=self.identity)
            except BcError as err:
                if err.code not in _WAIT_FOR or time.time() + delay >= deadline:
                    raise BcError(
                        err.code,
                        f"cannot fetch {what}: {err.message}",
                        {"path": path, "reason": err.reason or "secrets-fetch"},
                    ) from None
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, 3.0)

    async def _credentials(self, target: BmcTarget, deadline: float) -> BmcCredentials | None:
        if target.credentials_ref is None:
            return None
        raw = await self._fetch(
            target.credentials_ref, deadline, what="the BMC credentials", path="bmc.credentialsRef"
        )
        try:
            doc = msgspec.json.decode(raw)
            username, password = doc["username"], doc["password"]
            if not isinstance(username, str) or not isinstance(password, str):
                raise TypeError
        except (msgspec.DecodeError, KeyError, TypeError):
            raise BcError(
                ErrorCode.INVALID_INPUT,
                'the BMC credential is not JSON {"username": ..., "password": ...}',
                {"path": "bmc.credentialsRef"},
            ) from None
        finally:
            del raw
        register_secret(password)
        return BmcCredentials(username=username, password=password)

    def _bmc(
        self, op: Callable[[Driver, Command], Awaitable[dict[str, Any]]]
    ) -> Callable[[Command], Awaitable[dict[str, Any]]]:
        async def handle(cmd: Command) -> dict[str, Any]:
            self.commands_run += 1
            driver_name = "unknown"  # until the payload names a known one (bounded labels)
            began = time.monotonic()
            try:
                payload = cmd.payload if isinstance(cmd.payload, dict) else {}
                target = BmcTarget.from_payload(payload.get("bmc"))
                driver_name = target.driver
                credentials = await self._credentials(target, cmd.not_after)
                driver = make_driver(target, credentials)
                del credentials
                try:
                    result = await op(driver, cmd)
                finally:
                    await driver.close()
                    del driver
                metrics.BMC_CALL_SECONDS.labels(driver_name, cmd.kind, "ok").observe(time.monotonic() - began)
                return {"driver": target.driver, **result}
            except BcError as err:
                metrics.BMC_CALL_SECONDS.labels(driver_name, cmd.kind, "error").observe(
                    time.monotonic() - began
                )
                metrics.BMC_CALL_ERRORS.labels(driver_name, cmd.kind, err.code.value).inc()
                self.last_error = f"{cmd.kind}: {err.code.value}: {err.message}"[:300]
                self.last_error_at_ms = time.time_ns() // 1_000_000
                raise

        return handle

    # -- BMC operations ----------------------------------------------------------------

    async def _power(self, driver: Driver, cmd: Command) -> dict[str, Any]:
        action = str(cmd.payload["action"])
        result = await driver.set_power(action, deadline=cmd.not_after)
        if action in _POWERS_ON:
            # the machine asks for its boot entry after its POST, from now: a served entry's
            # quiet period counts from here (netboot.BootEntries.powered)
            self.entries.powered(cmd.node_id)
        return result

    async def _boot(self, driver: Driver, cmd: Command) -> dict[str, Any]:
        p = cmd.payload
        return await driver.set_boot_device(
            str(p["device"]),
            persistent=bool(p.get("persistent", False)),
            mode=p.get("mode"),
            deadline=cmd.not_after,
        )

    async def _cached(self, url: str, sha256: str | None, holder: str) -> str:
        """The site cache's URL for the object (filled from ``url`` once, held by ``holder``),
        or ``url`` itself without a digest."""
        if not sha256:
            self.cache.release(holder)
            return url
        await self.cache.ensure(sha256, url, holder=holder)
        return f"{self.public_url}/cache/{sha256}"

    async def _insert(self, driver: Driver, cmd: Command) -> dict[str, Any]:
        p = cmd.payload
        device = str(p.get("device", "cd"))
        url = await self._cached(str(p["url"]), p.get("sha256"), _media_holder(p, device))
        return await driver.media_insert(url, device=device, deadline=cmd.not_after)

    async def _eject(self, driver: Driver, cmd: Command) -> dict[str, Any]:
        device = str(cmd.payload.get("device", "cd"))
        got = await driver.media_eject(device=device, deadline=cmd.not_after)
        self.cache.release(_media_holder(cmd.payload, device))
        return got

    async def _inventory(self, driver: Driver, cmd: Command) -> dict[str, Any]:
        return await driver.inventory(deadline=cmd.not_after)

    async def _validate(self, cmd: Command) -> dict[str, Any]:
        """``management.validate``: the BMC answers, takes the credentials, has the system and
        says its power state; changes nothing. A check that fails is in the result (the command
        succeeds): ``{driver, ok, checks: [{check, status: ok|failed|skipped, message}]}``."""
        self.commands_run += 1
        payload = cmd.payload if isinstance(cmd.payload, dict) else {}
        target = BmcTarget.from_payload(payload.get("bmc"))
        deadline = min(cmd.not_after, time.time() + VALIDATE_SECONDS)
        try:
            credentials = await self._credentials(target, deadline)
            if credentials is None and target.driver == "ipmi":
                raise BcError(
                    ErrorCode.INVALID_INPUT, "the node's BMC has no credential (bmc.credentialsRef)", {}
                )
        except BcError as err:
            checks = [{"check": "credentials", "status": "failed", "message": err.message[:300]}]
            return {"driver": target.driver, "ok": False, "checks": checks}
        driver = make_driver(target, credentials)
        del credentials
        try:
            checks = await driver.validate(deadline=deadline)
        finally:
            await driver.close()
            del driver
        ok = all(c["status"] == "ok" for c in checks)
        if not ok:
            failed = next(c for c in checks if c["status"] == "failed")
            self.last_error = f"{cmd.kind}: {failed['check']}: {failed['message']}"[:300]
            self.last_error_at_ms = time.time_ns() // 1_000_000
        return {"driver": target.driver, "ok": ok, "checks": checks}

    # -- boot entries ------------------------------------------------------------------

    async def _set_entry(self, cmd: Command) -> dict[str, Any]:
        payload = dict(cmd.payload)
        mac = normalize_mac(str(payload.get("mac", "")))
        self.cache.release(f"netboot:{mac}:", prefix=True)
        for key in ("kernel", "initrd"):
            if payload.get(key):
                holder = f"netboot:{mac}:{key}"
                payload[key] = await self._cached(str(payload[key]), payload.get(f"{key}Sha256"), holder)
        token = None
        if payload.get("joinTokenRef"):
            # Resolved now, while this command is live: the gate opens to no one later.
            raw = await self._fetch(
                str(payload["joinTokenRef"]), cmd.not_after, what="the join token", path="joinTokenRef"
            )
            token = raw.decode("utf-8", "replace").strip()
            register_secret(token)
            if not token or any(c.isspace() for c in token):
                raise BcError(
                    ErrorCode.INVALID_INPUT, "the join token is not one word", {"path": "joinTokenRef"}
                )
        entry = self.entries.set(payload, command_id=cmd.id, join_token=token, node_id=cmd.node_id or "")
        return {"mac": entry.mac, "oneTime": entry.one_time, "kernel": entry.kernel, "initrd": entry.initrd}

    async def _clear_entry(self, cmd: Command) -> dict[str, Any]:
        mac = normalize_mac(str(cmd.payload.get("mac", "")))
        removed = self.entries.clear(mac)
        self.cache.release(f"netboot:{mac}:", prefix=True)
        return {"removed": removed}

    # -- relayed HTTP ------------------------------------------------------------------

    async def _http_proxy(self, cmd: Command) -> dict[str, Any]:
        return await self.relay.request(dict(cmd.payload), deadline=cmd.not_after)


def _media_holder(payload: Any, device: str) -> str:
    bmc = payload.get("bmc") if isinstance(payload, dict) else None
    bmc = bmc if isinstance(bmc, dict) else {}
    return f"media:{bmc.get('address', '')}:{bmc.get('systemId') or ''}:{device}"
