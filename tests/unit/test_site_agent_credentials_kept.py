"""The site agent keeps a BMC credential it fetched for the node's next commands, for
``bmc.credentials_keep_seconds`` after the fetch, and drops one the BMC refuses (issue 25: each
fetch is three signed requests and five statements, and a deploy sends a node five commands)."""

from __future__ import annotations

import json
import time
from typing import Any, cast

import pytest

from bc_site_agent import handlers as handlers_module
from bc_site_agent.drivers import driver_error
from bc_site_agent.handlers import SiteHandlers
from better_compute.agent import Command
from better_compute.core.errors import BcError
from better_compute.wire.commands import BmcCheck, BootDeviceResult

pytestmark = pytest.mark.unit

A = "sec_" + "A" * 26
B = "sec_" + "B" * 26


class _Gate:
    """bc-secrets' fetch gate: counts the fetches, answers each reference's value."""

    def __init__(self) -> None:
        self.fetches: list[str] = []

    async def fetch(self, *, ref: str, identity: Any) -> bytes:
        self.fetches.append(ref)
        return json.dumps({"username": "admin", "password": f"pw-of-{ref}"}).encode()


class _Driver:
    def __init__(self, used: list[str], credentials: Any, *, refuse: bool) -> None:
        self.used, self.credentials, self.refuse = used, credentials, refuse

    async def set_boot_device(self, payload: Any, *, deadline: float) -> BootDeviceResult:
        self.used.append(self.credentials.password)
        if self.refuse:
            raise driver_error(
                "PATCH System.Boot", "HTTP 401: the BMC refused the credentials", credentials="refused"
            )
        return BootDeviceResult(driver="redfish", device="disk", persistent=False)

    async def validate(self, *, deadline: float) -> list[BmcCheck]:
        self.used.append(self.credentials.password)
        return [BmcCheck(check="credentials", status="ok", message="taken")]

    async def close(self) -> None:
        return None


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _command(ref: str, kind: str = "management.setBootDevice") -> Command:
    bmc = {"driver": "redfish", "address": "https://bmc", "systemId": "s1", "credentialsRef": ref}
    payload: dict[str, Any] = (
        {"bmc": bmc, "device": "disk"} if kind != "management.validate" else {"bmc": bmc}
    )
    return Command(
        id="cmd_1", kind=kind, payload=payload, node_id="node_1", site_id="lab1", key=kind,
        destructive=False, not_after=time.time() + 30, batch_id=None, workflow_id=None, step=None,
        _agent=cast(Any, None),
    )  # fmt: skip


def _site(monkeypatch: pytest.MonkeyPatch, keep: float, *, refuse: set[str] | None = None) -> tuple[
    SiteHandlers, _Gate, _Clock, list[str]
]:  # fmt: skip
    used: list[str] = []
    refused = refuse if refuse is not None else set()
    monkeypatch.setattr(
        handlers_module,
        "make_driver",
        lambda target, credentials, **_kw: _Driver(
            used, credentials, refuse=target.credentials_ref in refused
        ),
    )
    gate, clock = _Gate(), _Clock()
    site = SiteHandlers(
        secrets=cast(Any, gate), identity=cast(Any, None), entries=cast(Any, None), cache=cast(Any, None),
        public_url="http://site", relay=cast(Any, None), credentials_keep_s=keep, clock=clock,
    )  # fmt: skip
    return site, gate, clock, used


async def test_a_nodes_commands_within_the_keep_fetch_once_and_after_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    site, gate, clock, used = _site(monkeypatch, keep=300)
    boot = site.handlers()["management.setBootDevice"]
    for _ in range(5):  # a deploy's commands, a few seconds apart
        await boot(_command(A))
        clock.now += 20
    assert gate.fetches == [A]
    assert used == [f"pw-of-{A}"] * 5
    await boot(_command(B))  # another node's credential is its own fetch
    assert gate.fetches == [A, B]
    clock.now += 300  # past the keep since the fetch (using it did not extend it)
    await boot(_command(A))
    assert gate.fetches == [A, B, A]
    assert (site.credentials_fetched, site.credentials_kept_used) == (3, 4)


async def test_a_keep_of_zero_fetches_for_each_command(monkeypatch: pytest.MonkeyPatch) -> None:
    site, gate, _clock, _used = _site(monkeypatch, keep=0)
    boot = site.handlers()["management.setBootDevice"]
    for _ in range(3):
        await boot(_command(A))
    assert gate.fetches == [A] * 3


async def test_a_credential_the_bmc_refuses_is_fetched_again_by_the_next_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = {A}
    site, gate, _clock, _used = _site(monkeypatch, keep=300, refuse=refused)
    boot = site.handlers()["management.setBootDevice"]
    with pytest.raises(BcError, match="refused the credentials"):
        await boot(_command(A))
    refused.clear()  # the BMC's password put right
    await boot(_command(A))
    assert gate.fetches == [A, A]
    await boot(_command(A))
    assert gate.fetches == [A, A]


async def test_validate_asks_the_gate_whatever_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    site, gate, _clock, _used = _site(monkeypatch, keep=300)
    table = site.handlers()
    await table["management.setBootDevice"](_command(A))
    result = await table["management.validate"](_command(A, "management.validate"))
    assert result.ok
    assert gate.fetches == [A, A]
