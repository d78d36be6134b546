"""A node whose BMC hands the ramdisk its join token on a virtual CD (``tokenDelivery: media``,
issue 23; docs/security.md "Virtual media") goes the whole way: inspected, commissioned and
deployed, each ramdisk boot reading its token from the medium sushy-emulator downloaded from
the site agent, never from the boot network. The attacker's side (a host that asks first, a
second fetch of the medium) is a section of tests/e2e/test_metal_boot_identity.py; this test is
the long honest path, behind ``long`` (three ramdisk boots and the installed OS: a minute or
two)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_metal_deploy_config_drive import os_image

from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, bcx
from better_compute.testing.images import register_sim_image
from better_compute.testing.metal_sim import fleet_stack

pytestmark = [pytest.mark.e2e, pytest.mark.long]


@pytest.mark.timeout(600)
async def test_a_node_with_virtual_media_is_inspected_commissioned_and_deployed(
    tmp_path: Path, bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses
) -> None:
    body = os_image(tmp_path / "os.raw")
    async with fleet_stack(tmp_path / "fleet", bc_settings, machines=1, processes=bc_processes,
                           api=bc_api) as stack:  # fmt: skip
        try:
            url = stack.media.add("os.raw", body)
            await register_sim_image(stack.engine, "tos@1", url=url, data=body)
            m, node_id = stack.machine(0), stack.nodes[0]
            updated = await bcx(stack.settings, "nodes", "update", node_id, "--bmc-token-delivery", "media")
            assert updated.returncode == 0, updated.stdout + updated.stderr
            for verb, state in (("inspect", "inspected"), ("commission", "ready")):
                await stack.verb(verb, 0)
                await stack.reaches(0, state)
            run = await stack.verb("deploy", 0, image="tos@1")
            node = await stack.reaches(0, "deployed", timeout=180)
            assert node.image == "tos@1"
            assert node.quarantine is None
            # three ramdisk boots, each from a token medium the BMC fetched, ejected after the join
            assert m.ledger.count("media.insert") == 3
            assert m.ledger.count("media.visible") == 3
            assert m.ledger.count("media.eject") == 3
            assert m.ledger.count("boot.network", served="kernel") == 3
            wf = await stack.engine.get_workflow(id=run.workflow_id)
            steps = [s for s in wf.steps if s.action == "metal.ensureRamdisk"]
            assert [s.result["tokenDelivery"] for s in steps] == ["media"]
            joined = [s.result for s in wf.steps if s.action == "wait.agentJoined"]
            assert (joined[-1]["agentId"], joined[-1]["role"]) == (node_id, "provisioned")  # the OS
            # no boot entry left behind, and no token ever on a kernel line the machine booted
            netboot = stack.agent.state_dir / "netboot"
            assert not any(netboot.glob("*.json"))
            assert "bcd.token=" not in (m.tree / "proc/cmdline").read_text()
        finally:
            print(stack.tails())
