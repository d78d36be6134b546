"""The boot path carries what bcd needs for the site's TLS-only leaf (issue 23 item 4): the site
agent's kernel lines name its bus files and the bus CA's digest, and bcd refuses a kernel line
that names a bus it cannot check (bcd fetching and checking against a real site agent:
tests/integration/test_deploy_callout.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from bc_site_agent.netboot import BootEntry, bus_cmdline, entry_script
from bcd.bus import fetch_bus_files
from better_compute.core.errors import BcError, ErrorCode


def test_a_node_entry_names_the_bus_files_and_the_ca_digest() -> None:
    words = bus_cmdline("http://10.0.0.5:8081", b"the bus CA")
    digest = hashlib.sha256(b"the bus CA").hexdigest()
    assert words == f"bcd.bus=http://10.0.0.5:8081/bus bcd.bus_ca_sha256={digest}"
    entry = BootEntry(mac="52:54:00:12:34:56", kernel="http://h/k", cmdline="quiet", join_token="tok")
    script = entry_script(entry, extra=words)
    assert f"kernel http://h/k quiet bcd.token=tok {words}\n" in script
    assert bus_cmdline("http://10.0.0.5:8081", None) == ""  # a bus without TLS: nothing to add
    assert "bcd.bus" not in entry_script(entry)


@pytest.mark.parametrize(
    ("cmdline", "path"),
    [
        ({"bus": "http://10.0.0.5:8081/bus"}, "bcd.bus_ca_sha256"),  # nothing to check the CA by
        ({"bus": "http://10.0.0.5:8081/bus", "bus_ca_sha256": "abc"}, "bcd.bus_ca_sha256"),
        ({"bus": "file:///etc/ca.pem", "bus_ca_sha256": "0" * 64}, "bcd.bus"),
    ],
)
def test_bcd_refuses_a_bus_it_cannot_check(cmdline: dict[str, str], path: str, tmp_path: Path) -> None:
    with pytest.raises(BcError) as err:
        fetch_bus_files(cmdline, tmp_path)
    assert (err.value.code, err.value.details["path"]) == (ErrorCode.INVALID_CONFIG, path)
    assert list(tmp_path.iterdir()) == []
    assert fetch_bus_files({}, tmp_path) is False  # no bus named: the environment's, as before
