"""Issue 22 gap 5: under the destructive-batch quorum, a deploy of the page's installer profile
rewrites no disk until the approvers signed its batch.

The installer writes the disk with nothing destructive sent: ``media.insert``, the boot device
and a power cycle boot it. Counted at the simulated machine (its ledger: docs/metal-sim.md),
every real process running: bc-engine, bc-command-queue (with one approver), bc-pki,
bc-secrets, the site agent and the machine's bcd.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ed25519

from better_compute.config import Settings
from better_compute.crypto import sign_batch
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses, until
from better_compute.testing.approvers import approver_keys, write_approvers
from better_compute.testing.metal_sim import FleetStack, fleet_stack

pytestmark = pytest.mark.e2e

PROFILE = "ubuntu-24.04-autoinstall"
IMAGE = "ubuntu@24.04"


@pytest_asyncio.fixture(loop_scope="session")
async def keys(tmp_path: Path) -> dict[str, ed25519.Ed25519PrivateKey]:
    made = approver_keys(["alice"])
    write_approvers(tmp_path / "approvers.toml", made, threshold=1)
    return made


@pytest_asyncio.fixture(loop_scope="session")
async def one(
    bc_settings: Settings,
    bc_api: ApiClient,
    bc_processes: ServiceProcesses,
    tmp_path: Path,
    keys: dict[str, ed25519.Ed25519PrivateKey],
) -> AsyncIterator[FleetStack]:
    env = {"BC_CMDQ_QUORUM_FILE": str(tmp_path / "approvers.toml")}
    async with fleet_stack(
        tmp_path / "fleet", bc_settings, machines=1, processes=bc_processes, api=bc_api, env=env
    ) as stack:
        try:
            yield stack
        finally:
            print(stack.tails())


async def approve(stack: FleetStack, batch_id: str | None, key: ed25519.Ed25519PrivateKey) -> None:
    assert batch_id is not None
    batch = await stack.cq.get_batch(id=batch_id)
    await stack.cq.approve_batch(batch_id=batch.id, approver_id="alice", signature=sign_batch(batch, key))


@pytest.mark.timeout(300)
async def test_an_installer_rewrites_no_disk_before_its_batch_is_approved(
    one: FleetStack, keys: dict[str, ed25519.Ed25519PrivateKey]
) -> None:
    m = one.machine(0)
    inspect = await one.verb("inspect", 0)
    assert inspect.batch_id is None  # the ramdisk only reads: no approval needed
    await one.reaches(0, "inspected", timeout=120)
    commission = await one.verb("commission", 0)
    await approve(one, commission.batch_id, keys["alice"])
    await one.reaches(0, "ready", timeout=120)
    writes = m.ledger.count("disk.write")

    deploy = await one.verb("deploy", 0, image=IMAGE, profile=PROFILE)

    async def waits_or_wrote() -> bool:
        if m.ledger.count("install") or m.ledger.count("disk.write") > writes:
            return True
        why = await one.engine.why(id=deploy.workflow_id)
        return any(r.kind == "batch-approval" for r in why.reasons)

    await until(waits_or_wrote, timeout=120, what="the deploy waits for its batch, or wrote")
    # nothing reached the machine: no medium, no power change, no install, no write
    assert (m.ledger.count("install"), m.ledger.count("disk.write") - writes) == (0, 0)
    assert [c.state for c in (await one.cq.list_commands(workflow_id=deploy.workflow_id)).commands] == [
        "pending"
    ]
    await approve(one, deploy.batch_id, keys["alice"])
    await one.reaches(0, "deployed", timeout=120)
    assert m.ledger.count("install") == 1
