"""The Redfish driver, on ``sushy`` (OpenStack's Redfish client).

sushy is blocking: every BMC call runs in a worker thread and is mapped to our errors there.
sushy's own server-side retries are off: we retry 5xx, refused connections and timeouts with
backoff and jitter until the command's deadline, and give up at once on 401/403, 404, 400 and
malformed answers. Power and boot changes are verified by reading them back until they match.
A power on or off whose answer was lost is read back, and sent again only if the BMC did not
get there (``_Power.request_power``); any other action whose answer was lost is not repeated.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
import time
import warnings
from collections.abc import Callable
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

__all__ = ["RedfishSession", "open_driver"]

T = TypeVar("T")

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
"""How long a power on or off whose answer was lost is read back before it is sent again
(sushy-emulator's fake driver applies one 1-11 s late; real BMCs in a few seconds)."""
_READ_BACK_EVERY: Final = 1.0


def _ca_file(pem: str) -> str:
    """A per-node CA bundle as a file requests can read (not a secret: a public certificate)."""
    digest = hashlib.sha256(pem.encode()).hexdigest()[:32]
    path = Path(tempfile.gettempdir()) / f"bc-site-agent-ca-{digest}.pem"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(pem)
        tmp.replace(path)
    return str(path)


class RedfishSession:
    """One command's connection to a Redfish service: the plumbing its interfaces share."""

    def __init__(
        self,
        target: NodeBmc,
        credentials: BmcCredentials,
        *,
        call_timeout: float = _CALL_TIMEOUT,
        read_back: float = _READ_BACK,
    ) -> None:
        self.target = target
        self.call_timeout = call_timeout
        self.read_back = read_back
        self._credentials = credentials
        address = target.address.rstrip("/")
        if "://" not in address:
            address = f"https://{address}"
        self.base_url = address
        self.verify: bool | str = True
        if target.insecure:
            self.verify = False
        elif target.ca_bundle:
            self.verify = _ca_file(target.ca_bundle)
        self._root: Any = None
        self._connector: _Connector | None = None
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
                raise driver_error(call, f"HTTP {exc.status_code}: the BMC refused the credentials") from None
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

        return await retry_in_thread(
            run, deadline=deadline, log=self.log, idempotent=idempotent, what=call, at=self.at
        )

    def _timeout(self, deadline: float) -> float:
        return max(0.5, min(self.call_timeout, deadline - time.time()))

    def connect(self, deadline: float) -> Any:
        if self._root is None:
            timeout = self._timeout(deadline)
            connector = _Connector(
                self.base_url,
                verify=self.verify,
                # sushy retries connection errors (server_side_retries or 3) times with
                # (delay or 2) s between: keep it to one try, our loop backs off with jitter.
                server_side_retries=1,
                server_side_retries_delay=0.05,
                default_request_timeout=timeout,
                connect_timeout=min(5.0, timeout),
            )
            self._connector = connector
            self._root = sushy.Sushy(
                self.base_url,
                auth=sushy.auth.BasicAuth(
                    username=self._credentials.username, password=self._credentials.password
                ),
                connector=connector,
            )
        return self._root

    def system(self, deadline: float) -> Any:
        root = self.connect(deadline)
        if self.target.system_id:
            sid = self.target.system_id
            path = sid if sid.startswith("/") else f"{root.get_system_collection().path.rstrip('/')}/{sid}"
            return root.get_system(path)
        members = root.get_system_collection().get_members()
        if len(members) != 1:
            raise driver_error(
                "GET Systems", f"the BMC has {len(members)} systems: say which one in bmc.systemId"
            )
        return members[0]

    async def close(self) -> None:
        connector, self._connector, self._root = self._connector, None, None
        if connector is not None:
            await asyncio.to_thread(connector.close)


class _Power:
    def __init__(self, bmc: RedfishSession) -> None:
        self.bmc = bmc

    async def power_state(self, *, deadline: float) -> str:
        def read() -> str:
            return _enum_value(self.bmc.system(deadline).power_state)

        return await self.bmc.call("GET System.PowerState", read, deadline=deadline)

    async def request_power(self, command: SetPower, *, before: str, deadline: float) -> None:
        reset = _RESET[command.action]
        if command.action in ("cycle", "reset") and before != "On":
            reset = ResetType.ON  # a restart of a machine that is off: it boots
        system = await self.bmc.call("GET System", lambda: self.bmc.system(deadline), deadline=deadline)
        call = f"POST ComputerSystem.Reset({reset.value})"
        want = _TARGET_STATES.get(command.action)
        while True:
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
        """Whether the power state reads ``want`` within ``read_back`` seconds (each read is
        retried as reads are, until the command's deadline)."""
        until = min(deadline, time.time() + self.bmc.read_back)
        while True:
            if (await self.power_state(deadline=deadline)).lower() == want:
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
            self.bmc.system(deadline).set_system_boot_options(target=target, enabled=enabled, mode=mode)

        await self.bmc.call("PATCH System.Boot", patch, deadline=deadline)

    async def boot_device(self, *, deadline: float) -> BootRead:
        def read() -> BootRead:
            boot = self.bmc.system(deadline).boot
            target = _enum_value(boot.target)
            return BootRead(device=_BOOT_BACK.get(target), target=target, enabled=_enum_value(boot.enabled))

        return await self.bmc.call("GET System.Boot", read, deadline=deadline)

    async def validate(self, *, deadline: float) -> list[BmcCheck]:
        bmc, checks = self.bmc, Checks()
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

    def _find(self, device: str, deadline: float) -> Any:
        types = _MEDIA.get(device, ())
        for manager in self.bmc.system(deadline).managers:
            for medium in manager.virtual_media.get_members():
                if any(t in types for t in medium.media_types or ()):
                    return medium
        raise driver_error("GET Manager.VirtualMedia", f"the BMC offers no virtual {device} device")

    async def _medium(self, device: str, deadline: float) -> Any:
        return await self.bmc.call(
            "GET Manager.VirtualMedia", lambda: self._find(device, deadline), deadline=deadline
        )

    async def insert(self, command: MediaInsert, *, deadline: float) -> None:
        medium = await self._medium(command.device, deadline)
        await self.bmc.call(
            "POST VirtualMedia.InsertMedia",
            lambda: medium.insert_media(command.url, inserted=True, write_protected=True),
            deadline=deadline,
            idempotent=False,
        )

    async def eject(self, command: MediaEject, *, deadline: float) -> None:
        medium = await self._medium(command.device, deadline)
        await self.bmc.call(
            "POST VirtualMedia.EjectMedia", medium.eject_media, deadline=deadline, idempotent=False
        )

    async def medium(self, device: str, *, deadline: float) -> MediumRead:
        medium = await self._medium(device, deadline)
        return MediumRead(inserted=bool(medium.inserted), image=medium.image)


class _Inventory:
    def __init__(self, bmc: RedfishSession) -> None:
        self.bmc = bmc

    async def inventory(self, *, deadline: float) -> BmcInventoryResult:
        def read() -> BmcInventoryResult:
            system = self.bmc.system(deadline)
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
) -> Driver:
    """A Redfish driver for one command: one session shared by its four interfaces.
    ``call_timeout``: at most this long for one HTTP exchange; ``read_back``: how long a power
    on or off whose answer was lost is read back before it is sent again."""
    bmc = RedfishSession(target, credentials, call_timeout=call_timeout, read_back=read_back)
    return Driver(
        name="redfish",
        power=_Power(bmc),
        management=_Management(bmc),
        inventory=_Inventory(bmc),
        media=_Media(bmc),
        close=bmc.close,
    )


class _OneShotAdapter(requests.adapters.HTTPAdapter):
    """requests' adapter for the BMC: the agent is asked before each request, and no connection
    carries a second one.

    Before each request, not only before each try: one sushy call may read a resource and then
    act on it, and a cancel that reached the agent during the read must stop the action
    (``before_call_blocking`` raises ``CommandCancelled``).

    One request per connection, as sushy's ``Connection: close`` asks: a BMC that closes as
    asked but late, without ``Connection: close`` in its answer, leaves a connection that
    urllib3 takes for keep-alive. The next request, written into it while the BMC closes it
    unread, fails like a request whose answer was lost: a POST action then counts as "may have
    applied" and is not repeated (seen against a BMC proxy under load). So the pools are
    emptied after every request (the connection still reading its answer is closed when it
    comes back), and a request that never left fails at connect (``_never_sent``).
    """

    def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        before_call_blocking(f"{request.method} {urlsplit(request.url).path}")
        try:
            return super().send(request, *args, **kwargs)
        finally:
            self.poolmanager.clear()


class _Connector(sushy.connector.Connector):  # type: ignore[misc]  # sushy ships no type hints
    """sushy's connector with ``_OneShotAdapter`` mounted on its session (as sushy mounts its
    own TLS adapter there)."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        adapter = _OneShotAdapter()
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)


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


def _never_sent(exc: BaseException) -> bool:
    """Whether a connection error happened before the request left: refused, the name not
    resolved, the connect timing out. A connection lost or a read timing out afterwards is not.
    This holds because every request opens its own connection (``_OneShotAdapter``),
    so none is written into a keep-alive socket the BMC is closing (which would fail like a lost
    answer); tests/integration/test_site_agent_drivers.py checks it.
    (sushy raises its ConnectionError inside the ``except`` of the requests error, which
    requests raised from urllib3's: the chain holds the cause.)"""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, requests.exceptions.ConnectTimeout | urllib3.exceptions.NewConnectionError):
            return True  # NameResolutionError is a NewConnectionError
        if isinstance(e, urllib3.exceptions.ConnectTimeoutError):
            return True
        if isinstance(e, urllib3.exceptions.MaxRetryError) and e.reason is not None:
            todo.append(e.reason)
        todo.extend(a for a in e.args if isinstance(a, BaseException))
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return False


def _cause(exc: BaseException) -> str:
    text = str(exc)
    for marker in ("timed out", "Read timed out", "Connection refused", "Name or service not known"):
        if marker.lower() in text.lower():
            return marker.lower()
    if "SSL" in text or "CERTIFICATE" in text.upper():
        return "TLS verification failed"
    return type(exc).__name__
