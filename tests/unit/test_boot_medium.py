"""The ramdisk's token on a virtual medium (issue 23, docs/security.md "Virtual media"): the
site agent's image and its one-time capability (``bc_site_agent.media``), and bcd reading it
(``bcd.medium``). The whole path against sushy-emulator: tests/e2e/test_metal_boot_identity.py."""

from __future__ import annotations

import hashlib
import re
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import pytest

from bc_site_agent import handlers as handlers_module
from bc_site_agent.config import load_config
from bc_site_agent.handlers import SiteHandlers
from bc_site_agent.media import REMEMBER_S, MediaImages, bmc_addresses, token_image
from bcd.medium import check_bus_ca, read_boot_medium
from bcd.system import Machine
from better_compute.agent import Command
from better_compute.cli.metal_commands import _node_bmc, token_delivery_line
from better_compute.core.errors import BcError, ErrorCode
from better_compute.wire.commands import MediaResult

pytestmark = pytest.mark.unit

TOKEN = "bcjt_" + "k" * 43
CA = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def _images(now: list[float]) -> tuple[MediaImages, str]:
    images = MediaImages(clock=lambda: now[0])
    cap = images.put(
        token_image(TOKEN), allowed=frozenset({"10.0.0.9"}), not_after=100.0, token=TOKEN, node_id="n", mac=""
    )
    return images, cap


def test_the_image_goes_once_to_the_bmc_and_any_other_ask_burns_its_token() -> None:
    now = [0.0]
    images, cap = _images(now)
    assert len(cap) == 32  # 128 bits, hex
    assert images.take("0" * 32, source="10.0.0.9").body is None  # unknown: nothing, no burn
    got = images.take(cap, source="10.0.0.9")
    assert got.body is not None
    assert got.burn is None
    assert images.count() == 0  # gone after the fetch
    again = images.take(cap, source="10.0.0.9")  # the BMC again, or whoever learned the URL
    assert again.body is None
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    assert again.burn == {"tokenSha256": digest, "mac": "", "reason": "boot-medium-fetched-twice"}
    assert images.take(cap, source="10.0.0.7").burn is None  # burned once, reported once


def test_an_ask_from_another_address_burns_it_before_the_bmc_got_it_and_the_bmc_gets_nothing() -> None:
    images, cap = _images([0.0])
    stolen = images.take(cap, source="10.0.0.7")
    assert stolen.body is None
    assert stolen.burn is not None
    assert images.take(cap, source="10.0.0.9").body is None


def test_an_image_not_fetched_by_its_deadline_is_gone_and_a_late_ask_still_burns() -> None:
    now = [0.0]
    images, cap = _images(now)
    now[0] = 101.0
    assert images.count() == 0
    late = images.take(cap, source="10.0.0.9")
    assert late.body is None
    assert late.burn is not None
    now[0] = 101.0 + REMEMBER_S + 1
    assert images.take(cap, source="10.0.0.9").burn is None  # forgotten


def test_the_bmcs_addresses_are_resolved_from_its_url() -> None:
    assert bmc_addresses("https://127.0.0.1:8000/redfish") == frozenset({"127.0.0.1"})
    assert bmc_addresses("10.0.0.9") == frozenset({"10.0.0.9"})


def _machine(tmp_path: Path, image: bytes | None, device: str = "dev/sr0") -> Machine:
    if image is not None:
        target = tmp_path / device
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(image)
    return Machine(root=tmp_path)


def test_bcd_reads_the_token_and_bus_ca_from_the_bcboot_medium(tmp_path: Path) -> None:
    medium = read_boot_medium(_machine(tmp_path, token_image(TOKEN, bus_ca=CA)))
    assert medium.token == TOKEN
    assert medium.bus_ca == CA
    assert TOKEN not in repr(medium)
    check_bus_ca(medium, {"bus_ca_sha256": hashlib.sha256(CA).hexdigest()})
    # a boot script rewritten on the boot network to point bcd at another bus is refused
    with pytest.raises(BcError) as err:
        check_bus_ca(medium, {"bus_ca_sha256": "0" * 64})
    assert (err.value.code, err.value.path) == (ErrorCode.INVALID_CONFIG, "bcd.bus_ca_sha256")


def test_bcd_without_a_bcboot_medium_says_so(tmp_path: Path) -> None:
    other = tmp_path / "other"
    with pytest.raises(BcError) as err:
        read_boot_medium(_machine(other, None))
    assert (err.value.code, err.value.path) == (ErrorCode.INVALID_INPUT, "bcd.token_from")
    with pytest.raises(BcError):  # a CD that is not ours
        read_boot_medium(_machine(tmp_path / "blank", b"\0" * 70000))


def test_the_choice_is_per_node_shown_by_nodes_show_and_refused_for_ipmi() -> None:
    redfish = {"driver": "redfish", "address": "https://10.0.0.9"}
    assert token_delivery_line({**redfish, "tokenDelivery": "media"}).startswith("media: on a virtual CD")
    assert token_delivery_line(redfish).startswith("network: on the kernel line, held")
    assert "IPMI has no virtual media" in token_delivery_line({"driver": "ipmi", "address": "10.0.0.9"})
    with pytest.raises(BcError) as err:
        _node_bmc({"driver": "ipmi", "address": "10.0.0.9", "tokenDelivery": "media"}, None)
    assert (err.value.code, err.value.path) == (ErrorCode.INVALID_INPUT, "bmc")
    assert "virtual media" in err.value.message


def test_the_bmcs_url_for_the_agent_is_its_own_setting(tmp_path: Path) -> None:
    """BMCs usually sit on a management network, not the boot network: ``media_url`` says how
    they reach the agent (``public_url`` without it)."""
    cfg = tmp_path / "site-agent.toml"
    env = {"BC_NATS_URL": "nats://x"}
    cfg.write_text('site_id = "site-a"\nstate_dir = "/x"\nmedia_url = "http://10.1.0.5:8081/"\n')
    assert load_config(cfg, env=env).media_url == "http://10.1.0.5:8081"
    cfg.write_text('site_id = "site-a"\nstate_dir = "/x"\nmedia_url = "10.1.0.5"\n')
    with pytest.raises(BcError) as err:
        load_config(cfg, env=env)
    assert (err.value.code, err.value.path) == (ErrorCode.INVALID_CONFIG, "media_url")


class _MediaDriver:
    def __init__(self) -> None:
        self.urls: list[str | None] = []

    async def media_insert(self, payload: Any, *, deadline: float) -> MediaResult:
        self.urls.append(payload.url)
        assert payload.join_token_ref is None  # the BMC never sees the reference
        return MediaResult(driver="redfish", device="cd", inserted=True, image=payload.url)

    async def close(self) -> None:
        return None


class _Secrets:
    async def fetch(self, *, ref: str, identity: Any) -> bytes:
        return TOKEN.encode()


async def test_the_insert_hands_the_bmc_a_capability_on_the_media_url_and_the_result_hides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = _MediaDriver()
    monkeypatch.setattr(handlers_module, "make_driver", lambda target, credentials: driver)
    media = MediaImages()
    site = SiteHandlers(
        secrets=cast(Any, _Secrets()), identity=cast(Any, None), entries=cast(Any, None),
        cache=cast(Any, None), public_url="http://10.0.0.5:8081", relay=cast(Any, None),
        media=media, media_url="http://127.0.0.1:8081",
    )  # fmt: skip
    payload = {"device": "cd", "joinTokenRef": "sec_" + "0" * 26,
               "bmc": {"driver": "redfish", "address": "http://127.0.0.1:8000"}}  # fmt: skip
    cmd = Command(
        id="cmd_1", kind="media.insert", payload=payload, node_id="node_1", site_id="lab1", key="k",
        destructive=False, not_after=time.time() + 30, batch_id=None, workflow_id=None, step=None,
        _agent=cast(Any, None),
    )  # fmt: skip
    got = await site.handlers()["media.insert"](cmd)
    [url] = driver.urls
    assert url is not None
    assert re.fullmatch(r"http://127\.0\.0\.1:8081/media/[0-9a-f]{32}", url)
    assert got.image == "http://127.0.0.1:8081/media/…"  # the capability is in no result
    taken = media.take(url.rsplit("/", 1)[1], source="127.0.0.1")
    assert taken.body is not None
    assert read_boot_medium_bytes(taken.body).token == TOKEN


def read_boot_medium_bytes(image: bytes) -> Any:
    with tempfile.TemporaryDirectory() as folder:
        return read_boot_medium(_machine(Path(folder), image))
