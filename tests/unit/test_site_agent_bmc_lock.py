"""The site agent runs one BMC command at a time per system.

An abort's undo sends its boot-device and power-off commands together. At sushy-emulator (whose
store keeps a system as one record, read, changed and written back by each request), the
boot-device write that had read the system before the power-off landed wrote the power back
on: the machine the abort had just turned off came back on (test_metal_abort, seen in CI).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from bc_site_agent import handlers as handlers_module
from bc_site_agent.handlers import SiteHandlers
from better_compute.agent import Command
from better_compute.wire.commands import BootDeviceResult, PowerResult

pytestmark = pytest.mark.unit


class _Driver:
    """Records when each call on a system starts and ends, and takes a while."""

    def __init__(self, calls: list[tuple[str, str, float, float]], system: str) -> None:
        self.calls, self.system = calls, system

    async def _call(self, what: str) -> None:
        began = time.monotonic()
        await asyncio.sleep(0.05)
        self.calls.append((self.system, what, began, time.monotonic()))

    async def set_power(self, payload: Any, *, deadline: float) -> PowerResult:
        await self._call("power")
        return PowerResult(driver="sim", power_state="Off", changed=True)

    async def set_boot_device(self, payload: Any, *, deadline: float) -> BootDeviceResult:
        await self._call("boot")
        return BootDeviceResult(driver="sim", device="disk", persistent=False)

    async def close(self) -> None:
        return None


def _command(kind: str, payload: dict[str, Any]) -> Command:
    return Command(
        id=f"cmd_{kind}", kind=kind, payload=payload, node_id="node_1", site_id="lab1", key=kind,
        destructive=False, not_after=time.time() + 30, batch_id=None, workflow_id=None, step=None,
        _agent=cast(Any, None),
    )  # fmt: skip


async def test_two_commands_on_one_system_take_turns_and_other_systems_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, str, float, float]] = []
    monkeypatch.setattr(
        handlers_module, "make_driver", lambda target, credentials: _Driver(calls, target.system_id or "")
    )
    site = SiteHandlers(
        secrets=cast(Any, None), identity=cast(Any, None), entries=cast(Any, None),
        cache=cast(Any, None), public_url="http://site", relay=cast(Any, None),
    )  # fmt: skip
    table = site.handlers()

    def bmc(system: str) -> dict[str, Any]:
        return {"driver": "sim", "address": "http://bmc", "systemId": system}

    await asyncio.gather(
        table["management.setBootDevice"](
            _command("management.setBootDevice", {"bmc": bmc("s1"), "device": "disk"})
        ),
        table["power.setPower"](_command("power.setPower", {"bmc": bmc("s1"), "action": "off"})),
        table["power.setPower"](_command("power.setPower", {"bmc": bmc("s2"), "action": "off"})),
    )

    one = sorted((c for c in calls if c[0] == "s1"), key=lambda c: c[2])
    assert [c[1] for c in one] == ["boot", "power"]
    assert one[0][3] <= one[1][2], "the power-off started before the boot-device write ended"
    other = next(c for c in calls if c[0] == "s2")
    assert other[2] < one[0][3], "another system's command waited for this one's"
