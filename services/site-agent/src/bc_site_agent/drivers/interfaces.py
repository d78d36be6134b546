"""A BMC driver as four small interfaces by concern (power, management, media, inventory), and
the operations written once over them.

An interface only asks and reads: ``request_power`` sends the reset, ``power_state`` reads the
state back. What a command means (an ``on`` of a machine that is on changes nothing; a change
is done once the BMC shows it, read until then or the command's deadline) is ``Driver``'s, the
same for every driver. Each interface method takes the command's payload Struct as the agent
decoded it (``better_compute.wire.commands``) and the command's deadline.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from better_compute.wire.commands import (
    BmcCheck,
    BmcInventoryResult,
    BootDeviceResult,
    MediaEject,
    MediaInsert,
    MediaResult,
    PowerResult,
    SetBootDevice,
    SetPower,
)

from .base import driver_error, poll_until

__all__ = [
    "BootRead",
    "Driver",
    "InventoryInterface",
    "ManagementInterface",
    "MediaInterface",
    "MediumRead",
    "PowerInterface",
]

_STATES = ("on", "off", "softOff")
"""Power actions that ask for a state (the rest, cycle and reset, are a change each time)."""


class BootRead(msgspec.Struct, frozen=True, kw_only=True):
    """The boot override as read back: ``device`` in our words (None when it is none of ours),
    ``target``/``enabled`` in the BMC's where it has them."""

    device: str | None
    target: str | None = None
    enabled: str | None = None


class MediumRead(msgspec.Struct, frozen=True, kw_only=True):
    inserted: bool
    image: str | None = None


class PowerInterface(Protocol):
    async def power_state(self, *, deadline: float) -> str:
        """The power state as the BMC spells it (``On``, ``off``)."""
        ...

    async def request_power(self, command: SetPower, *, before: str, deadline: float) -> None:
        """Send the power change (``before``: the state just read, for a cycle of a machine
        that is off)."""
        ...


class ManagementInterface(Protocol):
    async def request_boot_device(self, command: SetBootDevice, *, deadline: float) -> None: ...

    async def boot_device(self, *, deadline: float) -> BootRead: ...

    async def validate(self, *, deadline: float) -> list[BmcCheck]:
        """The checks of ``management.validate`` (reach, credentials, system, power), each
        ``ok``, ``failed`` or ``skipped``: nothing on the machine changes."""
        ...


class MediaInterface(Protocol):
    async def insert(self, command: MediaInsert, *, deadline: float) -> None: ...

    async def eject(self, command: MediaEject, *, deadline: float) -> None: ...

    async def medium(self, device: str, *, deadline: float) -> MediumRead: ...


class InventoryInterface(Protocol):
    async def inventory(self, *, deadline: float) -> BmcInventoryResult: ...


class Driver:
    """One driver for one command: its interfaces (``media`` None when it has none) and the
    operations over them. ``close`` drops the session, and with it the credentials."""

    def __init__(
        self,
        *,
        name: str,
        power: PowerInterface,
        management: ManagementInterface,
        inventory: InventoryInterface,
        media: MediaInterface | None,
        close: Callable[[], Awaitable[None]],
    ) -> None:
        self.name = name
        self.power = power
        self.management = management
        self.inventory_interface = inventory
        self.media = media
        self._close = close

    async def close(self) -> None:
        await self._close()

    async def set_power(self, command: SetPower, *, deadline: float) -> PowerResult:
        """Change the power, then read it until it is what the action asks for."""
        before = await self.power.power_state(deadline=deadline)
        want = "off" if command.action in ("off", "softOff") else "on"
        if command.action in _STATES and before.lower() == want:
            return PowerResult(driver=self.name, power_state=before, changed=False)
        await self.power.request_power(command, before=before, deadline=deadline)
        after = await poll_until(
            lambda: self.power.power_state(deadline=deadline),
            lambda state: state.lower() == want,
            deadline=deadline,
            what=f"power {command.action}: power state {want}",
        )
        return PowerResult(driver=self.name, power_state=after, changed=True)

    async def set_boot_device(self, command: SetBootDevice, *, deadline: float) -> BootDeviceResult:
        """Set the boot override, then read it until it shows the device."""
        await self.management.request_boot_device(command, deadline=deadline)
        got = await poll_until(
            lambda: self.management.boot_device(deadline=deadline),
            lambda read: read.device == command.device,
            deadline=deadline,
            what=f"boot device {command.device}",
        )
        return BootDeviceResult(
            driver=self.name,
            device=command.device,
            persistent=command.persistent,
            target=got.target,
            enabled=got.enabled,
        )

    async def media_insert(self, command: MediaInsert, *, deadline: float) -> MediaResult:
        """Insert the medium (``command.url``, maybe the site cache's), then read it back."""
        media = self._media()
        await media.insert(command, deadline=deadline)
        got = await media.medium(command.device, deadline=deadline)
        if not got.inserted or got.image != command.url:
            raise driver_error("read medium", "the medium does not show as inserted after the insert")
        return MediaResult(driver=self.name, device=command.device, inserted=True, image=got.image)

    async def media_eject(self, command: MediaEject, *, deadline: float) -> MediaResult:
        """Eject the medium when one is in, then read it back."""
        media = self._media()
        got = await media.medium(command.device, deadline=deadline)
        if got.inserted:
            await media.eject(command, deadline=deadline)
            got = await media.medium(command.device, deadline=deadline)
        if got.inserted:
            raise driver_error("read medium", "the medium still shows as inserted after the eject")
        return MediaResult(driver=self.name, device=command.device, inserted=False)

    async def inventory(self, *, deadline: float) -> BmcInventoryResult:
        return await self.inventory_interface.inventory(deadline=deadline)

    async def validate(self, *, deadline: float) -> list[BmcCheck]:
        return await self.management.validate(deadline=deadline)

    def _media(self) -> MediaInterface:
        if self.media is None:
            raise driver_error(
                "virtual media", f"the {self.name.upper()} driver has no virtual media (use Redfish)"
            )
        return self.media
