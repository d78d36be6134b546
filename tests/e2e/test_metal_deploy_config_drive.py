"""The shipped ``metal.deploy`` (``bcx deploy``'s default) with the real bcd on the metal simulator.

The ramdisk's bcd (``--simulate``: its real code paths on a disk file) writes the signed image,
fetches the rendered user data through the secrets gate (the reference came from
``userdata.render``, another step of the workflow) and writes a NoCloud config drive after the
image's partitions; the machine boots its disk, its "cloud-init" reads the ``cidata`` partition
(``write_files``: the join token), and the installed OS's bcd joins with that token as the same
node. Checked where it happens: the machine's disk file (the image's bytes, the config drive
found by ``sfdisk`` and ``blkid``, the token-bearing user data in it), the disk writes the
simulated hardware counted, and no token in any result or log.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest

from better_compute.config import Settings
from better_compute.service import ApiClient
from better_compute.testing import ServiceProcesses
from better_compute.testing.images import register_sim_image
from better_compute.testing.metal_sim import fleet_stack
from better_compute.testing.metal_sim.nocloud import OS_MARK, config_drive

pytestmark = pytest.mark.e2e

MIB = 1 << 20
TOKEN = re.compile(rb"bcjt_[A-Za-z0-9_-]{43}")


def os_image(path: Path) -> bytes:
    """A 4 MiB cloud image: an MBR, one root partition holding the simulated OS."""
    with path.open("wb") as fh:
        fh.truncate(4 * MIB)
    subprocess.run(["sfdisk", "-q", str(path)], input="label: dos\nstart=2048, size=4096, type=83\n",
                   text=True, check=True, capture_output=True)  # fmt: skip
    with path.open("r+b") as fh:
        fh.seek(MIB)
        fh.write(OS_MARK + b"debian-12\n" + bytes(range(256)) * 64)
    return path.read_bytes()


def tool(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


async def test_metal_deploy_writes_the_image_and_a_config_drive_the_os_joins_with(
    tmp_path: Path, bc_settings: Settings, bc_api: ApiClient, bc_processes: ServiceProcesses
) -> None:
    body = os_image(tmp_path / "os.raw")
    digest = hashlib.sha256(body).hexdigest()
    async with fleet_stack(tmp_path / "fleet", bc_settings, machines=1, processes=bc_processes,
                           api=bc_api) as stack:  # fmt: skip
        try:
            url = stack.media.add("os.raw", body)
            # signed by the key the fleet app's image_verifier trusts (testing.images)
            await register_sim_image(stack.engine, "tos@1", url=url, data=body)
            assert digest == (await stack.engine.get_image(ref="tos@1")).sha256
            m, node_id = stack.machine(0), stack.nodes[0]
            await stack.verb("inspect", 0)
            await stack.reaches(0, "inspected")
            await stack.verb("commission", 0)
            await stack.reaches(0, "ready")
            run = await stack.verb("deploy", 0, image="tos@1")
            assert run.profile.id == "metal.deploy"
            node = await stack.reaches(0, "deployed", timeout=120)
            assert node.image == "tos@1"

            wf = await stack.engine.get_workflow(id=run.workflow_id)
            steps = {s.action: s for s in wf.steps}
            joined = [s.result for s in wf.steps if s.action == "wait.agentJoined"]
            # the installed OS's bcd joined with the user data's provisioned token: the same node
            assert (joined[-1]["agentId"], joined[-1]["role"]) == (node_id, "provisioned")
            write = await stack.cq.get(id=steps["deploy.deploy"].result["commandId"])
            assert (write.state, write.attested) == ("succeeded", True)
            assert write.payload["userDataRef"] == steps["userdata.render"].result["userDataRef"]
            result = json.loads(write.result or b"{}")
            drive = result["configDrive"]
            assert (drive["table"], drive["partition"], drive["label"]) == ("mbr", 2, "cidata")

            # the disk file: the image's bytes, then the config drive on a new partition
            disk = m.disk()
            data = disk.read_bytes()
            assert data[MIB : 4 * MIB] == body[MIB:]  # the image's partition as it was
            assert data[:446] == body[:446]  # its boot code too
            parts = json.loads(tool("sfdisk", "-J", str(disk)))["partitiontable"]["partitions"]
            assert len(parts) == 2
            new = parts[1]
            assert new["start"] * 512 == drive["offset"] >= len(body)
            at, size = str(new["start"] * 512), str(new["size"] * 512)
            probe = tool("blkid", "-p", "-o", "export", "-O", at, "-S", size, str(disk))
            assert "LABEL=cidata" in probe.splitlines()
            assert "TYPE=iso9660" in probe.splitlines()
            files = config_drive(disk)
            assert files is not None
            assert files["meta-data"].decode().startswith(f"instance-id: {node_id}\n")
            assert files["user-data"].startswith(b"#cloud-config\n")
            [token] = TOKEN.findall(files["user-data"])
            # the installed OS read it off the drive (cloud-init's write_files) and joined with it:
            # the single-use token userdata.render minted is spent, and bcd join removed the file
            [init] = [e for e in m.ledger.events("cloud-init") if e.get("new_instance")]
            assert init["files"] == ["/etc/bcd/join-token"]
            assert init["meta_data"] == files["meta-data"].decode()
            minted = await stack.pki.get_join_token(
                join_token_id=steps["userdata.render"].result["joinTokenId"]
            )
            assert (minted.role, minted.uses, minted.node_id) == ("provisioned", 1, node_id)
            assert not (m.tree / "etc/bcd/join-token").exists()

            # written once: one open of the disk for writing by the image write, none after it
            writes = m.ledger.events("disk.write")
            image = [e for e in writes if e["kind"] == "node.imageWrite"]
            assert [e["commandId"] for e in image] == [write.id]
            assert [e for e in writes if e["t"] > image[0]["t"]] == []

            # the token is on the machine's disk and nowhere else: no result, payload or log
            for cmd in (await stack.cq.list_commands(workflow_id=run.workflow_id)).commands:
                full = await stack.cq.get(id=cmd.id)
                assert TOKEN.findall(json.dumps(full.payload).encode() + (full.result or b"")) == []
            assert TOKEN.findall(json.dumps([s.result for s in wf.steps]).encode()) == []
            for path in stack.log_files():
                assert token not in path.read_bytes(), path
        finally:
            print(json.dumps(stack.machine(0).ledger.counts(), sort_keys=True))
            print(stack.tails())
