"""The sim driver: an in-memory machine per BMC address, for the simulator and demos."""

from __future__ import annotations

from typing import Any, ClassVar

from better_compute.agent import before_call

from .base import BmcCredentials, BmcTarget, driver_error

__all__ = ["SimDriver"]


class SimDriver:
    name = "sim"
    machines: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, target: BmcTarget, credentials: BmcCredentials | None) -> None:
        self.machine = self.machines.setdefault(
            target.address, {"power": "off", "boot": "disk", "persistent": True, "media": {}}
        )

    async def set_power(self, action: str, *, deadline: float) -> dict[str, Any]:
        await before_call("sim set_power")
        before = self.machine["power"]
        self.machine["power"] = "off" if action in ("off", "softOff") else "on"
        return {"powerState": self.machine["power"].capitalize(), "changed": before != self.machine["power"]}

    async def set_boot_device(
        self, device: str, *, persistent: bool, mode: str | None, deadline: float
    ) -> dict[str, Any]:
        await before_call("sim set_boot_device")
        self.machine.update(boot=device, persistent=persistent)
        return {"device": device, "persistent": persistent}

    async def media_insert(self, url: str, *, device: str, deadline: float) -> dict[str, Any]:
        await before_call("sim media_insert")
        self.machine["media"][device] = url
        return {"device": device, "inserted": True, "image": url}

    async def media_eject(self, *, device: str, deadline: float) -> dict[str, Any]:
        await before_call("sim media_eject")
        self.machine["media"].pop(device, None)
        return {"device": device, "inserted": False}

    async def validate(self, *, deadline: float) -> list[dict[str, Any]]:
        await before_call("sim validate")
        power = self.machine["power"].capitalize()
        return [
            {"check": "reach", "status": "ok", "message": "the simulated BMC answers"},
            {"check": "credentials", "status": "ok", "message": "the simulated BMC takes any"},
            {"check": "system", "status": "ok", "message": "one simulated system"},
            {"check": "power", "status": "ok", "message": f"power state {power}"},
        ]

    async def close(self) -> None:
        return None

    async def inventory(self, *, deadline: float) -> dict[str, Any]:
        if not self.machine:
            raise driver_error("inventory", "no machine")
        return {"system": {"powerState": self.machine["power"].capitalize()}, "processors": [], "nics": []}
