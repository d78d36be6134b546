"""The IPMI driver, on ``pyghmi``: power and boot device.

pyghmi is blocking (it runs its own UDP session loop): each call runs in a worker thread.
Timeouts and lost sessions are transient (retried with backoff and jitter until the deadline);
an IPMI completion code or a refused login is a ``DRIVER_ERROR`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Any, Final, TypeVar

from better_compute.core.errors import BcError
from better_compute.logging import get_logger

from .base import (
    BmcCredentials,
    BmcTarget,
    Transient,
    driver_error,
    malformed_answer,
    poll_until,
    power_converged,
    retry_in_thread,
)

__all__ = ["IpmiDriver"]

T = TypeVar("T")

_BOOT: Final = {"pxe": "network", "disk": "hd", "cd": "optical", "usb": "usb", "bios": "setup"}
_BOOT_BACK: Final = {v: k for k, v in _BOOT.items()}
_POWER: Final = {"on": "on", "off": "off", "softOff": "shutdown", "cycle": "boot", "reset": "reset"}


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


class IpmiDriver:
    name = "ipmi"

    def __init__(self, target: BmcTarget, credentials: BmcCredentials) -> None:
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
            from pyghmi.ipmi.command import Command  # imported late: it starts no thread until used

            self._cmd = Command(
                bmc=self.host,
                userid=self._credentials.username,
                password=self._credentials.password,
                port=self.port,
                keepalive=False,
            )
        return self._cmd

    async def _call(
        self, call: str, fn: Callable[[Any], T], *, deadline: float, idempotent: bool = True
    ) -> T:
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
                if "timeout" in low or "timed out" in low or "session no longer connected" in low:
                    self._cmd = None
                    raise Transient(call, "the BMC did not answer in time", maybe_applied=sent) from None
                if "password" in low or "unauthorized" in low or "user" in low or "auth" in low:
                    raise driver_error(call, "the BMC refused the credentials") from None
                raise driver_error(call, f"IPMI error: {text[:200]}") from None
            except BcError:
                raise
            except OSError as exc:
                self._cmd = None
                # refused (an ICMP port unreachable) or a name not resolved: nothing was taken
                unsent = not sent or isinstance(exc, ConnectionRefusedError | socket.gaierror)
                raise Transient(
                    call, f"cannot reach the BMC ({type(exc).__name__})", maybe_applied=not unsent
                ) from None
            except struct.error:
                # pyghmi fails this way in RAKP 2 when the BMC's key hash does not match ours
                self._cmd = None
                raise driver_error(call, "the BMC refused the login (wrong credentials?)") from None
            except (KeyError, TypeError, ValueError, AssertionError, IndexError) as exc:
                raise malformed_answer(call, exc) from None
            except Exception as exc:
                raise driver_error(call, f"IPMI failure ({type(exc).__name__})") from None

        return await retry_in_thread(run, deadline=deadline, log=self.log, idempotent=idempotent, what=call)

    async def _power_state(self, deadline: float) -> str:
        got = await self._call(
            "Get Chassis Status", lambda c: c.get_power().get("powerstate"), deadline=deadline
        )
        if got not in ("on", "off"):
            raise driver_error("Get Chassis Status", f"unexpected power state {got!r}")
        return str(got)

    async def set_power(self, action: str, *, deadline: float) -> dict[str, Any]:
        verb = _POWER.get(action)
        if verb is None:
            raise driver_error("Chassis Control", f"unknown action {action!r}")
        want = "off" if action in ("off", "softOff") else "on"
        before = await self._power_state(deadline)
        if action in ("on", "off", "softOff") and before == want:
            return {"powerState": before, "changed": False}
        # on, off and a soft off ask for a state (twice is the same); a cycle or reset twice is not
        await self._call(
            f"Chassis Control ({verb})",
            lambda c: c.set_power(verb, wait=False),
            deadline=deadline,
            idempotent=action in ("on", "off", "softOff"),
        )
        return await power_converged(
            lambda: self._power_state(deadline),
            want,
            deadline=deadline,
            what=f"power {action}: power state {want}",
        )

    async def set_boot_device(
        self, device: str, *, persistent: bool, mode: str | None, deadline: float
    ) -> dict[str, Any]:
        bootdev = _BOOT.get(device)
        if bootdev is None:
            raise driver_error("Set System Boot Options", f"boot device {device!r} is not supported")
        await self._call(
            "Set System Boot Options",
            lambda c: c.set_bootdev(bootdev, persist=persistent, uefiboot=mode == "uefi"),
            deadline=deadline,
        )

        async def read() -> str:
            got = await self._call(
                "Get System Boot Options", lambda c: c.get_bootdev().get("bootdev"), deadline=deadline
            )
            return str(got)

        got = await poll_until(
            read, lambda dev: dev == bootdev, deadline=deadline, what=f"boot device {device}"
        )
        return {"device": _BOOT_BACK.get(got, got), "persistent": persistent}

    async def close(self) -> None:
        cmd, self._cmd = self._cmd, None
        if cmd is not None:
            ipmi_session = getattr(cmd, "ipmi_session", None)
            if ipmi_session is not None:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(ipmi_session.logout)

    async def media_insert(self, url: str, *, device: str, deadline: float) -> dict[str, Any]:
        raise driver_error("virtual media", "the IPMI driver has no virtual media (use Redfish)")

    async def media_eject(self, *, device: str, deadline: float) -> dict[str, Any]:
        raise driver_error("virtual media", "the IPMI driver has no virtual media (use Redfish)")

    async def inventory(self, *, deadline: float) -> dict[str, Any]:
        state = await self._power_state(deadline)
        return {"system": {"powerState": state}, "processors": [], "memory": {}, "nics": []}
