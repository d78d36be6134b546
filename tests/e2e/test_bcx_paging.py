"""bcx list commands page: ``--limit`` rows, ``more: --cursor …`` on stderr, ``--all`` to the end."""

from __future__ import annotations

import json
import re

import msgspec
import pytest
from test_engine_bcx import start_engine

from better_compute.clients import EngineClient
from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx


@pytest.fixture
def settings(bc_settings: Settings) -> Settings:
    return msgspec.structs.replace(bc_settings, app="engine_test_app:app")


def _ids(table: str) -> list[str]:
    return [line.split()[0] for line in table.splitlines()[1:]]


async def test_bcx_lists_a_page_says_how_to_go_on_and_follows_every_page(
    settings: Settings, bc_processes: ServiceProcesses, bc_api: ApiClient
) -> None:
    await start_engine(settings, bc_processes)
    made = sorted([(await EngineClient(bc_api).create_node(site_id="eu1")).id for _ in range(5)])

    code, out, err = await bcx(settings, "nodes", "list", "--limit", "2")
    assert code == 0, err
    assert _ids(out) == made[:2]
    assert out.splitlines()[0].split() == ["NODE", "NAME", "SITE", "STATE", "POWER", "TENANT", "LABELS"]
    more = re.search(r"more: --cursor (\S+)", err)
    assert more is not None, err
    # one node, as the list shows it: a table unless --json or -o yaml asks for the document
    code, one, err = await bcx(settings, "nodes", "get", made[0])
    assert code == 0, err
    assert one.splitlines()[1].split()[:5] == [made[0], "-", "eu1", "enrolled", "unknown"]
    code, one, err = await bcx(settings, "nodes", "get", made[0], "--json")
    assert json.loads(one)["id"] == made[0]
    # filtered on the server: a page holds only matches (kubectl's -l and -o wide)
    await EngineClient(bc_api).label_node(id=made[3], set={"rack": "r7"})
    code, out, err = await bcx(settings, "nodes", "list", "-l", "site=eu1,rack=r7", "--limit", "1")
    assert (code, _ids(out), "more:" in err) == (0, [made[3]], False), err
    code, out, err = await bcx(settings, "nodes", "list", "--state", "enrolled", "--site=eu1", "-o", "wide")
    assert _ids(out) == made
    assert out.splitlines()[0].split()[-4:] == ["MACS", "BMC", "IMAGE", "WORKFLOW"]
    code, out, err = await bcx(settings, "nodes", "list", "--state", "deployed")
    assert (code, out.strip()) == (0, "no nodes")

    code, out, err = await bcx(settings, "nodes", "list", "--limit", "2", "--cursor", more.group(1))
    assert code == 0, err
    assert _ids(out) == made[2:4]

    code, out, err = await bcx(settings, "nodes", "list", "--limit", "2", "--all")
    assert code == 0, err
    assert _ids(out) == made
    assert "more:" not in err

    code, out, err = await bcx(settings, "nodes", "list", "--limit", "2", "--all-pages", "--json")
    got = json.loads(out)
    assert [n["id"] for n in got["nodes"]] == made
    assert got["next"] is None

    code, _, err = await bcx(settings, "nodes", "list", "--limit", "5000")
    assert code == 2
    assert "--limit" in err
