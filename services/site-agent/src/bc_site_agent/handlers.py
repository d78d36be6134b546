"""The command handlers of the site agent: BMC commands through a driver, boot entries.

A BMC command carries ``bmc`` (driver, address, credentialsRef, …). The credential is fetched
through the secrets fetch gate (bc-secrets answers only while a command of the site is live and
carries the reference), parsed, handed to the driver, and kept in memory for the node's next
commands for ``bmc.credentials_keep_seconds`` at most (0: fetched for each command): never
logged (registered with the log redactor at once), never written anywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from better_compute.agent import Command, CommandHandler, CommandRejected
from better_compute.backoff import Backoff
from better_compute.clients.secrets import SecretsClient
from better_compute.core.errors import BcError, ErrorCode
from better_compute.crypto import AgentIdentity
from better_compute.logging import get_logger, register_secret
from better_compute.metal.commands import COMMAND_KINDS
from better_compute.service.recent import Recent
from better_compute.wire.commands import (
    BmcCheck,
    BmcInventory,
    BmcInventoryResult,
    BootDeviceResult,
    ClearEntry,
    ClearEntryResult,
    DriverInvoke,
    HttpProxy,
    MediaEject,
    MediaInsert,
    MediaResult,
    PowerResult,
    SetBootDevice,
    SetEntry,
    SetEntryResult,
    SetPower,
    ValidateBmc,
    ValidateResult,
    decode_payload,
)
from better_compute.wire.metal import NodeBmc

from . import metrics
from .cache import SiteCache
from .drivers import BmcCredentials, Driver, make_driver
from .media import MediaImages, bmc_addresses, token_image
from .netboot import BootEntries, normalize_mac
from .relay import HttpRelay

__all__ = ["DEFAULT_CREDENTIALS_KEEP_S", "SiteHandlers"]

P = TypeVar("P", SetPower, SetBootDevice, MediaInsert, MediaEject, BmcInventory)
_WAIT_FOR = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT})
_POWERS_ON = frozenset({"on", "cycle", "reset"})
DEFAULT_CREDENTIALS_KEEP_S = 300.0
"""How long a fetched BMC credential is kept for the node's next commands (config
``bmc.credentials_keep_seconds``)."""
VALIDATE_SECONDS = 15.0
"""``management.validate`` tries a BMC that does not answer this long at most, then says so."""


class SiteHandlers:
    """Handlers by command kind, plus what ``/healthz`` reports about them. Each decodes the
    command's payload into its Struct once (``wire.commands``) and hands that on."""

    def __init__(
        self,
        *,
        secrets: SecretsClient,
        identity: AgentIdentity,
        entries: BootEntries,
        cache: SiteCache,
        public_url: str,
        relay: HttpRelay,
        media: MediaImages | None = None,
        bus_ca: bytes | None = None,
        media_url: str = "",
        credentials_keep_s: float = DEFAULT_CREDENTIALS_KEEP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.relay = relay
        self.media = media or MediaImages()
        self.bus_ca = bus_ca
        self.media_url = (media_url or public_url).rstrip("/")
        self.secrets = secrets
        self.identity = identity
        self.entries = entries
        self.cache = cache
        self.public_url = public_url.rstrip("/")
        self.log = get_logger(component="handlers")
        self.last_error: str | None = None
        self.last_error_at_ms: int | None = None
        self.commands_run = 0
        self._bmc_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.credentials_keep_s = credentials_keep_s
        self._clock = clock
        self._kept: Recent[str, tuple[float, BmcCredentials]] = Recent(credentials_keep_s, lambda k: k[0])
        """BMC credentials by reference with when they were fetched, each good for
        ``credentials_keep_s`` after its fetch, never longer (using one does not extend it), in
        memory only."""
        self.credentials_fetched = 0
        self.credentials_kept_used = 0

    def bmc_lock(self, bmc: NodeBmc) -> asyncio.Lock:
        """One BMC command at a time per system (address and system id), as Ironic's node lock
        does: a BMC reads, changes and writes a system's whole state, so two commands on it at
        once lose one's change. An abort's undo sent its boot-device and power-off commands
        together; the boot-device write, read before the power-off landed, put the power back
        on at sushy-emulator, whose store keeps each system as one record."""
        key = (bmc.address, bmc.system_id or "")
        lock = self._bmc_locks.get(key)
        if lock is None:
            lock = self._bmc_locks[key] = asyncio.Lock()
        return lock

    def handlers(self) -> dict[str, CommandHandler]:
        ops = self._operations()
        return {**ops, "driver.invoke": self._driver_invoke, "site.httpProxy": self._http_proxy}

    def _operations(self) -> dict[str, CommandHandler]:
        """The driver operations, by ``<concern>.<operation>``: each a command kind of its own,
        and also what ``driver.invoke`` runs (a profile step's ``use`` on a site agent)."""
        return {
            "power.setPower": self._bmc(SetPower, self._power),
            "management.setBootDevice": self._bmc(SetBootDevice, self._boot),
            "media.insert": self._bmc(MediaInsert, self._insert),
            "media.eject": self._bmc(MediaEject, self._eject),
            "management.inventory": self._bmc(BmcInventory, self._inventory),
            "management.validate": self._validate,
            "netboot.setEntry": self._set_entry,
            "netboot.clearEntry": self._clear_entry,
        }

    async def _driver_invoke(self, cmd: Command) -> object:
        invoke = decode_payload(cmd.payload, DriverInvoke)
        handler = self._operations().get(invoke.operation)
        if handler is None:
            raise CommandRejected(f"unsupported-operation: this site agent has no {invoke.operation}")
        kind = COMMAND_KINDS.get(invoke.operation)
        try:  # as the command queue checks a command of that kind (SecretRefs normalised)
            value = kind.payload.validate(invoke.input) if kind is not None else invoke.input
        except BcError as err:
            raise err.with_path_prefix("input") from None
        return await handler(dataclasses.replace(cmd, kind=invoke.operation, payload=value))

    # -- credentials -------------------------------------------------------------------

    async def _fetch(self, ref: str, deadline: float, *, what: str, path: str) -> bytes:
        """The value behind ``ref`` through the secrets gate (sealed), while this command is live;
        UNAVAILABLE and TIMEOUT are tried again until the command's deadline."""
        backoff = Backoff(first=0.2, cap=3.0)
        while True:
            try:
                return await self.secrets.fetch(ref=ref, identity=self.identity)
            except BcError as err:
                delay = backoff.next()
                if err.code not in _WAIT_FOR or time.time() + delay >= deadline:
                    raise BcError(
                        err.code,
                        f"cannot fetch {what}: {err.message}",
                        {"path": path, "reason": err.reason or "secrets-fetch"},
                    ) from None
            await asyncio.sleep(delay)

    async def _credentials(
        self, target: NodeBmc, deadline: float, *, fresh: bool = False
    ) -> BmcCredentials | None:
        """The BMC's credentials: fetched through the secrets gate, then kept in memory for
        ``credentials_keep_s`` (docs/site-agent.md, "BMC credentials"). A node's commands come
        in runs (a deploy sends five within a minute or two), and each fetch is three signed
        requests and five statements across bc-secrets, bc-pki and the command queue. A new
        credential is a new reference (``nodes update --bmc-credentials-file``), so a kept one
        is never an older value under the same name; one the BMC refuses is dropped.
        ``fresh``: through the gate whatever is kept (``management.validate`` checks the gate
        too)."""
        ref = target.credentials_ref
        if ref is None:
            return None
        now = self._clock()
        kept = self._kept.get(ref)
        if kept is not None and now - kept[0] < self.credentials_keep_s and not fresh:
            self.credentials_kept_used += 1
            metrics.BMC_CREDENTIALS.labels("kept").inc()
            return kept[1]
        raw = await self._fetch(ref, deadline, what="the BMC credentials", path="bmc.credentialsRef")
        self.credentials_fetched += 1
        metrics.BMC_CREDENTIALS.labels("fetched").inc()
        try:
            login = msgspec.json.decode(raw, type=_Login)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise BcError(
                ErrorCode.INVALID_INPUT,
                'the BMC credential is not JSON {"username": ..., "password": ...}',
                {"path": "bmc.credentialsRef"},
            ) from None
        finally:
            del raw
        register_secret(login.password)
        credentials = BmcCredentials(username=login.username, password=login.password)
        if self.credentials_keep_s > 0:
            self._kept[ref] = (self._clock(), credentials)
        return credentials

    def forget_credentials(self, ref: str | None) -> None:
        """The BMC refused what was kept under ``ref``: the next command fetches it again."""
        if ref is not None:
            self._kept.pop(ref)

    def _bmc(
        self, into: type[P], op: Callable[[Driver, P, Command], Awaitable[msgspec.Struct]]
    ) -> CommandHandler:
        async def handle(cmd: Command) -> msgspec.Struct:
            self.commands_run += 1
            driver_name = "unknown"  # until the payload names a known one (bounded labels)
            began = time.monotonic()
            ref: str | None = None
            try:
                payload = decode_payload(cmd.payload, into)
                target = _target(payload.bmc)
                driver_name, ref = target.driver, target.credentials_ref
                credentials = await self._credentials(target, cmd.not_after)
                async with self.bmc_lock(target):
                    driver = make_driver(target, credentials)
                    del credentials
                    try:
                        result = await op(driver, payload, cmd)
                    finally:
                        await driver.close()
                        del driver
                metrics.BMC_CALL_SECONDS.labels(driver_name, cmd.kind, "ok").observe(time.monotonic() - began)
                return result
            except BcError as err:
                if err.details.get("credentials") == "refused":
                    self.forget_credentials(ref)
                metrics.BMC_CALL_SECONDS.labels(driver_name, cmd.kind, "error").observe(
                    time.monotonic() - began
                )
                metrics.BMC_CALL_ERRORS.labels(driver_name, cmd.kind, err.code.value).inc()
                self.last_error = f"{cmd.kind}: {err.code.value}: {err.message}"[:300]
                self.last_error_at_ms = time.time_ns() // 1_000_000
                raise

        return handle

    # -- BMC operations ----------------------------------------------------------------

    async def _power(self, driver: Driver, payload: SetPower, cmd: Command) -> PowerResult:
        if payload.action in _POWERS_ON:
            # before too: a quick machine asks while the BMC's change is still converging (a
            # power cycle after commission was asked for 0.16 s before the command finished)
            self.entries.powered(cmd.node_id)
        result = await driver.set_power(payload, deadline=cmd.not_after)
        if payload.action in _POWERS_ON:
            # the machine asks for its boot entry after its POST, from now: a served entry's
            # quiet period counts from here (netboot.BootEntries.powered)
            self.entries.powered(cmd.node_id)
        return result

    async def _boot(self, driver: Driver, payload: SetBootDevice, cmd: Command) -> BootDeviceResult:
        return await driver.set_boot_device(payload, deadline=cmd.not_after)

    async def _cached(self, url: str, sha256: str | None, holder: str) -> str:
        """The site cache's URL for the object (filled from ``url`` once, held by ``holder``),
        or ``url`` itself without a digest."""
        if not sha256:
            self.cache.release(holder)
            return url
        await self.cache.ensure(sha256, url, holder=holder)
        return f"{self.public_url}/cache/{sha256}"

    async def _insert(self, driver: Driver, payload: MediaInsert, cmd: Command) -> MediaResult:
        if payload.join_token_ref is not None:
            return await self._insert_token(driver, payload, cmd)
        if payload.url is None:
            raise BcError(ErrorCode.INVALID_INPUT, "give url (or joinTokenRef)", {"path": "url"})
        url = await self._cached(payload.url, payload.sha256, _media_holder(payload))
        return await driver.media_insert(msgspec.structs.replace(payload, url=url), deadline=cmd.not_after)

    async def _insert_token(self, driver: Driver, payload: MediaInsert, cmd: Command) -> MediaResult:
        """The ramdisk's token on a medium only the BMC fetches, once (``media``)."""
        assert payload.join_token_ref is not None  # the caller's check
        target = _target(payload.bmc)
        if target.driver == "ipmi":
            raise BcError(ErrorCode.INVALID_INPUT, "IPMI has no virtual media", {"path": "bmc.driver"})
        allowed = bmc_addresses(target.address)
        raw = await self._fetch(
            payload.join_token_ref, cmd.not_after, what="the join token", path="joinTokenRef"
        )
        token = raw.decode("utf-8", "replace").strip()
        del raw
        register_secret(token)
        if not token or any(c.isspace() for c in token):
            raise BcError(ErrorCode.INVALID_INPUT, "the join token is not one word", {"path": "joinTokenRef"})
        image = token_image(token, bus_ca=self.bus_ca)
        cap = self.media.put(
            image, allowed=allowed, not_after=cmd.not_after, token=token, node_id=cmd.node_id or "", mac=""
        )
        del token, image
        url = f"{self.media_url}/media/{cap}"
        try:
            got = await driver.media_insert(
                msgspec.structs.replace(payload, url=url, join_token_ref=None, sha256=None),
                deadline=cmd.not_after,
            )
        except BaseException:
            self.media.drop(cap)
            raise
        # the capability is in no result: the medium reads back as inserted, its URL hidden
        return msgspec.structs.replace(got, image=f"{self.media_url}/media/…" if got.image else got.image)

    async def _eject(self, driver: Driver, payload: MediaEject, cmd: Command) -> MediaResult:
        got = await driver.media_eject(payload, deadline=cmd.not_after)
        self.cache.release(_media_holder(payload))
        return got

    async def _inventory(self, driver: Driver, payload: BmcInventory, cmd: Command) -> BmcInventoryResult:
        return await driver.inventory(deadline=cmd.not_after)

    async def _validate(self, cmd: Command) -> ValidateResult:
        """``management.validate``: the BMC answers, takes the credentials, has the system and
        says its power state; changes nothing. A check that fails is in the result (the command
        succeeds)."""
        self.commands_run += 1
        target = decode_payload(cmd.payload, ValidateBmc).bmc
        deadline = min(cmd.not_after, time.time() + VALIDATE_SECONDS)
        try:
            credentials = await self._credentials(target, deadline, fresh=True)
            if credentials is None and target.driver == "ipmi":
                raise BcError(
                    ErrorCode.INVALID_INPUT, "the node's BMC has no credential (bmc.credentialsRef)", {}
                )
        except BcError as err:
            failed = BmcCheck(check="credentials", status="failed", message=err.message[:300])
            return ValidateResult(driver=target.driver, ok=False, checks=[failed])
        driver = make_driver(target, credentials, fresh=True)  # checks the BMC from its service root
        del credentials
        try:
            checks = await driver.validate(deadline=deadline)
        finally:
            await driver.close()
            del driver
        ok = all(c.status == "ok" for c in checks)
        if any(c.check == "credentials" and c.status == "failed" for c in checks):
            self.forget_credentials(target.credentials_ref)
        if not ok:
            first = next(c for c in checks if c.status == "failed")
            self.last_error = f"{cmd.kind}: {first.check}: {first.message}"[:300]
            self.last_error_at_ms = time.time_ns() // 1_000_000
        return ValidateResult(driver=target.driver, ok=ok, checks=checks)

    # -- boot entries ------------------------------------------------------------------

    async def _set_entry(self, cmd: Command) -> SetEntryResult:
        payload = decode_payload(cmd.payload, SetEntry)
        mac = normalize_mac(payload.mac)
        self.cache.release(f"netboot:{mac}:", prefix=True)
        kernel, initrd = payload.kernel, payload.initrd
        if kernel:
            kernel = await self._cached(kernel, payload.kernel_sha256, f"netboot:{mac}:kernel")
        if initrd:
            initrd = await self._cached(initrd, payload.initrd_sha256, f"netboot:{mac}:initrd")
        token = None
        if payload.join_token_ref:
            # Resolved now, while this command is live: the gate opens to no one later.
            raw = await self._fetch(
                payload.join_token_ref, cmd.not_after, what="the join token", path="joinTokenRef"
            )
            token = raw.decode("utf-8", "replace").strip()
            register_secret(token)
            if not token or any(c.isspace() for c in token):
                raise BcError(
                    ErrorCode.INVALID_INPUT, "the join token is not one word", {"path": "joinTokenRef"}
                )
        served = msgspec.structs.replace(payload, kernel=kernel, initrd=initrd)
        entry = self.entries.set(
            msgspec.to_builtins(served), command_id=cmd.id, join_token=token, node_id=cmd.node_id or ""
        )
        return SetEntryResult(
            mac=entry.mac, one_time=entry.one_time, kernel=entry.kernel, initrd=entry.initrd
        )

    async def _clear_entry(self, cmd: Command) -> ClearEntryResult:
        mac = normalize_mac(decode_payload(cmd.payload, ClearEntry).mac)
        removed = self.entries.clear(mac)
        self.cache.release(f"netboot:{mac}:", prefix=True)
        return ClearEntryResult(removed=removed)

    # -- relayed HTTP ------------------------------------------------------------------

    async def _http_proxy(self, cmd: Command) -> dict[str, object]:
        return await self.relay.request(decode_payload(cmd.payload, HttpProxy), deadline=cmd.not_after)


class _Login(msgspec.Struct, frozen=True):
    """The value behind a BMC's ``credentialsRef``."""

    username: str
    password: str


def _target(bmc: NodeBmc | None) -> NodeBmc:
    if bmc is None:
        raise BcError(ErrorCode.INVALID_INPUT, "the command names no BMC", {"path": "bmc"})
    return bmc


def _media_holder(payload: MediaInsert | MediaEject) -> str:
    bmc = payload.bmc
    address, system = (bmc.address, bmc.system_id or "") if bmc is not None else ("", "")
    return f"media:{address}:{system}:{payload.device}"
