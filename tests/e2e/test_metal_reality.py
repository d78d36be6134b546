"""What real counterparts found (issue 21 item 5), on the metal simulator through every real
process (``fleet_stack``): each checked where a user would notice it, at the machine's ledger
(what its BMC and disk saw) or on the node an operator reads."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx, refused
from better_compute.testing.images import SIM_IMAGE
from better_compute.testing.metal_sim import FleetStack, fleet_stack

pytestmark = pytest.mark.e2e

AUTOINSTALL = "ubuntu-24.04-autoinstall"


@pytest_asyncio.fixture(loop_scope="session")
async def one(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[FleetStack]:
    async with fleet_stack(
        tmp_path / "fleet", bc_settings, machines=1, processes=bc_processes, api=bc_api
    ) as stack:
        try:
            yield stack
        finally:
            print(stack.tails())


async def ready(stack: FleetStack, index: int = 0) -> None:
    await stack.verb("inspect", index)
    await stack.reaches(index, "inspected")
    await stack.verb("commission", index)
    await stack.reaches(index, "ready")


async def test_a_deploy_of_an_image_not_in_the_catalog_fails_before_the_bmc_is_touched(
    one: FleetStack, bc_settings: Settings
) -> None:
    """Regression: the page's autoinstall profile never looked at the catalog, so
    ``bcx deploy --profile ubuntu-24.04-autoinstall --image nosuch@0`` ended ``deployed``; the
    shipped ``metal.deploy`` found out only at ``deploy.deploy``, after the power cycle."""
    await ready(one)
    m, node_id = one.machine(0), one.nodes[0]
    before = m.ledger.counts()
    workflows = len((await one.engine.list_workflows(node_id=node_id)).workflows)

    run = await bcx(bc_settings, "deploy", node_id, "--profile", AUTOINSTALL, "--image", "nosuch@0")
    assert run.returncode != 0, run.stdout
    assert "NOT_FOUND" in run.stderr, run.stderr
    assert "nosuch@0" in run.stderr, run.stderr
    err = await refused(one.verb("deploy", 0, image="nosuch@0"))  # the shipped metal.deploy
    assert (err.code.value, err.details["path"]) == ("NOT_FOUND", "image")
    assert "nothing was started" in err.message

    # nothing reached the machine: no power change, boot device, medium or disk write
    assert m.ledger.counts() == before
    node = await one.engine.get_node(id=node_id)
    assert (node.state, node.image) == ("ready", None)
    assert len((await one.engine.list_workflows(node_id=node_id)).workflows) == workflows

    # the signed image in the catalog deploys as before
    run = await bcx(bc_settings, "--json", "deploy", node_id, "--profile", AUTOINSTALL, "--image", SIM_IMAGE)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["state"] == "deploying"
    await one.reaches(0, "deployed")
