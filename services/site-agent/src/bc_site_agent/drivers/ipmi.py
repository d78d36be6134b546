"""The IPMI driver, on ``pyghmi``: power and boot device.

pyghmi is blocking (it runs its own UDP session loop): each call runs in a worker thread.
Timeouts and lost sessions are transient (retried with backoff and jitter until the deadline);
an IPMI completion code or a refused login is a ``DRIVER_ERROR`` at once.

Each driver (one command) opens its own session and logs it out at ``close`` (a BMC has a few
session slots). pyghmi looks sessions up in class-wide caches, and one of them,
``Session.initting_sessions``, is keyed by the credentials as given (``str``) but cleaned with
them encoded (``bytes``): a session never leaves it, and the next ``Command`` to that BMC was
handed the logged-out one (``malformed answer (TypeError)``, nothing sent). ``_open_session``
takes that entry out itself, so no other command ever gets a session of ours. pyghmi's
``Session.__new__`` also prunes its ``bmc_handlers`` while a logout in another thread removes
from them (``KeyError`` with two commands at once on one BMC), so logins and logouts of one BMC
take turns (``_bmc_lock``); calls on open sessions do not wait for each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

from better_compute.core.errors import BcError
from better_compute.logging import get_logger
from better_compute.wire.commands import (
    BmcCheck,
    BmcInventoryResult,
    BmcMemory,
    BmcSystem,
    SetBootDevice,
    SetPower,
)
from better_compute.wire.metal import NodeBmc

from .base import (
    BmcCredentials,
    Checks,
    Transient,
    driver_error,
    failure_reason,
    malformed_answer,
    retry_in_thread,
)
from .interfaces import BootRead, Driver

__all__ = ["IpmiSession", "open_driver"]

T = TypeVar("T")

_BOOT: Final = {"pxe": "network", "disk": "hd", "cd": "optical", "usb": "usb", "bios": "setup"}
_BOOT_BACK: Final = {v: k for k, v in _BOOT.items()}
_POWER: Final = {"on": "on", "off": "off", "softOff": "shutdown", "cycle": "boot", "reset": "reset"}

# pyghmi's words (rmcp_codes) when the BMC refuses every cipher suite it proposes
_NO_CIPHER: Final = (
    "no cipher suite match",
    "invalid authentication algorithm",
    "invalid integrity algorithm",
    "invalid confidentiality algorithm",
    "no matching integrity payload",
)
_OFFERED: Final = "pyghmi offers cipher suites 17 (HMAC-SHA256, AES) and 3 (HMAC-SHA1, AES)"
_REFUSED_LOGIN: Final = ("incorrect password", "unauthorized name", "password", "unauthorized")

_locks_lock = threading.Lock()
_locks: dict[tuple[str, int], threading.Lock] = {}


def _bmc_lock(host: str, port: int) -> threading.Lock:
    """One login or logout at a time per BMC (see the module's docstring)."""
    with _locks_lock:
        return _locks.setdefault((host, port), threading.Lock())


def _open_session(host: str, port: int, username: str, password: str) -> Any:
    """A logged-in pyghmi ``Command`` on a session of its own (see the module's docstring)."""
    from pyghmi.ipmi.command import Command  # imported late: it starts no thread until used
    from pyghmi.ipmi.private.session import Session

    key = (host, username, password, port, None)
    with _bmc_lock(host, port):
        Session.initting_sessions.pop(key, None)  # a leftover of a login that failed
        try:
            return Command(bmc=host, userid=username, password=password, port=port, keepalive=False)
        finally:
            Session.initting_sessions.pop(key, None)


def _split(address: str) -> tuple[str, int]:
    host, port = address, 623
    if address.startswith("["):  # [v6]:port
        host, _, rest = address[1:].partition("]")
        if rest.startswith(":"):
            port = int(rest[1:])
    elif address.count(":") == 1:
        host, _, p = address.partition(":")
        port = int(p)
    return host, port


def _os_reason(exc: OSError) -> str:
    """A socket error in a few words for the command's progress."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return "name not resolved"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return exc.strerror.lower() if exc.strerror else type(exc).__name__


class IpmiSession:
    """One command's IPMI session; it is also the driver's power, management and inventory
    interfaces (IPMI has no virtual media)."""

    def __init__(self, target: NodeBmc, credentials: BmcCredentials) -> None:
        self.target = target
        self._credentials = credentials
        try:
            self.host, self.port = _split(target.address.removeprefix("ipmi://"))
        except ValueError:
            raise driver_error("IPMI address", "the BMC address is not host[:port]") from None
        self._cmd: Any = None
        self.log = get_logger(driver="ipmi", bmc=f"{self.host}:{self.port}")

    def _command(self) -> Any:
        if self._cmd is None:
            self._cmd = _open_session(
                self.host, self.port, self._credentials.username, self._credentials.password
            )
        return self._cmd

    async def call(self, call: str, fn: Callable[[Any], T], *, deadline: float, idempotent: bool = True) -> T:
        """One IPMI exchange in a thread. The session (login) is opened first: a failure there
        never sent ``fn``'s request, so even a call that is not ``idempotent`` (a power cycle)
        is repeated after it; a timeout after the request went out may have applied it."""

        def run() -> T:
            from pyghmi import exceptions as pyghmi_exc

            sent = False
            try:
                cmd = self._command()
                sent = True
                return fn(cmd)
            except pyghmi_exc.IpmiException as exc:
                text = str(exc)
                low = text.lower()
                # pyghmi gives up a login the BMC never answered with no words at all (its
                # session is marked broken without an error): a BMC that is away, as a timeout
                silent = not exc.args or exc.args[0] is None
                if silent or "timeout" in low or "timed out" in low or "session no longer connected" in low:
                    self._cmd = None
                    raise Transient(
                        call,
                        "the BMC did not answer in time",
                        maybe_applied=sent,
                        reason="no answer (timed out)",
                    ) from None
                if any(words in low for words in _NO_CIPHER):
                    raise driver_error(
                        call, f"no cipher suite in common with the BMC ({text[:120]}; {_OFFERED})"
                    ) from None
                if any(words in low for words in _REFUSED_LOGIN):
                    raise driver_error(
                        call, "the BMC refused the credentials", credentials="refused"
                    ) from None
                raise driver_error(call, f"IPMI error: {text[:200]}") from None
            except BcError:
                raise
            except OSError as exc:
                self._cmd = None
                # refused (an ICMP port unreachable) or a name not resolved: nothing was taken
                unsent = not sent or isinstance(exc, ConnectionRefusedError | socket.gaierror)
                raise Transient(
                    call,
                    f"cannot reach the BMC ({type(exc).__name__})",
                    maybe_applied=not unsent,
                    reason=_os_reason(exc),
                ) from None
            except struct.error:
                # pyghmi fails this way in RAKP 2 when the BMC's key exchange hash is not as long
                # as the agreed algorithm's: the BMC uses another cipher suite than it accepted
                # (wrong credentials give a hash of the right length that does not match)
                self._cmd = None
                raise driver_error(
                    call,
                    "cipher suite mismatch: the BMC accepted one and answered with another "
                    f"(its RAKP 2 hash has the wrong length; {_OFFERED})",
                ) from None
            except (KeyError, TypeError, ValueError, AssertionError, IndexError) as exc:
                raise malformed_answer(call, exc) from None
            except Exception as exc:
                raise driver_error(call, f"IPMI failure ({type(exc).__name__})") from None

        return await retry_in_thread(
            run,
            deadline=deadline,
            log=self.log,
            idempotent=idempotent,
            what=call,
            at=f"{self.host}:{self.port}",
        )

    async def power_state(self, *, deadline: float) -> str:
        got = await self.call(
            "Get Chassis Status", lambda c: c.get_power().get("powerstate"), deadline=deadline
        )
        if got not in ("on", "off"):
            raise driver_error("Get Chassis Status", f"unexpected power state {got!r}")
        return str(got)

    async def request_power(self, command: SetPower, *, before: str, deadline: float) -> None:
        verb = _POWER[command.action]
        # on, off and a soft off ask for a state (twice is the same); a cycle or reset twice is not
        await self.call(
            f"Chassis Control ({verb})",
            lambda c: c.set_power(verb, wait=False),
            deadline=deadline,
            idempotent=command.action in ("on", "off", "softOff"),
        )

    async def request_boot_device(self, command: SetBootDevice, *, deadline: float) -> None:
        bootdev = _BOOT[command.device]
        await self.call(
            "Set System Boot Options",
            lambda c: c.set_bootdev(bootdev, persist=command.persistent, uefiboot=command.mode == "uefi"),
            deadline=deadline,
        )

    async def boot_device(self, *, deadline: float) -> BootRead:
        got = await self.call(
            "Get System Boot Options", lambda c: c.get_bootdev().get("bootdev"), deadline=deadline
        )
        return BootRead(device=_BOOT_BACK.get(str(got)))

    async def close(self) -> None:
        cmd, self._cmd = self._cmd, None
        ipmi_session = getattr(cmd, "ipmi_session", None) if cmd is not None else None
        if ipmi_session is not None:

            def logout() -> None:
                with _bmc_lock(self.host, self.port):
                    ipmi_session.logout()

            with contextlib.suppress(Exception):
                await asyncio.to_thread(logout)

    async def validate(self, *, deadline: float) -> list[BmcCheck]:
        checks = Checks()
        at = f"{self.host}:{self.port}"
        try:  # a session: the BMC answers and takes the credentials (RAKP)
            await self.call("Open Session", lambda c: None, deadline=deadline)
        except BcError as err:
            reason = failure_reason(err)
            if "credentials" in reason or "cipher" in reason:
                checks.ok("reach", f"the IPMI BMC at {at} answers")
                checks.fail("credentials", reason)
            else:
                checks.fail("reach", f"{at}: {reason}")
                checks.skip("credentials")
            return checks.skip("system", "power")
        checks.ok("reach", f"the IPMI BMC at {at} answers")
        checks.ok("credentials", "the BMC takes the credentials")
        checks.ok("system", "an IPMI BMC has one system")
        try:
            power = await self.power_state(deadline=deadline)
        except BcError as err:
            checks.fail("power", failure_reason(err))
        else:
            checks.ok("power", f"power state {power}")
        return checks.items

    async def inventory(self, *, deadline: float) -> BmcInventoryResult:
        state = await self.power_state(deadline=deadline)
        system = BmcSystem(power_state=state)
        return BmcInventoryResult(driver="ipmi", system=system, processors=[], memory=BmcMemory(), nics=[])


def open_driver(target: NodeBmc, credentials: BmcCredentials) -> Driver:
    """An IPMI driver for one command: power, boot device and inventory on one session, no media."""
    ipmi = IpmiSession(target, credentials)
    return Driver(name="ipmi", power=ipmi, management=ipmi, inventory=ipmi, media=None, close=ipmi.close)
