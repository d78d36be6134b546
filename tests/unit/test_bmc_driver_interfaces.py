"""A BMC driver is four interfaces in a table, and what a command means is ``Driver``'s, the same
for every driver (issue 24): a change is requested once and read back until the BMC shows it; an
``on`` of a machine that is on sends nothing."""

from __future__ import annotations

import time

import pytest

from bc_site_agent.drivers import DRIVERS, BmcCredentials, make_driver
from bc_site_agent.drivers.interfaces import BootRead, Driver, MediumRead
from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.commands import (
    BmcCheck,
    BmcInventoryResult,
    MediaEject,
    MediaInsert,
    PowerResult,
    SetBootDevice,
    SetPower,
)
from better_compute.wire.metal import NodeBmc

pytestmark = pytest.mark.unit


class SlowBmc:
    """Applies a change one read later, as a real BMC does, and records what it was asked."""

    def __init__(self, power: str = "off") -> None:
        self.power, self.boot, self.asked = power, "disk", list[str]()
        self.pending: tuple[str, str] | None = None
        self.image: str | None = None

    def _apply(self) -> None:
        if self.pending is not None:
            what, value = self.pending
            setattr(self, what, value)
            self.pending = None

    async def power_state(self, *, deadline: float) -> str:
        state = self.power
        self._apply()
        return state

    async def request_power(self, command: SetPower, *, before: str, deadline: float) -> None:
        self.asked.append(f"power {command.action} (was {before})")
        self.pending = ("power", "off" if command.action in ("off", "softOff") else "on")

    async def request_boot_device(self, command: SetBootDevice, *, deadline: float) -> None:
        self.asked.append(f"boot {command.device}")
        self.pending = ("boot", command.device)

    async def boot_device(self, *, deadline: float) -> BootRead:
        got = BootRead(device=self.boot, target=self.boot.upper())
        self._apply()
        return got

    async def validate(self, *, deadline: float) -> list[BmcCheck]:
        return []

    async def inventory(self, *, deadline: float) -> BmcInventoryResult:
        return BmcInventoryResult(driver="slow")

    async def insert(self, command: MediaInsert, *, deadline: float) -> None:
        self.asked.append(f"insert {command.url}")
        self.image = command.url

    async def eject(self, command: MediaEject, *, deadline: float) -> None:
        self.asked.append("eject")
        self.image = None

    async def medium(self, device: str, *, deadline: float) -> MediumRead:
        return MediumRead(inserted=self.image is not None, image=self.image)

    async def close(self) -> None:
        return None


def driver(bmc: SlowBmc, *, media: bool = True) -> Driver:
    return Driver(
        name="slow", power=bmc, management=bmc, inventory=bmc, media=bmc if media else None, close=bmc.close
    )


async def test_a_power_change_is_asked_once_and_read_back_until_the_bmc_shows_it() -> None:
    bmc = SlowBmc("off")
    got = await driver(bmc).set_power(SetPower(action="cycle"), deadline=time.time() + 10)
    assert got == PowerResult(driver="slow", power_state="on", changed=True)
    assert bmc.asked == ["power cycle (was off)"]
    again = await driver(bmc).set_power(SetPower(action="on"), deadline=time.time() + 10)
    assert again == PowerResult(driver="slow", power_state="on", changed=False)
    assert bmc.asked == ["power cycle (was off)"]  # nothing sent for a machine already on


async def test_a_bmc_that_never_shows_the_change_fails_at_the_deadline() -> None:
    bmc = SlowBmc("on")

    async def ignore(command: SetPower, *, before: str, deadline: float) -> None:
        bmc.asked.append("ignored")

    bmc.request_power = ignore  # type: ignore[method-assign]
    with pytest.raises(BcError) as err:
        await driver(bmc).set_power(SetPower(action="off"), deadline=time.time() + 1.2)
    assert err.value.code is ErrorCode.DRIVER_ERROR
    assert "did not converge" in err.value.message


async def test_boot_device_and_media_are_checked_after_the_change() -> None:
    bmc = SlowBmc()
    got = await driver(bmc).set_boot_device(SetBootDevice(device="pxe"), deadline=time.time() + 10)
    assert (got.device, got.target, got.persistent) == ("pxe", "PXE", False)
    media = await driver(bmc).media_insert(MediaInsert(url="http://x/a.iso"), deadline=time.time() + 10)
    assert (media.inserted, media.image) == (True, "http://x/a.iso")
    out = await driver(bmc).media_eject(MediaEject(), deadline=time.time() + 10)
    assert out.inserted is False
    await driver(bmc).media_eject(MediaEject(), deadline=time.time() + 10)  # nothing in: no eject sent
    assert bmc.asked == ["boot pxe", "insert http://x/a.iso", "eject"]
    with pytest.raises(BcError, match="no virtual media"):
        await driver(bmc, media=False).media_insert(
            MediaInsert(url="http://x/a.iso"), deadline=time.time() + 1
        )


async def test_the_table_opens_every_shipped_driver_and_the_sim_converges_like_the_others() -> None:
    assert list(DRIVERS) == ["redfish", "ipmi", "sim"]
    sim = make_driver(NodeBmc(driver="sim", address="sim-interfaces-1"), None)
    got = await sim.set_power(SetPower(action="cycle"), deadline=time.time() + 5)
    assert (got.power_state, got.changed) == ("On", True)
    with pytest.raises(BcError, match=r"no bmc\.credentialsRef"):
        make_driver(NodeBmc(driver="ipmi", address="10.0.0.9"), None)
    redfish = make_driver(
        NodeBmc(driver="redfish", address="10.0.0.9"), BmcCredentials(username="", password="")
    )
    assert redfish.media is not None
    await redfish.close()


async def test_the_redfish_driver_keeps_no_credential_and_at_most_its_bound_of_bmcs() -> None:
    """What the Redfish driver keeps of a BMC between commands (issue 25) holds no credential
    once the command ended; a command at once with another on the same BMC gets its own; the
    least recently used BMC is dropped past the bound."""
    from bc_site_agent.drivers.redfish import RedfishLinks, RedfishSession

    links = RedfishLinks(kept=2)
    bmc = NodeBmc(driver="redfish", address="http://192.0.2.7", system_id="S1")
    creds = BmcCredentials(username="root", password="pw-of-one-command")
    one = RedfishSession(bmc, creds, links=links)
    connector = one._connector(time.time() + 5)
    assert connector._session.auth == ("root", "pw-of-one-command")
    other = RedfishSession(bmc, creds, links=links)
    assert other.link is not one.link  # the first command still runs
    await one.close()
    await other.close()
    assert connector._session.auth is None
    assert one._credentials is None
    again = RedfishSession(bmc, creds, links=links)
    assert again.link is one.link
    assert again.link.connector is connector
    await again.close()

    for system in ("S2", "S3"):
        s = RedfishSession(
            NodeBmc(driver="redfish", address="http://192.0.2.7", system_id=system), creds, links=links
        )
        await s.close()
    assert len(links) == 2
    assert RedfishSession(bmc, creds, links=links).link is not one.link  # S1 was dropped
