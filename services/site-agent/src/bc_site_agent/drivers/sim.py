"""The sim driver: an in-memory machine per BMC address, for the simulator and demos."""

from __future__ import annotations

from typing import ClassVar

import msgspec

from better_compute.agent import before_call
from better_compute.wire.commands import (
    BmcCheck,
    BmcInventoryResult,
    BmcSystem,
    MediaEject,
    MediaInsert,
    SetBootDevice,
    SetPower,
)
from better_compute.wire.metal import NodeBmc

from .interfaces import BootRead, Driver, MediumRead

__all__ = ["SimMachine", "open_driver"]


class SimMachine(msgspec.Struct, kw_only=True):
    power: str = "off"
    boot: str = "disk"
    persistent: bool = True
    media: dict[str, str] = msgspec.field(default_factory=dict)


class _Sim:
    """All four interfaces of one simulated BMC."""

    machines: ClassVar[dict[str, SimMachine]] = {}

    def __init__(self, target: NodeBmc) -> None:
        self.machine = self.machines.setdefault(target.address, SimMachine())

    async def power_state(self, *, deadline: float) -> str:
        await before_call("sim power_state")
        return self.machine.power.capitalize()

    async def request_power(self, command: SetPower, *, before: str, deadline: float) -> None:
        await before_call("sim set_power")
        self.machine.power = "off" if command.action in ("off", "softOff") else "on"

    async def request_boot_device(self, command: SetBootDevice, *, deadline: float) -> None:
        await before_call("sim set_boot_device")
        self.machine.boot, self.machine.persistent = command.device, command.persistent

    async def boot_device(self, *, deadline: float) -> BootRead:
        return BootRead(device=self.machine.boot)

    async def insert(self, command: MediaInsert, *, deadline: float) -> None:
        await before_call("sim media_insert")
        self.machine.media[command.device] = command.url or ""

    async def eject(self, command: MediaEject, *, deadline: float) -> None:
        await before_call("sim media_eject")
        self.machine.media.pop(command.device, None)

    async def medium(self, device: str, *, deadline: float) -> MediumRead:
        image = self.machine.media.get(device)
        return MediumRead(inserted=image is not None, image=image)

    async def validate(self, *, deadline: float) -> list[BmcCheck]:
        await before_call("sim validate")
        power = self.machine.power.capitalize()
        return [
            BmcCheck(check="reach", status="ok", message="the simulated BMC answers"),
            BmcCheck(check="credentials", status="ok", message="the simulated BMC takes any"),
            BmcCheck(check="system", status="ok", message="one simulated system"),
            BmcCheck(check="power", status="ok", message=f"power state {power}"),
        ]

    async def inventory(self, *, deadline: float) -> BmcInventoryResult:
        system = BmcSystem(power_state=self.machine.power.capitalize())
        return BmcInventoryResult(driver="sim", system=system, processors=[], nics=[])

    async def close(self) -> None:
        return None


def open_driver(target: NodeBmc) -> Driver:
    sim = _Sim(target)
    return Driver(name="sim", power=sim, management=sim, inventory=sim, media=sim, close=sim.close)
