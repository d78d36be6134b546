"""The site agent's BMC drivers against other people's BMCs, each its own process:
sushy-emulator (fake driver, power lands 1-11 s late) behind a proxy that can misbehave, and
pyghmi's own IPMI BMC on a loopback UDP port. What a user notices: the BMC's state changed (read
back from the BMC itself), or a DRIVER_ERROR whose reason names the BMC call."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from base64 import b64encode
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bc_site_agent.drivers import BmcCredentials, Driver, make_driver
from bc_site_agent.drivers.redfish import RedfishLinks
from bc_site_agent.drivers.redfish import open_driver as open_redfish
from better_compute.core.errors import BcError, ErrorCode
from better_compute.runtime.embedded import free_port
from better_compute.testing import until
from better_compute.testing.bmcs import SYSTEM_MACS, SYSTEM_UUID, FaultyProxy, IpmiBmc, RedfishEmulator
from better_compute.wire.commands import MediaEject, MediaInsert, SetBootDevice, SetPower
from better_compute.wire.metal import NodeBmc


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedfishEmulator]:
    emu = RedfishEmulator(tmp_path_factory.mktemp("redfish")).start()
    yield emu
    emu.close()


@pytest.fixture
def proxy(emulator: RedfishEmulator, tmp_path: Path) -> Iterator[FaultyProxy]:
    p = FaultyProxy(tmp_path / "proxy", emulator.url).start()
    yield p
    p.close()


def bmc_get(emulator: RedfishEmulator, path: str) -> dict[str, object]:
    """Read the BMC's own view, as an operator would with curl."""
    req = urllib.request.Request(emulator.url + path)
    auth = b64encode(f"{emulator.username}:{emulator.password}".encode()).decode()
    req.add_header("Authorization", f"Basic {auth}")
    with urllib.request.urlopen(req, timeout=5) as resp:
        doc: dict[str, object] = json.loads(resp.read())
        return doc


def redfish(url: str, emulator: RedfishEmulator, *, password: str | None = None, **kw: object) -> Driver:
    target = NodeBmc(driver="redfish", address=url, **kw)  # type: ignore[arg-type]
    return make_driver(
        target, BmcCredentials(username=emulator.username, password=password or emulator.password)
    )


def _cd_path(emulator: RedfishEmulator) -> str:
    """The system's virtual CD as the BMC lists it (sushy-emulator: under the system)."""
    media = bmc_get(emulator, f"{system_path()}/VirtualMedia")["Members"]
    return next(m["@odata.id"] for m in media if m["@odata.id"].endswith("/Cd"))  # type: ignore[attr-defined]


def system_path() -> str:
    return f"/redfish/v1/Systems/{SYSTEM_UUID}"


async def test_redfish_power_boot_media_inventory_converge_at_the_bmc(
    emulator: RedfishEmulator, proxy: FaultyProxy, tmp_path: Path
) -> None:
    iso = b"fake-iso-bytes" * 100
    server = _serve_bytes(iso)
    try:
        driver = redfish(proxy.url, emulator)
        deadline = time.time() + 60
        got = await driver.set_power(SetPower(action="on"), deadline=deadline)
        assert got.power_state == "On"
        assert bmc_get(emulator, system_path())["PowerState"] == "On"

        got = await driver.set_power(SetPower(action="cycle"), deadline=time.time() + 60)
        assert (got.power_state, got.changed) == ("On", True)
        assert (
            sum(" ComputerSystem.Reset" in r or "Actions/ComputerSystem.Reset" in r for r in proxy.requests())
            == 2
        )

        await driver.set_boot_device(SetBootDevice(device="pxe", persistent=False), deadline=time.time() + 30)
        boot = bmc_get(emulator, system_path())["Boot"]
        assert boot["BootSourceOverrideTarget"] == "Pxe"  # type: ignore[index]
        # sushy-emulator always shows "Continuous"; what the BMC was asked for is what we can see
        patch = [b for b in proxy.bodies() if b.startswith("PATCH")][-1]
        assert '"BootSourceOverrideEnabled": "Once"' in patch

        url = f"http://127.0.0.1:{server.server_port}/media.iso"
        got = await driver.media_insert(MediaInsert(url=url, device="cd"), deadline=time.time() + 30)
        assert got.inserted is True
        got = await driver.media_eject(MediaEject(device="cd"), deadline=time.time() + 30)
        assert got.inserted is False

        # each POST action went out on a connection of its own (sushy sends "Connection: close"):
        # on a keep-alive one the BMC closed while idle, a POST that never left would look like
        # one whose answer was lost, and would not be repeated
        taken = [line.split() for line in proxy.requests()]
        actions = [i for i, (method, *_rest) in enumerate(taken) if method == "POST"]
        assert len(actions) == 4  # the two Resets, InsertMedia, EjectMedia
        for i in actions:
            assert all(earlier[2] != taken[i][2] for earlier in taken[:i]), (taken[i], taken[:i])

        inv = await driver.inventory(deadline=time.time() + 30)
        assert inv.system.uuid == SYSTEM_UUID
        assert sorted(n.mac for n in inv.nics) == sorted(SYSTEM_MACS)
        await driver.close()
    finally:
        server.shutdown()
        server.server_close()


async def test_an_action_never_goes_on_a_connection_the_bmc_is_closing(
    emulator: RedfishEmulator, proxy: FaultyProxy
) -> None:
    """sushy asks every BMC to close each connection; a BMC that does so late, without saying
    so, leaves a pooled connection that looks reusable. A POST action written into it is lost
    unread, and then looks like one whose answer was lost: refused as "may have applied". An
    action gets a connection of its own, opened for it and closed after it (the GETs of a
    command share one: a GET is simply repeated)."""
    iso = b"fake-iso-bytes" * 100
    server = _serve_bytes(iso)
    try:
        proxy.set(mode="linger-close", seconds=1.0)
        driver = redfish(proxy.url, emulator)
        url = f"http://127.0.0.1:{server.server_port}/linger.iso"
        got = await driver.media_insert(MediaInsert(url=url, device="cd"), deadline=time.time() + 60)
        assert (got.inserted, got.image) == (True, url)
        got = await driver.set_power(SetPower(action="cycle"), deadline=time.time() + 60)
        assert got.changed is True
        await driver.media_eject(MediaEject(device="cd"), deadline=time.time() + 60)
        await driver.close()
        taken = [line.split() for line in proxy.requests()]
        actions = [path.rsplit("/", 1)[1] for method, path, *_ in taken if method == "POST"]
        assert actions == ["VirtualMedia.InsertMedia", "ComputerSystem.Reset", "VirtualMedia.EjectMedia"]
        shared = Counter(conn for _, _, conn, _ in taken)
        assert all(shared[conn] == 1 for method, _, conn, _ in taken if method != "GET"), taken  # alone
    finally:
        proxy.set(mode="forward")
        server.shutdown()
        server.server_close()


async def test_a_bmc_that_answers_500_for_a_while_then_recovers(
    emulator: RedfishEmulator, proxy: FaultyProxy
) -> None:
    proxy.set(mode="error-count", left=6, status=503)
    driver = redfish(proxy.url, emulator)
    got = await driver.set_boot_device(
        SetBootDevice(device="disk", persistent=True), deadline=time.time() + 30
    )
    assert got.target == "Hdd"
    await driver.close()
    modes = [line.rsplit(" ", 1)[1] for line in proxy.requests()]
    assert modes.count("error") == 6  # six 503s answered, then it went through
    assert modes[-1] == "forward"
    patch = [b for b in proxy.bodies() if b.startswith("PATCH")][-1]
    assert '"BootSourceOverrideEnabled": "Continuous"' in patch


async def driver_error(call: object) -> BcError:
    try:
        await call  # type: ignore[misc]
    except BcError as err:
        return err
    finally:
        owner = getattr(call, "cr_frame", None)
        driver = owner.f_locals.get("self") if owner is not None else None
        if driver is not None:
            await driver.close()
    raise AssertionError("no error")


async def test_bmc_errors_are_driver_errors_that_name_the_call(
    emulator: RedfishEmulator, proxy: FaultyProxy
) -> None:
    err = await driver_error(
        redfish(proxy.url, emulator, password="wrong-password").inventory(deadline=time.time() + 5)
    )
    assert err.code is ErrorCode.DRIVER_ERROR
    assert "401" in err.details["reason"]
    assert "GET System inventory" in err.details["reason"]
    assert "wrong-password" not in str(err)
    assert "wrong-password" not in json.dumps(err.details)

    err = await driver_error(
        redfish(proxy.url, emulator, system_id="no-such").inventory(deadline=time.time() + 5)
    )
    assert err.code is ErrorCode.DRIVER_ERROR
    assert "404" in err.details["reason"]

    proxy.set(mode="malformed")
    err = await driver_error(
        redfish(proxy.url, emulator).set_power(SetPower(action="on"), deadline=time.time() + 5)
    )
    assert err.code is ErrorCode.DRIVER_ERROR
    assert "malformed" in err.details["reason"]
    assert "GET System.PowerState" in err.details["reason"]

    proxy.set(mode="error", status=500)
    t0 = time.monotonic()
    err = await driver_error(
        redfish(proxy.url, emulator).set_power(SetPower(action="on"), deadline=time.time() + 3)
    )
    assert err.code is ErrorCode.DRIVER_ERROR
    assert "HTTP 500" in err.details["reason"]
    assert "deadline" in err.details["reason"]
    assert time.monotonic() - t0 < 6
    assert len(proxy.requests()) > 3  # retried, not given up at once

    proxy.set(mode="hang", seconds=20)
    t0 = time.monotonic()
    err = await driver_error(
        redfish(proxy.url, emulator).set_power(SetPower(action="on"), deadline=time.time() + 3)
    )
    assert err.code is ErrorCode.DRIVER_ERROR
    assert "timed out" in err.details["reason"]
    assert time.monotonic() - t0 < 8


async def test_tls_is_verified_by_default(emulator: RedfishEmulator) -> None:
    # A plain-HTTP BMC spoken to as https:// fails the handshake: never silently downgraded.
    port = emulator.url.rsplit(":", 1)[1]
    err = await driver_error(
        redfish(f"https://127.0.0.1:{port}", emulator).inventory(deadline=time.time() + 5)
    )
    assert err.code is ErrorCode.DRIVER_ERROR


async def test_the_environments_proxy_settings_are_read_once_a_bmc_and_still_honoured(
    emulator: RedfishEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """requests read the proxy variables for every request (walking os.environ: 8% of a site
    agent's CPU in a deploy); a BMC's connection reads them once. What they say still holds:
    a proxy the environment names carries the BMC's requests unless NO_PROXY covers the BMC."""
    import requests.sessions

    asked: list[str] = []
    environ_proxies = requests.sessions.get_environ_proxies

    def counting(url: str, no_proxy: str | None = None) -> dict[str, str]:
        asked.append(url)
        return environ_proxies(url, no_proxy=no_proxy)

    monkeypatch.setattr(requests.sessions, "get_environ_proxies", counting)
    for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    creds = BmcCredentials(username=emulator.username, password=emulator.password)
    target = NodeBmc(driver="redfish", address=emulator.url)
    links = RedfishLinks()
    for _ in range(3):  # three commands to one BMC
        driver = open_redfish(target, creds, links=links)
        try:
            await driver.inventory(deadline=time.time() + 10)
        finally:
            await driver.close()
    assert len(asked) == 1, asked

    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")  # a proxy nobody runs
    err = await driver_error(
        open_redfish(target, creds, links=RedfishLinks()).inventory(deadline=time.time() + 5)
    )
    assert err.code is ErrorCode.DRIVER_ERROR, err
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    driver = open_redfish(target, creds, links=RedfishLinks())
    try:
        assert (await driver.inventory(deadline=time.time() + 10)).system is not None
    finally:
        await driver.close()


async def test_ipmi_power_and_boot_device_against_pyghmis_bmc(tmp_path: Path) -> None:
    bmc = IpmiBmc(tmp_path / "ipmi").start()
    try:
        target = NodeBmc(driver="ipmi", address=bmc.address)
        driver = make_driver(target, BmcCredentials(username=bmc.username, password=bmc.password))
        got = await driver.set_power(SetPower(action="on"), deadline=time.time() + 30)
        assert got.power_state == "on"
        assert bmc.state()["power"] == "on"
        got = await driver.set_boot_device(
            SetBootDevice(device="pxe", persistent=False), deadline=time.time() + 30
        )
        assert got.device == "pxe"
        assert bmc.state()["bootdev"] == "network"
        got = await driver.set_power(SetPower(action="off"), deadline=time.time() + 30)
        assert bmc.state()["power"] == "off"

        bad = make_driver(target, BmcCredentials(username=bmc.username, password="not-the-password"))
        err = await driver_error(bad.set_power(SetPower(action="on"), deadline=time.time() + 5))
        assert err.code is ErrorCode.DRIVER_ERROR
        assert "not-the-password" not in json.dumps(err.details) + str(err)
    finally:
        bmc.close()


async def test_ipmi_says_cipher_suite_mismatch_not_wrong_credentials(tmp_path: Path) -> None:
    """A BMC that refuses every cipher suite pyghmi proposes, and one that accepts a suite and
    answers with another: each says it is the cipher suite, not the password; a wrong password
    says that. Regression: both were "the BMC refused the credentials"/"wrong credentials?"."""
    for cipher in ("none", "stock"):
        bmc = IpmiBmc(tmp_path / f"ipmi-{cipher}", cipher=cipher).start()
        try:
            driver = make_driver(
                NodeBmc(driver="ipmi", address=bmc.address),
                BmcCredentials(username=bmc.username, password=bmc.password),
            )
            err = await driver_error(driver.inventory(deadline=time.time() + 10))
            reason = err.details["reason"].lower()
            assert "cipher suite" in reason, (cipher, reason)
            assert "credentials" not in reason, (cipher, reason)
            assert "credentials" not in err.details, err.details  # a kept credential stays kept
            assert any(line.startswith("open-session") for line in bmc.requests())
        finally:
            bmc.close()

    bmc = IpmiBmc(tmp_path / "ipmi-password").start()
    try:
        driver = make_driver(
            NodeBmc(driver="ipmi", address=bmc.address),
            BmcCredentials(username=bmc.username, password="not-the-password"),
        )
        err = await driver_error(driver.inventory(deadline=time.time() + 10))
        assert "refused the credentials" in err.details["reason"], err.details
        assert err.details["credentials"] == "refused", err.details  # the site agent drops a kept one
        assert "cipher" not in err.details["reason"]
    finally:
        bmc.close()


async def test_ipmi_commands_at_once_on_one_bmc_each_have_their_own_session(tmp_path: Path) -> None:
    """Two commands for one BMC at the same time (two workflows' steps): each its own session,
    each logged out at its end, and neither fails for the other's logout."""
    bmc = IpmiBmc(tmp_path / "ipmi").start()
    try:
        target = NodeBmc(driver="ipmi", address=bmc.address)
        creds = BmcCredentials(username=bmc.username, password=bmc.password)

        async def command(i: int) -> Any:
            driver = make_driver(target, creds)
            try:
                if i % 2:
                    return await driver.set_boot_device(
                        SetBootDevice(device="pxe", persistent=False), deadline=time.time() + 30
                    )
                return await driver.inventory(deadline=time.time() + 30)
            finally:
                await driver.close()

        for _ in range(2):
            results: list[Any] = await asyncio.gather(*(command(i) for i in range(4)))
            got = [r.device if hasattr(r, "device") else r.system.power_state for r in results]
            assert got == ["off", "pxe", "off", "pxe"]

        def all_closed() -> list[str] | None:
            log = bmc.requests()  # a logout's close-session may land just after the call returned
            used = {line.split("session=")[1] for line in log if "session=" in line}
            closed = {line.split("session=")[1] for line in log if line.startswith("close-session")}
            return log if len(used) == 8 and closed == used else None

        await until(all_closed, timeout=10, what="eight sessions, each closed")
    finally:
        bmc.close()


def _serve_bytes(data: bytes) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_HEAD = do_GET  # noqa: N815

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def test_an_action_whose_answer_was_lost_is_not_sent_twice(
    emulator: RedfishEmulator, proxy: FaultyProxy
) -> None:
    """A POST that reached the BMC but whose answer was lost may have been applied: repeating it
    would reset the machine twice. A medium's insert or eject is read back instead: the BMC has
    it, so it is done, sent once. An idempotent PATCH is repeated."""
    iso = b"fake-iso-bytes" * 100
    server = _serve_bytes(iso)
    try:
        url = f"http://127.0.0.1:{server.server_port}/lost.iso"
        await redfish(proxy.url, emulator).media_eject(MediaEject(device="cd"), deadline=time.time() + 30)
        proxy.set(mode="lose-answer", left=1, methods=["POST"])
        got = await redfish(proxy.url, emulator).media_insert(
            MediaInsert(url=url, device="cd"), deadline=time.time() + 30
        )
        assert (got.inserted, got.image) == (True, url)
        assert [line.split()[-1] for line in proxy.requests() if "InsertMedia" in line] == ["lose-answer"]
        inserts = [b for b in proxy.bodies() if "InsertMedia" in b]
        assert len(inserts) == 1, inserts  # sent once: the BMC had it, read back, not sent again
        assert bmc_get(emulator, _cd_path(emulator))["Image"] == url
        proxy.set(mode="lose-answer", left=1, methods=["POST"])
        got = await redfish(proxy.url, emulator).media_eject(
            MediaEject(device="cd"), deadline=time.time() + 30
        )
        assert got.inserted is False
        ejects = [line.split()[-1] for line in proxy.requests() if "EjectMedia" in line]
        assert ejects[-1:] == ["lose-answer"], ejects  # the one lost, read back, not sent again
        assert bmc_get(emulator, _cd_path(emulator))["Inserted"] is False

        # a restart of a machine that is on (a cycle of one that is off is a power on, read back
        # like one: test_bmc_retries)
        await redfish(proxy.url, emulator).set_power(SetPower(action="on"), deadline=time.time() + 30)
        before = len(proxy.bodies())
        proxy.set(mode="lose-answer", left=1, methods=["POST"])
        err = await driver_error(
            redfish(proxy.url, emulator).set_power(SetPower(action="cycle"), deadline=time.time() + 30)
        )
        assert "POST ComputerSystem.Reset" in err.details["reason"], err.details
        resets = [b for b in proxy.bodies()[before:] if "ComputerSystem.Reset" in b]
        assert len(resets) == 1, (err.details, proxy.requests()[-6:])

        proxy.set(mode="lose-answer", left=1, methods=["PATCH"])
        driver = redfish(proxy.url, emulator)
        got = await driver.set_boot_device(
            SetBootDevice(device="cd", persistent=False), deadline=time.time() + 30
        )
        await driver.close()
        assert got.target == "Cd"
        patches = [b for b in proxy.bodies() if b.startswith("PATCH") and '"Cd"' in b]
        assert len(patches) == 2  # the lost one and its repeat: setting a boot device twice is harmless
    finally:
        proxy.set(mode="forward")
        await redfish(proxy.url, emulator).media_eject(MediaEject(device="cd"), deadline=time.time() + 30)
        server.shutdown()
        server.server_close()


async def test_an_insert_lost_before_the_bmc_is_read_back_then_sent_again(
    emulator: RedfishEmulator, proxy: FaultyProxy
) -> None:
    """An InsertMedia that went out and never reached the BMC (the connection closed with no
    answer): the medium reads back empty for ``read_back`` seconds, so the insert is sent again,
    and the BMC takes it once."""
    server = _serve_bytes(b"fake-iso-bytes" * 100)
    try:
        url = f"http://127.0.0.1:{server.server_port}/swallowed.iso"
        await redfish(proxy.url, emulator).media_eject(MediaEject(device="cd"), deadline=time.time() + 30)
        proxy.set(mode="swallow", left=1, methods=["POST"])
        driver = open_redfish(
            NodeBmc(driver="redfish", address=proxy.url),
            BmcCredentials(username=emulator.username, password=emulator.password),
            read_back=2.0,
        )
        try:
            got = await driver.media_insert(MediaInsert(url=url, device="cd"), deadline=time.time() + 60)
        finally:
            await driver.close()
        assert (got.inserted, got.image) == (True, url)
        tries = [line.split()[-1] for line in proxy.requests() if "InsertMedia" in line]
        assert tries == ["swallow", "forward"], tries
        assert len([b for b in proxy.bodies() if "InsertMedia" in b]) == 1  # the BMC took one
        assert bmc_get(emulator, _cd_path(emulator))["Image"] == url
    finally:
        proxy.set(mode="forward")
        await redfish(proxy.url, emulator).media_eject(MediaEject(device="cd"), deadline=time.time() + 30)
        server.shutdown()
        server.server_close()


async def test_a_power_on_whose_answer_timed_out_is_read_back_and_succeeds(tmp_path: Path) -> None:
    """A BMC too slow to answer a power on within the call timeout, which applied it anyway
    (sushy-emulator at 50-100 systems under load): the command reads the power state back and
    succeeds with the machine on, instead of failing "not repeated". Regression: it failed."""
    # its own emulator: the machine starts off, and a change lands 0-3 s late (not 0-11)
    emulator = RedfishEmulator(tmp_path / "redfish", power_lag=(1, 3)).start()
    proxy = FaultyProxy(tmp_path / "proxy", emulator.url).start()
    try:
        assert bmc_get(emulator, system_path())["PowerState"] == "Off"
        proxy.set(mode="late-answer", left=1, methods=["POST"], seconds=5)
        driver = open_redfish(
            NodeBmc(driver="redfish", address=proxy.url),
            BmcCredentials(username=emulator.username, password=emulator.password),
            call_timeout=1.0,
        )
        try:
            got = await driver.set_power(SetPower(action="on"), deadline=time.time() + 60)
        finally:
            await driver.close()
        assert (got.power_state, got.changed) == ("On", True)
        assert bmc_get(emulator, system_path())["PowerState"] == "On"
        assert any(line.endswith(" late-answer") for line in proxy.requests())  # it did time out
        resets = [b for b in proxy.bodies() if "ComputerSystem.Reset" in b]
        # read back (the BMC applies it 1-11 s late): sent again only if it had not got there
        assert 1 <= len(resets) <= 2, resets
        assert all('"On"' in b for b in resets), resets
    finally:
        proxy.close()
        emulator.close()


async def test_a_cycle_whose_answer_timed_out_still_fails(
    emulator: RedfishEmulator, proxy: FaultyProxy
) -> None:
    """A restart is a change each time, not a state to read back: one whose answer timed out is
    not sent again, and the command fails saying the BMC may have applied it. (The machine is on:
    a cycle of one that is off is a power on, read back like one.)"""
    await redfish(proxy.url, emulator).set_power(SetPower(action="on"), deadline=time.time() + 30)
    before = len(proxy.bodies())
    proxy.set(mode="late-answer", left=1, methods=["POST"], seconds=5)
    driver = open_redfish(
        NodeBmc(driver="redfish", address=proxy.url),
        BmcCredentials(username=emulator.username, password=emulator.password),
        call_timeout=1.0,
    )
    err = await driver_error(driver.set_power(SetPower(action="cycle"), deadline=time.time() + 60))
    assert err.code is ErrorCode.DRIVER_ERROR
    reason = err.details["reason"]
    assert "POST ComputerSystem.Reset(" in reason, reason
    assert "timed out" in reason, reason
    assert "may have applied it" in reason, reason
    resets = [b for b in proxy.bodies()[before:] if "ComputerSystem.Reset" in b]
    assert len(resets) == 1, resets


def _statuses(checks: list[dict[str, Any]]) -> dict[str, str]:
    return {c.check: c.status for c in checks}


async def test_validate_checks_a_redfish_bmc_without_changing_it(emulator: RedfishEmulator) -> None:
    """``management.validate`` (issue 26 item 2): all ok on a good BMC; a wrong password is the
    credentials check failing (the BMC answered); a system that is not there is the system check;
    a closed port is the reach check, within the deadline it was given."""
    before = bmc_get(emulator, system_path())["PowerState"]
    good = redfish(emulator.url, emulator, system_id=system_path())
    checks = await good.validate(deadline=time.time() + 10)
    assert _statuses(checks) == {"reach": "ok", "credentials": "ok", "system": "ok", "power": "ok"}, checks
    assert bmc_get(emulator, system_path())["PowerState"] == before

    wrong = redfish(emulator.url, emulator, password="not-the-password-321", system_id=system_path())
    checks = await wrong.validate(deadline=time.time() + 10)
    assert _statuses(checks) == {
        "reach": "ok",
        "credentials": "failed",
        "system": "skipped",
        "power": "skipped",
    }
    assert "refused the credentials" in checks[1].message, checks
    assert "not-the-password-321" not in msgspec.json.encode(checks).decode()

    missing = redfish(emulator.url, emulator, system_id="/redfish/v1/Systems/no-such-system")
    checks = await missing.validate(deadline=time.time() + 10)
    assert _statuses(checks)["system"] == "failed", checks
    assert "404" in checks[2].message, checks

    dead = redfish(f"http://127.0.0.1:{free_port()}", emulator)
    began = time.monotonic()
    checks = await dead.validate(deadline=time.time() + 1.5)
    assert time.monotonic() - began < 5
    assert _statuses(checks)["reach"] == "failed", checks
    assert "connection refused" in checks[0].message, checks


async def test_validate_checks_an_ipmi_bmc(tmp_path: Path) -> None:
    bmc = IpmiBmc(tmp_path / "ipmi").start()
    try:
        good = make_driver(
            NodeBmc(driver="ipmi", address=bmc.address),
            BmcCredentials(username=bmc.username, password=bmc.password),
        )
        try:
            checks = await good.validate(deadline=time.time() + 10)
        finally:
            await good.close()
        assert _statuses(checks) == {"reach": "ok", "credentials": "ok", "system": "ok", "power": "ok"}, (
            checks
        )
        wrong = make_driver(
            NodeBmc(driver="ipmi", address=bmc.address),
            BmcCredentials(username=bmc.username, password="not-the-password"),
        )
        checks = await wrong.validate(deadline=time.time() + 10)
        assert _statuses(checks) == {
            "reach": "ok", "credentials": "failed", "system": "skipped", "power": "skipped"
        }, checks  # fmt: skip
        assert "refused the credentials" in checks[1].message, checks
    finally:
        bmc.close()


def bmc_reset(emulator: RedfishEmulator, reset: str) -> None:
    """Change the power at the BMC behind the driver's back, as an operator would with curl."""
    req = urllib.request.Request(
        f"{emulator.url}{system_path()}/Actions/ComputerSystem.Reset",
        data=json.dumps({"ResetType": reset}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    auth = b64encode(f"{emulator.username}:{emulator.password}".encode()).decode()
    req.add_header("Authorization", f"Basic {auth}")
    with urllib.request.urlopen(req, timeout=5) as resp:
        resp.read()


@pytest.fixture
def quick_bmc(tmp_path: Path) -> Iterator[tuple[RedfishEmulator, FaultyProxy]]:
    """An emulator of its own whose power changes land within the second, behind a proxy."""
    emu = RedfishEmulator(tmp_path / "quick", power_lag=(0, 0)).start()
    proxy = FaultyProxy(tmp_path / "quick-proxy", emu.url).start()
    yield emu, proxy
    proxy.close()
    emu.close()


async def _command(url: str, emulator: RedfishEmulator, op: Any, *, password: str | None = None) -> Any:
    """One command as the site agent runs it: a driver with the command's credentials, closed after."""
    driver = redfish(url, emulator, password=password, system_id=SYSTEM_UUID)
    try:
        return await op(driver)
    finally:
        await driver.close()


async def test_what_is_kept_of_a_bmc_between_commands_reads_as_the_bmc_has_it(
    quick_bmc: tuple[RedfishEmulator, FaultyProxy],
) -> None:
    """The driver keeps the service root and the system between commands (issue 25): a later
    command does not read the root again, and the power it changes, or someone else changed,
    reads back as the BMC has it; the virtual medium one command found is the one the next
    ejects. The credentials are not kept: a command with a wrong password between two good ones
    is refused."""
    emulator, proxy = quick_bmc
    seen = len(proxy.requests())  # the proxy's own readiness probe

    def power(action: str) -> Any:
        return lambda d: d.set_power(SetPower(action=action), deadline=time.time() + 30)

    def inventory(d: Driver) -> Any:
        return d.inventory(deadline=time.time() + 30)

    got = await _command(proxy.url, emulator, power("on"))
    assert (got.power_state, got.changed) == ("On", True)
    assert (await _command(proxy.url, emulator, inventory)).system.power_state == "On"
    got = await _command(proxy.url, emulator, power("off"))
    assert (got.power_state, got.changed) == ("Off", True)
    assert bmc_get(emulator, system_path())["PowerState"] == "Off"
    assert (await _command(proxy.url, emulator, inventory)).system.power_state == "Off"

    bmc_reset(emulator, "On")  # behind the driver's back: the kept system says Off
    await until(lambda: bmc_get(emulator, system_path())["PowerState"] == "On", timeout=10)
    got = await _command(proxy.url, emulator, power("on"))
    assert (got.power_state, got.changed) == ("On", False)  # read at the BMC, not from memory

    server = _serve_bytes(b"kept-iso" * 100)
    try:  # the medium found in one command is the one the next command ejects and reads
        url = f"http://127.0.0.1:{server.server_port}/kept.iso"
        got = await _command(
            proxy.url, emulator, lambda d: d.media_insert(MediaInsert(url=url), deadline=time.time() + 30)
        )
        assert (got.inserted, got.image) == (True, url)
        got = await _command(
            proxy.url, emulator, lambda d: d.media_eject(MediaEject(), deadline=time.time() + 30)
        )
        assert got.inserted is False
        got = await _command(
            proxy.url, emulator, lambda d: d.media_eject(MediaEject(), deadline=time.time() + 30)
        )
        assert got.inserted is False  # nothing in: nothing sent
        assert len([b for b in proxy.requests() if "EjectMedia" in b]) == 1
    finally:
        server.shutdown()
        server.server_close()

    roots = [line for line in proxy.requests()[seen:] if line.split()[1] == "/redfish/v1/"]
    assert len(roots) == 1, roots  # the first command read the service root, no other did

    err = await driver_error(
        _command(proxy.url, emulator, inventory, password="not-the-password-987")  # type: ignore[arg-type]
    )
    assert "refused the credentials" in err.details["reason"], err.details
    assert err.details["credentials"] == "refused", err.details  # the site agent drops a kept one
    assert (await _command(proxy.url, emulator, inventory)).system.uuid == SYSTEM_UUID


async def test_a_bmc_that_restarted_or_moved_its_system_gets_each_action_once(
    quick_bmc: tuple[RedfishEmulator, FaultyProxy],
) -> None:
    """What the driver kept of a BMC goes stale: the BMC restarts between two commands, or
    answers 404 at the system's kept path (renumbered). The next command reads the system again
    (from the service root after the 404) and succeeds, sending its action once."""
    emulator, proxy = quick_bmc
    await _command(
        proxy.url,
        emulator,
        lambda d: d.set_boot_device(SetBootDevice(device="pxe", persistent=False), deadline=time.time() + 30),
    )
    emulator.close()
    emulator.start()  # the same port, a new process

    got = await _command(
        proxy.url, emulator, lambda d: d.set_power(SetPower(action="cycle"), deadline=time.time() + 30)
    )
    assert (got.power_state, got.changed) == ("On", True)
    assert len([b for b in proxy.bodies() if "ComputerSystem.Reset" in b]) == 1

    seen = len(proxy.requests())
    proxy.set(mode="error-count", left=1, status=404)  # the kept system's path is gone, once
    got = await _command(
        proxy.url, emulator, lambda d: d.set_power(SetPower(action="off"), deadline=time.time() + 30)
    )
    assert (got.power_state, got.changed) == ("Off", True)
    assert bmc_get(emulator, system_path())["PowerState"] == "Off"
    assert len([b for b in proxy.bodies() if "ComputerSystem.Reset" in b]) == 2  # one each
    taken = [line.split() for line in proxy.requests()[seen:]]
    assert (taken[0][:2], taken[0][-1]) == (["GET", system_path()], "error"), taken
    assert ["GET", "/redfish/v1/"] in [t[:2] for t in taken]  # found again from the service root
