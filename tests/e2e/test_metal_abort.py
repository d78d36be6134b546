"""An abort leaves nothing behind at the site (issue 22, gap 2), on every real process and the
metal simulator: a machine that never boots holds its inspect at ``wait.agentJoined``; the
operator aborts. Counted where it happens: the join its ramdisk's token would make (bc-pki
refuses it, and records no join), the boot script the site agent serves that MAC, and the
simulated machine's BMC (power, boot override)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from better_compute.agent import enroll
from better_compute.config import Settings
from better_compute.core.errors import BcError
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.metal_sim import Faults, FleetStack, fleet_stack
from better_compute.wire.pki import JoinClaims

pytestmark = pytest.mark.e2e

TOKEN = re.compile(r"bcjt_[A-Za-z0-9_-]{43}")


@pytest_asyncio.fixture(loop_scope="session")
async def stack(
    bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses, tmp_path: Path
) -> AsyncIterator[FleetStack]:
    faults = {0: Faults(never_boots=True)}
    async with fleet_stack(
        tmp_path / "fleet", bc_settings, machines=1, faults=faults, processes=bc_processes, api=bc_api
    ) as fleet:
        try:
            yield fleet
        finally:
            print("--- ledger ---", fleet.sim.machines[0].ledger.counts())
            print(fleet.tails())


def _served(stack: FleetStack, mac: str) -> str:
    """The boot script the site agent serves the MAC now (what the machine's iPXE would get; a
    one-time entry is consumed by it)."""
    url = f"{stack.agent.url}/boot/mac/{mac.replace(':', '-')}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


def _entry_token(stack: FleetStack) -> str | None:
    """The join token in the site agent's boot entry files (what its script would serve)."""
    for path in sorted((stack.agent.state_dir / "netboot").rglob("*")):
        if not path.is_file():
            continue
        found = TOKEN.search(path.read_text(errors="replace"))
        if found:
            return found.group(0)
    return None


@pytest.mark.timeout(300)  # the stack takes 30-90 s to start on the loaded 2-core machine
async def test_an_abort_revokes_the_ramdisks_token_clears_its_boot_entry_and_powers_the_machine_off(
    stack: FleetStack,
) -> None:
    m, node_id = stack.machine(0), stack.nodes[0]
    run = await stack.verb("inspect", 0)

    async def at_join() -> bool:
        wf = await stack.engine.get_workflow(id=run.workflow_id)
        steps = wf.steps or []
        return steps[0].state == "succeeded" and steps[1].action == "wait.agentJoined"

    await until(at_join, timeout=120, what="the inspect waits for the ramdisk's join")
    await until(lambda: m.ledger.count("boot.none") >= 1, timeout=60, what="the machine powered on")
    token = _entry_token(stack)
    assert token is not None  # the entry its iPXE would boot with, token and all
    await stack.engine.abort_workflow(id=run.workflow_id, reason="changed my mind")
    await stack.reaches(0, "failed")

    # The site agent no longer keeps the entry (nor its token) for the machine's MAC, and
    # serves the MAC the local-boot script. (Reading what it would serve consumes a one-time
    # entry, so its entry files are what is watched.)
    await until(lambda: _entry_token(stack) is None, timeout=60, what="the boot entry cleared")
    assert token not in _served(stack, m.macs[0])
    # The ramdisk's bcd joins with the token it booted with: refused, and no join recorded.
    claims = JoinClaims(macs=list(m.macs), product_uuid=m.uuid, serial=m.serial)
    with pytest.raises(BcError) as refused:
        await enroll(stack.pki, token=token, claims=claims, site_id=stack.site_id)
    assert refused.value.code.value in ("UNAUTHENTICATED", "PERMISSION_DENIED"), refused.value
    ramdisk = (await stack.engine.get_workflow(id=run.workflow_id)).steps[0].result  # type: ignore[index]
    tried = await stack.pki.list_joins(join_token_id=ramdisk["joinTokenId"])
    assert [j.outcome for j in tried if j.outcome == "joined"] == []
    assert tried, "bc-pki saw the join attempt"
    # The BMC is left as the clean-up returns it: off, no network-boot override.
    await until(lambda: m.power == "Off", timeout=60, what="the machine powered off")
    await until(lambda: m.boot_device != "Pxe", timeout=60, what="the PXE override undone")
    assert "changed my mind" in str((await stack.engine.get_node(id=node_id)).state_reason)
