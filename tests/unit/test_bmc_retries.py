"""Which BMC calls the site agent's drivers repeat: a non-idempotent action only when it never
reached the BMC, a read or an idempotent change on any transient error."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import requests
import sushy.connector
import sushy.exceptions

from bc_site_agent.drivers.base import Transient, retry_in_thread
from bc_site_agent.drivers.redfish import _never_sent
from better_compute.core.errors import BcError, ErrorCode
from better_compute.logging import get_logger
from better_compute.wire.metal import NodeBmc


class Flaky:
    """Raises the given errors one per call, then answers."""

    def __init__(self, *errors: Transient) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


LOG = get_logger(test="bmc-retries")


async def test_an_action_that_may_have_reached_the_bmc_is_not_repeated() -> None:
    lost = Transient("POST ComputerSystem.Reset(ForceRestart)", "cannot reach the BMC (ConnectionError)")
    run = Flaky(lost)
    with pytest.raises(BcError) as caught:
        await retry_in_thread(run, deadline=time.time() + 10, log=LOG, idempotent=False)
    assert caught.value.code is ErrorCode.DRIVER_ERROR
    assert caught.value.details["reason"] == (
        "POST ComputerSystem.Reset(ForceRestart): cannot reach the BMC (ConnectionError);"
        " not repeated: the BMC may have applied it"
    )
    assert run.calls == 1


async def test_an_action_that_never_left_is_repeated() -> None:
    refused = Transient(
        "POST VirtualMedia.InsertMedia", "cannot reach the BMC (refused)", maybe_applied=False
    )
    run = Flaky(refused, refused)
    assert await retry_in_thread(run, deadline=time.time() + 10, log=LOG, idempotent=False) == "done"
    assert run.calls == 3


async def test_reads_and_idempotent_changes_are_repeated_after_any_transient_error() -> None:
    run = Flaky(Transient("GET System.PowerState", "read timed out"), Transient("GET System", "HTTP 500"))
    assert await retry_in_thread(run, deadline=time.time() + 10, log=LOG) == "done"
    assert run.calls == 3


@pytest.fixture
def closing_server() -> Iterator[int]:
    """A port that accepts a connection, reads the request, and closes without an answer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conn.recv(65536)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    srv.close()


def sushy_error(url: str) -> sushy.exceptions.ConnectionError:
    conn = sushy.connector.Connector(url, verify=False, server_side_retries=1, server_side_retries_delay=0.01)
    try:
        conn.post("/redfish/v1/Systems/1/Actions/ComputerSystem.Reset", data={"ResetType": "On"})
    except sushy.exceptions.ConnectionError as exc:
        return exc
    finally:
        conn.close()
    raise AssertionError("the request went through")


def test_refused_and_unresolved_connections_never_sent_the_request(closing_server: int) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert _never_sent(sushy_error(f"http://127.0.0.1:{closed}"))
    assert _never_sent(sushy_error("http://no-such-bmc.invalid"))
    # the request went out and the connection closed before the answer: it may have been applied
    assert not _never_sent(sushy_error(f"http://127.0.0.1:{closing_server}"))
    assert not _never_sent(sushy.exceptions.ConnectionError(url="x", error=requests.ReadTimeout("read")))


async def test_ipmi_repeats_a_power_cycle_only_when_its_session_never_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pyghmi.exceptions import IpmiException

    from bc_site_agent.drivers.base import BmcCredentials
    from bc_site_agent.drivers.ipmi import IpmiSession

    driver = IpmiSession(
        NodeBmc(driver="ipmi", address="127.0.0.1:6230"), BmcCredentials(username="u", password="p")
    )
    sent: list[str] = []
    logins = iter([IpmiException("timeout"), None, None])

    class Session:
        def set_power(self, verb: str, wait: bool) -> dict[str, str]:
            sent.append(verb)
            raise IpmiException("Session no longer connected")  # sent; the answer never came

    def command() -> Session:
        failure = next(logins)
        if failure is not None:
            raise failure  # the login timed out: nothing was sent
        return Session()

    monkeypatch.setattr(driver, "_command", command)
    with pytest.raises(BcError) as caught:
        await driver.call(
            "Chassis Control (boot)", lambda c: c.set_power("boot", wait=False),
            deadline=time.time() + 10, idempotent=False,
        )  # fmt: skip
    assert sent == ["boot"]  # after the failed login it was sent once, and not again
    assert "may have applied it" in caught.value.details["reason"]


class LateSystem:
    """A Redfish system whose Reset answers are lost (read timeouts) ``lost`` times, and whose
    power state reads as ``states`` in turn."""

    def __init__(self, *states: str, lost: int) -> None:
        self.states = list(states)
        self.lost = lost
        self.resets: list[str] = []

    @property
    def power_state(self) -> str:
        return self.states.pop(0)

    def reset_system(self, reset: object) -> None:
        self.resets.append(str(getattr(reset, "value", reset)))
        if len(self.resets) <= self.lost:
            raise sushy.exceptions.ConnectionError(url="x", error=requests.ReadTimeout("read timed out"))


async def _request_power(
    monkeypatch: pytest.MonkeyPatch,
    system: LateSystem,
    action: str,
    *,
    read_back: float,
    before: str | None = None,
) -> None:
    from bc_site_agent.drivers.base import BmcCredentials
    from bc_site_agent.drivers.redfish import RedfishSession, _Power
    from better_compute.wire.commands import SetPower

    session = RedfishSession(
        NodeBmc(driver="redfish", address="http://127.0.0.1:1"),
        BmcCredentials(username="u", password="p"),
        read_back=read_back,
    )
    monkeypatch.setattr(session, "system", lambda deadline, fresh=False: system)
    await _Power(session).request_power(
        SetPower(action=action),  # type: ignore[arg-type]
        before=before or ("On" if action != "on" else "Off"),
        deadline=time.time() + 10,
    )


async def test_a_power_on_or_off_whose_answer_was_lost_is_read_back_then_sent_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On and off ask for a state: after a lost answer the state is read back; the BMC that got
    there is not asked again, the one that did not is (twice is the same state)."""
    applied = LateSystem("On", lost=1)
    await _request_power(monkeypatch, applied, "on", read_back=5)
    assert applied.resets == ["On"]
    assert applied.states == []  # read back once

    not_applied = LateSystem("On", lost=1)  # read back for 0 s: still on, so off is sent again
    await _request_power(monkeypatch, not_applied, "off", read_back=0)
    assert not_applied.resets == ["ForceOff", "ForceOff"]


async def test_a_cycle_of_a_machine_that_is_off_is_a_power_on_read_back_after_a_lost_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cycle of a machine that is off sends Reset(On): a state, read back after a lost answer
    like a power on (seen in the fleet benchmark: an emulator answering a Reset after the 10 s
    call timeout failed the commission's cycle of a machine that was off)."""
    system = LateSystem("On", lost=1)
    await _request_power(monkeypatch, system, "cycle", read_back=5, before="Off")
    assert system.resets == ["On"]  # sent once, then read back as on
    assert system.states == []


@pytest.mark.parametrize(("action", "reset"), [("cycle", "ForceRestart"), ("softOff", "GracefulShutdown")])
async def test_other_power_actions_whose_answer_was_lost_still_fail(
    monkeypatch: pytest.MonkeyPatch, action: str, reset: str
) -> None:
    system = LateSystem(lost=1)
    with pytest.raises(BcError) as caught:
        await _request_power(monkeypatch, system, action, read_back=5)
    assert "may have applied it" in caught.value.details["reason"]
    assert system.resets == [reset]  # sent once, nothing read back
