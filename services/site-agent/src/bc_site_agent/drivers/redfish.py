"""The Redfish driver, on ``sushy`` (OpenStack's Redfish client).

sushy is blocking: every BMC call runs in a worker thread and is mapped to our errors there.
sushy's own server-side retries are off: we retry 5xx, refused connections and timeouts with
backoff and jitter until the command's deadline, and give up at once on 401/403, 404, 400 and
malformed answers. Power and boot changes are verified by reading them back until they match.
A power on or off (a cycle of a machine that is off is an on) whose answer was lost is read
back, and sent again only if the BMC did not get there (``_Power.request_power``); any other
action whose answer was lost is not repeated.

What the driver learnt of a BMC is kept between its commands (``_Link``, one per BMC system): the
service root, the system and its virtual media as sushy objects, read again where the answer
matters (a power or boot read-back, a medium's state, the first use in a command), found again
when the BMC no longer has them there (404), forgotten when a command fails. Never a credential
(they are the command's, set on the session for it and taken off at its end) and never an open
connection (the command's GETs share one; the pool is emptied when it ends).
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
import time
import warnings
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import requests.adapters
import requests.exceptions
import sushy
import sushy.auth
import sushy.connector
import sushy.exceptions
import urllib3.exceptions
from sushy.resources.constants import ResetType
from sushy.resources.manager.constants import VirtualMediaType
from sushy.resources.system.constants import (
    BootSource,
    BootSourceOverrideEnabled,
    BootSourceOverrideMode,
)

from better_compute.agent import before_call_blocking
from better_compute.core.errors import BcError
from better_compute.logging import get_logger
from better_compute.wire.commands import (
    BmcCheck,
    BmcInventoryResult,
    BmcMemory,
    BmcNic,
    BmcProcessor,
    BmcSystem,
    MediaEject,
    MediaInsert,
    SetBootDevice,
    SetPower,
)
from better_compute.wire.metal import NodeBmc

from .base import (
    BmcCredentials,
    Checks,
    NotRepeatedError,
    Transient,
    driver_error,
    failure_reason,
    malformed_answer,
    retry_in_thread,
)
from .interfaces import BootRead, Driver, MediumRead

__all__ = ["LINKS", "RedfishLinks", "RedfishSession", "open_driver"]

T = TypeVar("T")
R = TypeVar("R")

_BOOT: Final = {
    "pxe": BootSource.PXE,
    "disk": BootSource.HDD,
    "cd": BootSource.CD,
    "usb": BootSource.USB,
    "bios": BootSource.BIOS_SETUP,
}
_BOOT_BACK: Final = {v.value: k for k, v in _BOOT.items()}
_RESET: Final = {
    "on": ResetType.ON,
    "off": ResetType.FORCE_OFF,
    "softOff": ResetType.GRACEFUL_SHUTDOWN,
    "cycle": ResetType.FORCE_RESTART,
    "reset": ResetType.FORCE_RESTART,
}
_TARGET_STATES: Final = {"on": "on", "off": "off"}
"""Power actions that ask for a state, by the state they ask for, whose Reset (``On``,
``ForceOff``) may be sent again: twice is the same state. Not a soft off (it asks the OS), nor a
cycle or reset (twice is two restarts)."""
_MEDIA: Final = {
    "cd": (VirtualMediaType.CD, VirtualMediaType.DVD),
    "usb": (VirtualMediaType.USB_STICK, VirtualMediaType.FLOPPY),
}
_CALL_TIMEOUT: Final = 10.0
"""At most this long for one HTTP exchange with the BMC (less when the deadline is nearer)."""
_READ_BACK: Final = 15.0
"""How long a power on or off, or a medium's insert or eject, whose answer was lost is read back
before it is sent again (sushy-emulator's fake driver applies a power change 1-11 s late; real
BMCs in a few seconds)."""
_READ_BACK_EVERY: Final = 1.0
_LINKS_KEPT: Final = 512
"""What is kept of at most this many BMC systems (the least recently used is dropped)."""


def _ca_file(pem: str) -> str:
    """A per-node CA bundle as a file requests can read (not a secret: a public certificate)."""
    digest = hashlib.sha256(pem.encode()).hexdigest()[:32]
    path = Path(tempfile.gettempdir()) / f"bc-site-agent-ca-{digest}.pem"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(pem)
        tmp.replace(path)
    return str(path)


class _Link:
    """What the driver keeps of one BMC system between its commands: the sushy connector (a
    requests session without credentials or open connections between commands), the service
    root as read, the system, and the virtual media by device. ``busy`` while a command uses it:
    a second command at once (``management.validate`` takes no BMC lock) gets a link of its own."""

    def __init__(self) -> None:
        self.connector: _Connector | None = None
        self.root: Any = None
        self.system: Any = None
        self.media: dict[str, Any] = {}
        self.busy = False

    def forget(self) -> None:
        """Read everything again from the service root on (the BMC failed or changed)."""
        self.root = None
        self.system = None
        self.media = {}


class RedfishLinks:
    """The kept ``_Link``s by BMC system (its URL, system id and how it is trusted), at most
    ``kept`` of them, the least recently used dropped first."""

    def __init__(self, *, kept: int = _LINKS_KEPT) -> None:
        self.kept = kept
        self._links: OrderedDict[tuple[str, str, str], _Link] = OrderedDict()

    def take(self, key: tuple[str, str, str]) -> _Link:
        """The key's link for one command (a new one when it is in use or unknown)."""
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = _Link()
            while len(self._links) > self.kept:
                self._links.popitem(last=False)
        elif link.busy:
            return _Link()  # not kept: the command at once with the other one reads it all itself
        self._links.move_to_end(key)
        link.busy = True
        return link

    def drop(self, key: tuple[str, str, str], link: _Link) -> None:
        """Keep nothing more of the key's BMC (a worker thread of a failed or cancelled command
        may still be using ``link``)."""
        if self._links.get(key) is link:
            del self._links[key]

    def clear(self) -> None:
        self._links.clear()

    def __len__(self) -> int:
        return len(self._links)


LINKS: Final = RedfishLinks()
"""The site agent's kept links (one process drives every BMC of its site)."""


class RedfishSession:
    """One command's connection to a Redfish service: the plumbing its interfaces share, over
    what is kept of the BMC (``link``: a fresh one when ``links`` is None)."""

    def __init__(
        self,
        target: NodeBmc,
        credentials: BmcCredentials,
        *,
        call_timeout: float = _CALL_TIMEOUT,
        read_back: float = _READ_BACK,
        links: RedfishLinks | None = None,
    ) -> None:
        self.target = target
        self.call_timeout = call_timeout
        self.read_back = read_back
        self._credentials: BmcCredentials | None = credentials
        address = target.address.rstrip("/")
        if "://" not in address:
            address = f"https://{address}"
        self.base_url = address
        self.verify: bool | str = True
        if target.insecure:
            self.verify = False
        elif target.ca_bundle:
            self.verify = _ca_file(target.ca_bundle)
        self._links = links
        self._key = (self.base_url, target.system_id or "", str(self.verify))
        self.link = links.take(self._key) if links is not None else _Link()
        self._fresh: set[str] = set()
        """What was read in this command since its last action (``system``, ``media:<device>``):
        a read that only needs where things are, or what an action needs, is not repeated."""
        self._failed = False
        self.log = get_logger(driver="redfish", bmc=self.base_url)
        parts = urlsplit(self.base_url)
        self.at = parts.netloc.rpartition("@")[2] or self.base_url
        """The BMC as the command's progress names it: host[:port], never a user or password."""

    # -- plumbing ------------------------------------------------------------------------

    async def call(self, call: str, fn: Callable[[], T], *, deadline: float, idempotent: bool = True) -> T:
        """One BMC call in a thread, retried while transient, mapped to ``DRIVER_ERROR``.

        ``idempotent=False`` (a POST action): ``fn`` sends that one request and nothing else, and
        it is repeated only when it never reached the BMC (``base.retry_transient``)."""

        def run() -> T:
            try:
                with warnings.catch_warnings():
                    # insecure=true was asked for explicitly; urllib3 would warn on every call
                    warnings.simplefilter("ignore")
                    self._connector(deadline)  # the command's credentials and this call's timeouts
                    return fn()
            except sushy.exceptions.ServerSideError as exc:
                # 503: the BMC did not take the request; another 5xx may have half-applied it
                raise Transient(
                    call,
                    f"HTTP {exc.status_code} from the BMC",
                    maybe_applied=exc.status_code != 503,
                    kind="error",
                    reason=f"HTTP {exc.status_code} ({call})",
                ) from None
            except sushy.exceptions.ConnectionError as exc:
                cause = _cause(exc)
                if cause.startswith("TLS"):
                    raise driver_error(call, cause) from None
                raise Transient(
                    call, f"cannot reach the BMC ({cause})", maybe_applied=not _never_sent(exc), reason=cause
                ) from None
            except sushy.exceptions.AccessError as exc:
                raise driver_error(
                    call, f"HTTP {exc.status_code}: the BMC refused the credentials", credentials="refused"
                ) from None
            except sushy.exceptions.ResourceNotFoundError:
                raise driver_error(call, "HTTP 404: no such resource on the BMC") from None
            except sushy.exceptions.HTTPError as exc:
                raise driver_error(call, f"HTTP {exc.status_code}: {exc.detail or exc.code}") from None
            except sushy.exceptions.SushyError as exc:
                raise driver_error(call, f"unexpected answer: {type(exc).__name__}") from None
            except ValueError as exc:  # requests' JSONDecodeError, sushy's mapping of odd values
                raise malformed_answer(call, exc) from None
            except (KeyError, TypeError, AttributeError) as exc:
                raise malformed_answer(call, exc) from None

        try:
            return await retry_in_thread(
                run, deadline=deadline, log=self.log, idempotent=idempotent, what=call, at=self.at,
                requests_checked=True,  # _BmcAdapter.send asks before each request that changes
            )  # fmt: skip
        except BaseException:
            self._failed = True  # what is kept may be what failed: the next command reads it all again
            raise

    def _timeout(self, deadline: float) -> float:
        return max(0.5, min(self.call_timeout, deadline - time.time()))

    def _connector(self, deadline: float) -> _Connector:
        """The link's connector, with this command's credentials on it and the timeouts of the
        next exchange (it outlives the command, whose deadline bounds them)."""
        link = self.link
        timeout = self._timeout(deadline)
        if link.connector is not None:
            link.connector._default_request_timeout = timeout
            link.connector._connect_timeout = min(5.0, timeout)
        else:
            link.connector = _Connector(
                self.base_url,
                verify=self.verify,
                # sushy retries connection errors (server_side_retries or 3) times with
                # (delay or 2) s between: keep it to one try, our loop backs off with jitter.
                server_side_retries=1,
                server_side_retries_delay=0.05,
                default_request_timeout=timeout,
                connect_timeout=min(5.0, timeout),
            )
        if self._credentials is not None:
            # the command's credentials, on the session for this command only (``close``)
            creds = self._credentials
            link.connector.set_http_basic_auth(creds.username, creds.password)
            self._credentials = None
        return link.connector

    def connect(self, deadline: float) -> Any:
        """The service root, read once per link (it says where the collections are)."""
        connector = self._connector(deadline)
        if self.link.root is None:
            self.link.root = sushy.Sushy(self.base_url, auth=_NoKeptAuth(), connector=connector)
        return self.link.root

    def system(self, deadline: float, *, fresh: bool = False) -> Any:
        """The system: read again when ``fresh`` (its power or boot state matters) or not yet
        read in this command; found again from the service root when the BMC no longer has it
        at the path it had (a 404)."""
        self._connector(deadline)
        link = self.link
        if link.system is not None:
            if fresh or "system" not in self._fresh:
                try:
                    _reread(link.system)
                except sushy.exceptions.ResourceNotFoundError:
                    self.log.info("bmc_system_moved", path=link.system.path)
                    link.forget()
                    return self.system(deadline, fresh=fresh)
            self._fresh.add("system")
            return link.system
        root = self.connect(deadline)
        if self.target.system_id:
            sid = self.target.system_id
            systems = root._systems_path or "/redfish/v1/Systems"  # from the root: no GET of the collection
            path = sid if sid.startswith("/") else f"{systems.rstrip('/')}/{sid}"
            system = root.get_system(path)
        else:
            members = root.get_system_collection().get_members()
            if len(members) != 1:
                raise driver_error(
                    "GET Systems", f"the BMC has {len(members)} systems: say which one in bmc.systemId"
                )
            system = members[0]
        link.system = system
        self._fresh.add("system")
        return system

    def acted(self, what: str) -> None:
        """An action changed ``what`` at the BMC: its next read in this command reads it again."""
        self._fresh.discard(what)

    def fresh(self, what: str) -> bool:
        return what in self._fresh

    def read(self, what: str) -> None:
        self._fresh.add(what)

    async def close(self) -> None:
        """End the command: the credentials off the session, its connections closed; what was
        learnt of the BMC kept for the next command, unless a call of this one failed."""
        link, self._credentials = self.link, None
        if self._failed or self._links is None:
            link.forget()
            if self._links is not None:
                self._links.drop(self._key, link)
        connector = link.connector
        link.busy = False
        if connector is None:
            return
        if self._links is None:
            link.connector = None
            await asyncio.to_thread(connector.close)
            return
        connector.end_command()


def _reread(resource: Any) -> None:
    """Read a sushy resource again (one GET); its sub-resources are read again when next used."""
    resource.invalidate()
    resource.refresh(force=False)


class _NoKeptAuth(sushy.auth.AuthBase):  # type: ignore[misc]  # sushy ships no type hints
    """sushy's authentication as the root keeps it: none of its own. The command's Basic
    credentials are on the connector's session while that command runs (``RedfishSession``),
    so the kept root holds no credential between commands."""

    def _do_authenticate(self) -> None:
        pass

    def can_refresh_session(self) -> bool:
        return False


class _Power:
    def __init__(self, bmc: RedfishSession) -> None:
        self.bmc = bmc

    async def power_state(self, *, deadline: float) -> str:
        def read() -> str:
            return _enum_value(self.bmc.system(deadline, fresh=True).power_state)

        return await self.bmc.call("GET System.PowerState", read, deadline=deadline)

    async def request_power(self, command: SetPower, *, before: str, deadline: float) -> None:
        reset = _RESET[command.action]
        if command.action in ("cycle", "reset") and before != "On":
            reset = ResetType.ON  # a restart of a machine that is off: it boots
        system = await self.bmc.call("GET System", lambda: self.bmc.system(deadline), deadline=deadline)
        call = f"POST ComputerSystem.Reset({reset.value})"
        # a cycle of a machine that is off is a power on: a state, read back like one
        want = "on" if reset is ResetType.ON else _TARGET_STATES.get(command.action)
        while True:
            self.bmc.acted("system")  # (before: an answer lost may still have changed it)
            try:
                await self.bmc.call(
                    call, lambda: system.reset_system(reset), deadline=deadline, idempotent=False
                )
                return
            except NotRepeatedError:
                # An on or off asks for a state: what the BMC did is read back, not guessed
                if want is None:
                    raise
                self.bmc.log.info("bmc_power_answer_lost", call=call, read_back_s=self.bmc.read_back)
                if await self._reached(want, deadline=deadline):
                    return
                if time.time() >= deadline:
                    raise
                self.bmc.log.info("bmc_power_sent_again", call=call)

    async def _reached(self, want: str, *, deadline: float) -> bool:
        """Whether the power state reads ``want`` within ``read_back`` seconds."""
        return await _read_back(
            self.bmc, lambda: self.power_state(deadline=deadline), lambda got: got.lower() == want, deadline
        )


async def _read_back(
    bmc: RedfishSession, read: Callable[[], Awaitable[R]], done: Callable[[R], bool], deadline: float
) -> bool:
    """Whether ``read()`` shows ``done`` within ``bmc.read_back`` seconds, read once a second (each
    read retried as reads are, until the command's deadline): what an action whose answer was lost
    did at the BMC."""
    until = min(deadline, time.time() + bmc.read_back)
    while True:
        if done(await read()):
            return True
        if time.time() + _READ_BACK_EVERY >= until:
            return False
        await asyncio.sleep(_READ_BACK_EVERY)


class _Management:
    def __init__(self, bmc: RedfishSession) -> None:
        self.bmc = bmc

    async def request_boot_device(self, command: SetBootDevice, *, deadline: float) -> None:
        target = _BOOT[command.device]
        enabled = (
            BootSourceOverrideEnabled.CONTINUOUS if command.persistent else BootSourceOverrideEnabled.ONCE
        )
        mode = {"uefi": BootSourceOverrideMode.UEFI, "legacy": BootSourceOverrideMode.LEGACY}.get(
            command.mode or ""
        )

        def patch() -> None:
            # the system as this command read it (sushy's PATCH reads its ETag again itself)
            system = self.bmc.system(deadline)
            self.bmc.acted("system")
            system.set_system_boot_options(target=target, enabled=enabled, mode=mode)

        await self.bmc.call("PATCH System.Boot", patch, deadline=deadline)

    async def boot_device(self, *, deadline: float) -> BootRead:
        def read() -> BootRead:
            boot = self.bmc.system(deadline, fresh=True).boot
            target = _enum_value(boot.target)
            return BootRead(device=_BOOT_BACK.get(target), target=target, enabled=_enum_value(boot.enabled))

        return await self.bmc.call("GET System.Boot", read, deadline=deadline)

    async def validate(self, *, deadline: float) -> list[BmcCheck]:
        bmc, checks = self.bmc, Checks()
        bmc.link.forget()  # every check asks the BMC, nothing is taken from an earlier command
        try:  # the service root (sushy reads it as it connects)
            await bmc.call("GET ServiceRoot", lambda: bmc.connect(deadline), deadline=deadline)
        except BcError as err:
            reason = failure_reason(err)
            if "credentials" not in reason:
                checks.fail("reach", f"{bmc.at}: {reason}")
                return checks.skip("credentials", "system", "power")
            checks.ok("reach", f"the Redfish service at {bmc.at} answers")
            checks.fail("credentials", reason)
            return checks.skip("system", "power")
        checks.ok("reach", f"the Redfish service at {bmc.at} answers")
        try:  # the systems need authentication where the root may not
            await bmc.call(
                "GET Systems",
                lambda: bmc.connect(deadline).get_system_collection().members_identities,
                deadline=deadline,
            )
        except BcError as err:
            checks.fail("credentials", failure_reason(err))
            return checks.skip("system", "power")
        checks.ok("credentials", "the BMC takes the credentials")
        try:
            system = await bmc.call("GET System", lambda: bmc.system(deadline), deadline=deadline)
        except BcError as err:
            checks.fail("system", failure_reason(err))
            return checks.skip("power")
        checks.ok("system", f"system {system.identity} ({system.path})")
        try:
            power = await _Power(bmc).power_state(deadline=deadline)
        except BcError as err:
            checks.fail("power", failure_reason(err))
        else:
            checks.ok("power", f"power state {power}")
        return checks.items


class _Media:
    def __init__(self, bmc: RedfishSession) -> None:
        self.bmc = bmc

    def _find(self, device: str, deadline: float, *, fresh: bool) -> Any:
        """The device's virtual medium: where it is is kept (``_Link.media``), found once by
        listing the system's managers' virtual media; its state read again when ``fresh`` or
        not yet read in this command."""
        bmc, what = self.bmc, f"media:{device}"
        medium = bmc.link.media.get(device)
        if medium is not None:
            if fresh or not bmc.fresh(what):
                try:
                    _reread(medium)
                except sushy.exceptions.ResourceNotFoundError:
                    bmc.log.info("bmc_medium_moved", path=medium.path)
                    bmc.link.forget()
                    return self._find(device, deadline, fresh=fresh)
            bmc.read(what)
            return medium
        types = _MEDIA.get(device, ())
        for manager in bmc.system(deadline).managers:
            for medium in manager.virtual_media.get_members():
                if any(t in types for t in medium.media_types or ()):
                    bmc.link.media[device] = medium
                    bmc.read(what)
                    return medium
        raise driver_error("GET Manager.VirtualMedia", f"the BMC offers no virtual {device} device")

    async def _medium(self, device: str, deadline: float, *, fresh: bool = False) -> Any:
        return await self.bmc.call(
            "GET Manager.VirtualMedia", lambda: self._find(device, deadline, fresh=fresh), deadline=deadline
        )

    async def _act(
        self,
        call: str,
        device: str,
        act: Callable[[], None],
        done: Callable[[MediumRead], bool],
        *,
        deadline: float,
    ) -> None:
        """``act`` (a POST), once. When its answer was lost (the BMC may have applied it), the
        medium is read back for ``read_back`` seconds: what the action asked for is there, it
        is done; still not there, it is sent again. Inserting the same image or ejecting twice
        changes nothing more (a BMC that applied the first late refuses the second: the
        command fails, as it would have without the read-back)."""
        while True:
            self.bmc.acted(f"media:{device}")
            try:
                await self.bmc.call(call, act, deadline=deadline, idempotent=False)
                return
            except NotRepeatedError:
                self.bmc.log.info("bmc_media_answer_lost", call=call, read_back_s=self.bmc.read_back)
                if await self._reached(device, done, deadline=deadline):
                    return
                if time.time() >= deadline:
                    raise
                self.bmc.log.info("bmc_media_sent_again", call=call)

    async def _reached(self, device: str, done: Callable[[MediumRead], bool], *, deadline: float) -> bool:
        """Whether the medium reads as ``done`` within ``read_back`` seconds."""
        return await _read_back(self.bmc, lambda: self.medium(device, deadline=deadline), done, deadline)

    async def insert(self, command: MediaInsert, *, deadline: float) -> None:
        medium = await self._medium(command.device, deadline)
        await self._act(
            "POST VirtualMedia.InsertMedia",
            command.device,
            lambda: medium.insert_media(command.url, inserted=True, write_protected=True),
            lambda got: got.inserted and got.image == command.url,
            deadline=deadline,
        )

    async def eject(self, command: MediaEject, *, deadline: float) -> None:
        medium = await self._medium(command.device, deadline)
        await self._act(
            "POST VirtualMedia.EjectMedia",
            command.device,
            medium.eject_media,
            lambda got: not got.inserted,
            deadline=deadline,
        )

    async def medium(self, device: str, *, deadline: float) -> MediumRead:
        medium = await self._medium(device, deadline, fresh=True)
        return MediumRead(inserted=bool(medium.inserted), image=medium.image)


class _Inventory:
    def __init__(self, bmc: RedfishSession) -> None:
        self.bmc = bmc

    async def inventory(self, *, deadline: float) -> BmcInventoryResult:
        def read() -> BmcInventoryResult:
            system = self.bmc.system(deadline, fresh=True)
            processors = [
                BmcProcessor(
                    id=proc.identity,
                    model=proc.model,
                    cores=proc.total_cores,
                    threads=proc.total_threads,
                    architecture=_enum_value(proc.processor_architecture),
                )
                for proc in _members(lambda: system.processors)
            ]
            nics = [
                BmcNic(id=nic.identity, mac=(nic.mac_address or "").lower() or None)
                for nic in _members(lambda: system.ethernet_interfaces)
            ]
            memory = _optional(lambda: system.memory_summary)
            return BmcInventoryResult(
                driver="redfish",
                system=BmcSystem(
                    id=system.identity,
                    uuid=system.uuid,
                    name=system.name,
                    manufacturer=system.manufacturer,
                    model=system.model,
                    serial=system.serial_number,
                    bios_version=system.bios_version,
                    power_state=_enum_value(system.power_state),
                ),
                processors=processors,
                memory=BmcMemory(total_gib=memory.size_gib if memory is not None else None),
                nics=nics,
            )

        return await self.bmc.call("GET System inventory", read, deadline=deadline)


def open_driver(
    target: NodeBmc,
    credentials: BmcCredentials,
    *,
    call_timeout: float = _CALL_TIMEOUT,
    read_back: float = _READ_BACK,
    links: RedfishLinks | None = LINKS,
) -> Driver:
    """A Redfish driver for one command: one session shared by its four interfaces.
    ``call_timeout``: at most this long for one HTTP exchange; ``read_back``: how long a power
    on or off, or a medium's insert or eject, whose answer was lost is read back before it is
    sent again; ``links``: what is
    kept of BMCs between commands (None: read everything from the service root, keep nothing)."""
    bmc = RedfishSession(target, credentials, call_timeout=call_timeout, read_back=read_back, links=links)
    return Driver(
        name="redfish",
        power=_Power(bmc),
        management=_Management(bmc),
        inventory=_Inventory(bmc),
        media=_Media(bmc),
        close=bmc.close,
    )


class _BmcAdapter(requests.adapters.HTTPAdapter):
    """requests' adapter for the BMC: the agent is asked before each request; a command's GETs
    share one connection, and every other request has one of its own.

    Before each request, not only before each try: one sushy call may read a resource and then
    act on it, and a cancel that reached the agent during the read must stop the action
    (``before_call_blocking`` raises ``CommandCancelled``).

    An action (POST, PATCH, …) goes on a connection opened for it, with sushy's ``Connection:
    close``, and closed after it: a BMC that closes as asked but late, without ``Connection:
    close`` in its answer, leaves a connection that urllib3 takes for keep-alive, and a request
    written into it while the BMC closes it unread fails like one whose answer was lost: a POST
    action then counts as "may have applied" and is not repeated (seen against a BMC proxy under
    load). So the pool is emptied before and after it, and an action that never left fails at
    connect (``_never_sent``). A GET keeps its connection for the command's next GET (no
    ``Connection: close``; a TCP and TLS handshake per command, not per request); one that
    finds the kept connection closed by the BMC is sent once more on a new one (a GET changes
    nothing). ``_Connector.end_command`` closes it when the command ends.
    """

    def __init__(self) -> None:
        super().__init__(pool_connections=1, pool_maxsize=1)

    def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # a read asks the command queue nothing: only a request that changes the BMC must
        # never go after a cancel (a cancel the agent knows of stops a read too)
        before_call_blocking(
            f"{request.method} {urlsplit(request.url).path}", changes=request.method not in ("GET", "HEAD")
        )
        if request.method != "GET":
            self.poolmanager.clear()
            try:
                return super().send(request, *args, **kwargs)
            finally:
                self.poolmanager.clear()
        request.headers.pop("Connection", None)
        try:
            return super().send(request, *args, **kwargs)
        except requests.exceptions.ConnectionError as exc:
            if not _dropped(exc):
                raise
            self.poolmanager.clear()
            return super().send(request, *args, **kwargs)


class _Connector(sushy.connector.Connector):  # type: ignore[misc]  # sushy ships no type hints
    """sushy's connector with ``_BmcAdapter`` mounted on its session (as sushy mounts its own
    TLS adapter there). It outlives a command (``_Link``): ``end_command`` leaves it without
    credentials, cookies or connections."""

    _verify: bool | str  # sushy's: what each request verifies the BMC's certificate with

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        adapter = _BmcAdapter()
        session = self._session
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        if session.trust_env:
            # What the environment says for this BMC (a proxy, NO_PROXY, REQUESTS_CA_BUNDLE for
            # verify=True), read once here: requests read it again for every request, walking
            # os.environ each time (8% of a site agent's CPU in a 200-machine deploy, py-spy).
            # The credentials are the command's own (never .netrc's).
            env = session.merge_environment_settings(url, {}, None, self._verify, None)
            session.proxies.update(env["proxies"])
            self._verify = env["verify"]
            session.trust_env = False

    def end_command(self) -> None:
        self._session.auth = None
        self._session.cookies.clear()
        self._session.close()  # empties the adapters' pools; they open new connections when asked


def _optional(read: Callable[[], Any]) -> Any:
    """A part of the inventory the BMC may not offer (None then)."""
    try:
        return read()
    except sushy.exceptions.MissingAttributeError:
        return None


def _members(read: Callable[[], Any]) -> list[Any]:
    collection = _optional(read)
    return list(collection.get_members()) if collection is not None else []


def _enum_value(value: Any) -> str:
    return str(getattr(value, "value", value)) if value is not None else ""


_NOT_SENT: Final = (
    requests.exceptions.ConnectTimeout,
    urllib3.exceptions.NewConnectionError,  # NameResolutionError is one
    urllib3.exceptions.ConnectTimeoutError,
)


def _never_sent(exc: BaseException) -> bool:
    """Whether a connection error happened before the request left: refused, the name not
    resolved, the connect timing out. A connection lost or a read timing out afterwards is not.
    This holds because every action opens its own connection (``_BmcAdapter``),
    so none is written into a keep-alive socket the BMC is closing (which would fail like a lost
    answer); tests/integration/test_site_agent_drivers.py checks it.
    (sushy raises its ConnectionError inside the ``except`` of the requests error, which
    requests raised from urllib3's: the chain holds the cause.)"""
    return any(isinstance(e, _NOT_SENT) for e in _chain(exc))


def _dropped(exc: BaseException) -> bool:
    """Whether a request failed because the connection was closed under it (the BMC closed a
    kept connection, or dropped one mid-answer): urllib3's ``ProtocolError`` in the chain."""
    return any(isinstance(e, urllib3.exceptions.ProtocolError) for e in _chain(exc))


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it carries: its cause, its context, its arguments, a
    ``MaxRetryError``'s reason (each once)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, urllib3.exceptions.MaxRetryError) and e.reason is not None:
            todo.append(e.reason)
        todo.extend(a for a in e.args if isinstance(a, BaseException))
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)


def _cause(exc: BaseException) -> str:
    text = str(exc)
    for marker in ("timed out", "Read timed out", "Connection refused", "Name or service not known"):
        if marker.lower() in text.lower():
            return marker.lower()
    if "SSL" in text or "CERTIFICATE" in text.upper():
        return "TLS verification failed"
    return type(exc).__name__
